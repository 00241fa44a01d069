"""Helpers for tests of the engine over the test-only memory fabric
(fabric.backends._memory): two Workers without progress threads, one
endpoint each, joined by a MemoryLink whose items only the test moves."""
from __future__ import annotations

from fabric import options as _options
from fabric.protocol.engine import Worker

from conftest import small_options

memory = None
try:
    from fabric.backends import _memory as memory
except ImportError:  # pragma: no cover - built without it (FABRIC_MEMORY_FABRIC=off)
    pass

EP_OPEN = 2


class MemPair:
    """eps[i] is attached to side i of the link; both handshakes are pending."""

    def __init__(self, caps=None, send_depth=2, rkey_len=8, strict_recv=False, adapt_mask=0, **opts):
        self.backend = memory.MemoryBackend()
        options = _options.resolve("memory", self.backend.default_options(),
                                   small_options(progress_thread=0, spin_us=0, **opts))
        self.options = options
        self.link = memory.MemoryLink(memory.DEFAULT_CAPS if caps is None else caps,
                                      send_depth, rkey_len, strict_recv)
        # adapt_mask: the thresholds that adapt to the link (fabric.options.ADAPTIVE bits)
        engine_options = dict(options, adapt=1 if adapt_mask else 0, _adapt_mask=adapt_mask)
        self.workers = [Worker(self.backend, engine_options), Worker(self.backend, engine_options)]
        self.eps = [self.link.attach(self.workers[i], i) for i in range(2)]

    def deliverable(self):
        return [p for p in self.link.pending() if p[4]]

    def progress(self):
        for w in self.workers:
            w.progress()

    def settle(self, limit=20000):
        """Deliver the oldest deliverable item and progress both sides until
        nothing is left to deliver. Returns False if it never got quiet;
        self.delivered counts what it delivered."""
        self.delivered = 0
        for _ in range(limit):
            self.progress()
            items = self.deliverable()
            if not items:
                self.progress()
                if not self.deliverable():
                    return True
                continue
            self.link.deliver(items[0][0])
            self.delivered += 1
        return False

    def debug(self, side):
        eps = self.workers[side]._debug_state().get("endpoints", [])
        return eps[0] if eps else None

    def credits_balance(self, sender):
        """The credits of direction sender -> receiver, wherever they are now:
        still the sender's, used by messages in flight, owed by the receiver
        (to return or held), or returning in messages in flight. None when
        the balance is not defined (either side not open, or failed)."""
        receiver = 1 - sender
        ds, dr = self.debug(sender), self.debug(receiver)
        if ds is None or dr is None or ds["state"] != EP_OPEN or dr["state"] != EP_OPEN:
            return None
        if any(self.link.state(i)["failed"] or self.link.state(i)["closed"] for i in range(2)):
            return None
        used, _ = self.link.inflight(sender)
        _, returning = self.link.inflight(receiver)
        return ds["peer_credits"] + used + dr["c2r"] + dr["held"] + returning

    def close(self):
        for ep in self.eps:
            ep.close(linger=0)
        self.settle()
        for w in self.workers:
            w.close(linger=0)
