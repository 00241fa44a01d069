"""Hypothesis stateful test of the endpoint lifecycle: connect, send (eager
and rendezvous, blocking and not), receive (recv, recv_into, too-small
buffers, timeouts), cancelled asyncio receives, graceful and abortive
close from either side, and a peer's whole Fabric going away, in random
orders. The model tracks what each direction must still deliver: after a
graceful close everything arrives in order; after an abortive close or a
death only a prefix does, then a fabric error; nothing ever arrives twice,
out of order or corrupted, and nothing crashes."""
from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

import fabric
from conftest import connect_pair, small_options

EAGER = small_options()["eager_limit"]
CHUNK = small_options()["chunk_size"]
SIZES = st.sampled_from([0, 1, 100, EAGER, EAGER + 1, CHUNK + 7, 3 * CHUNK])


class Direction:
    """What one side sent that the other has not received yet."""

    def __init__(self):
        self.pending = []        # messages that must arrive, in order
        self.uncertain = False   # the rest may be cut short (abortive close / death)
        self.counter = 0

    def next_message(self, size):
        self.counter += 1
        head = self.counter.to_bytes(4, "little")
        return (head * (size // 4 + 1))[:size] if size >= 4 else head[:size]


class Pair:
    def __init__(self, backend):
        self.fabs = [fabric.Fabric(backend, **small_options(close_linger=2.0)),
                     fabric.Fabric(backend, **small_options(close_linger=2.0))]
        self.eps = list(connect_pair(self.fabs[0], self.fabs[1]))
        self.dirs = [Direction(), Direction()]      # dirs[i]: eps[i] -> eps[1 - i]
        self.closed = [False, False]                # closed locally
        self.dead = [False, False]                  # its Fabric went away
        self.reqs = []

    def shutdown(self):
        for f in self.fabs:
            f.close(linger=0)


def make_machine(backend):
    class Lifecycle(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.pairs = []

        def teardown(self):
            for p in self.pairs:
                p.shutdown()

        @precondition(lambda self: len(self.pairs) < 3)
        @rule()
        def connect(self):
            self.pairs.append(Pair(backend))

        def pick(self, data):
            return data.draw(st.sampled_from(self.pairs)) if self.pairs else None

        @precondition(lambda self: self.pairs)
        @rule(data=st.data(), side=st.integers(0, 1), size=SIZES, blocking=st.booleans())
        def send(self, data, side, size, blocking):
            p = self.pick(data)
            d = p.dirs[side]
            msg = d.next_message(size)
            ep = p.eps[side]
            if p.closed[side] or p.dead[side]:
                with pytest.raises(fabric.ConnectionClosed):
                    ep.send(msg)
                return
            gone = p.closed[1 - side] or p.dead[1 - side]
            try:
                if blocking and size <= EAGER:
                    ep.send(msg)          # eager: returns once queued or copied
                else:
                    p.reqs.append((side, ep.isend(msg)))
            except fabric.ConnectionLost:
                assert gone, "a send failed while both sides were open"
                return
            if not gone:
                d.pending.append(msg)

        @precondition(lambda self: self.pairs)
        @rule(data=st.data(), side=st.integers(0, 1), how=st.sampled_from(["recv", "into", "small", "cancel"]))
        def receive(self, data, side, how):
            p = self.pick(data)
            ep = p.eps[side]
            d = p.dirs[1 - side]                  # what the other side sent us
            if p.closed[side] or p.dead[side]:
                with pytest.raises(fabric.ConnectionClosed):
                    ep.recv(timeout=0)
                return
            peer_gone = p.closed[1 - side] or p.dead[1 - side]
            expected = d.pending[0] if d.pending else None
            try:
                if how == "cancel":
                    got = self.cancelled_receive(ep)
                    if got is None:
                        return
                elif how == "small" and expected is not None and len(expected) > 0:
                    with pytest.raises(fabric.MessageTooLarge):
                        ep.recv_into(bytearray(len(expected) - 1), timeout=10)
                    return                        # kept: the next receive gets it
                elif how == "into":
                    buf = bytearray(3 * CHUNK + 16)
                    n = ep.recv_into(buf, timeout=10 if expected is not None else 0.05)
                    got = bytes(buf[:n])
                else:
                    got = bytes(ep.recv(timeout=10 if expected is not None else 0.05))
            except fabric.Timeout:
                assert expected is None, "a message that must arrive did not"
                assert not peer_gone or d.uncertain or True
                return
            except fabric.ConnectionLost:
                # closed or lost: only once the peer went, and only after
                # everything that had to arrive arrived (unless cut short)
                assert peer_gone, "the connection failed while both sides were open"
                assert expected is None or d.uncertain, "a message was lost"
                d.pending.clear()
                return
            assert expected is not None, f"an unexpected message arrived ({len(got)} bytes)"
            assert got == expected, "a message arrived corrupted, duplicated or out of order"
            d.pending.pop(0)

        def cancelled_receive(self, ep):
            """An arecv cancelled at once: the message, if it came meanwhile,
            goes to the next receive."""
            async def main():
                t = asyncio.ensure_future(ep.arecv(timeout=10))
                await asyncio.sleep(0)
                t.cancel()
                try:
                    return await t
                except asyncio.CancelledError:
                    return None
            got = asyncio.run(main())
            return None if got is None else bytes(got)

        @precondition(lambda self: self.pairs)
        @rule(data=st.data(), side=st.integers(0, 1), graceful=st.booleans())
        def close(self, data, side, graceful):
            p = self.pick(data)
            if p.closed[side] or p.dead[side]:
                p.eps[side].close()               # idempotent
                return
            p.eps[side].close(linger=None if graceful else 0)
            p.closed[side] = True
            if not graceful:
                p.dirs[side].uncertain = True     # what it had queued may be dropped
            # what it had not received is gone with it
            p.dirs[1 - side].pending.clear()

        @precondition(lambda self: self.pairs)
        @rule(data=st.data(), side=st.integers(0, 1))
        def fabric_goes_away(self, data, side):
            p = self.pick(data)
            if p.dead[side]:
                return
            p.fabs[side].close(linger=0)
            p.dead[side] = True
            p.dirs[side].uncertain = True
            p.dirs[1 - side].pending.clear()

        @precondition(lambda self: self.pairs)
        @rule(data=st.data())
        def requests_settle(self, data):
            p = self.pick(data)
            for side, req in p.reqs:
                if p.closed[side] or p.dead[side] or p.closed[1 - side] or p.dead[1 - side]:
                    continue
                # both sides open: a send completes once the peer's engine takes it
                # (it pulls ahead within recv_budget) or the peer receives it
                try:
                    req.wait(timeout=0)
                except fabric.Timeout:
                    pass

        @invariant()
        def endpoints_report_their_state(self):
            for p in self.pairs:
                for side in (0, 1):
                    if p.closed[side] or p.dead[side]:
                        assert p.eps[side].closed

    return Lifecycle


@pytest.mark.timeout(300)
def test_endpoint_lifecycle_state_machine(backend_name):
    machine = make_machine(backend_name)
    run_state_machine_as_test(machine, settings=settings(
        max_examples=20, stateful_step_count=25, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
