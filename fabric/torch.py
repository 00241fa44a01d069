"""fabric as a torch.distributed backend: ``init_process_group("fabric")``.

``import fabric.torch`` registers the backend "fabric" for CPU tensors. Each
process group opens a Fabric (backend from ``FABRIC_BACKEND``, else fabric's
automatic choice), listens, publishes its address in the c10d store and
connects to every other rank of the group at creation (a full mesh: rank j
dials every lower rank, which accepts), then stops listening.

Every call returns a Work at once, also for ``async_op=False`` (torch then
waits on it); the group's own threads make the progress, never the caller's:
- collectives run in the order they are issued (c10d's contract: every rank
  issues the group's collectives in the same order) on the group's
  collectives thread;
- one reader thread per peer receives everything that peer sends, in order,
  and puts each transfer straight into the buffer a receive was posted for
  (a tensor's own storage), or keeps it until one is posted;
- point-to-point operations start on the caller's thread: a send at once, a
  receive by posting it; neither waits behind a collective or another
  receive. A send thread completes their Works and times out receives.

Wire format between two ranks: each transfer is a 32-byte header (kind,
tag, collective sequence number, byte count), followed in the same fabric
message by the bytes when they are few (``INLINE``), otherwise by one fabric
message of its own, sent from the tensor's storage and received into the
destination's storage (zero-copy; large messages are pulled in chunks by the
engine).

Algorithms, by size: all_reduce below ``FABRIC_TORCH_RING_MIN`` bytes by
recursive doubling (log2 steps of whole tensors; folded for sizes that are
not powers of two), above it by a ring reduce-scatter then ring all-gather
pipelined in pieces; every rank ends with bit-identical results. broadcast
and reduce by binomial trees, all_gather and reduce_scatter by rings,
all_to_all pairwise, barrier by dissemination. Reductions run in place with
torch's own kernels (the GIL released while they run).

Failures: a rank that dies fails every operation waiting on it at once, with
an error naming the rank; the rank that saw it tells the others (ABORT), so
their pending collectives fail too; every wait ends at the operation's
timeout (the group's, or the call's own). ``destroy_process_group()`` closes
the group's Fabric and joins its threads.
"""
from __future__ import annotations

import ctypes
import datetime
import heapq
import ipaddress
import logging
import os
import queue
import socket
import struct
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

import fabric
from fabric.errors import ConnectionClosed, ConnectionLost, FabricError, Timeout

logger = logging.getLogger("fabric.torch")

BACKEND_NAME = "fabric"
HEADER = struct.Struct("<BBHIqQQ")       # kind, flags, 0, 0, tag, sequence, bytes
COLL, P2P, ABORT = 1, 2, 3
INLINE_FLAG = 1
INLINE = 16 * 1024          # bytes sent inside the header's message
# all_reduce takes the ring from RING_MIN bytes (FABRIC_TORCH_RING_MIN),
# measured (bench/torch_compare.py @ring against @doubling; RESULTS.md):
# recursive doubling wins below 2-4 MiB on ucx at 2 ranks and on tcp and ucx
# at 4, below 0.5-1 MiB on tcp at 2 ranks. The
# ring moves pieces of a quarter of a segment, within CHUNK_MIN..CHUNK_MAX
# bytes (FABRIC_TORCH_CHUNK fixes the size). Read per group. Measured in
# bench/torch_compare.py: fixed 1 MiB pieces lose up to 25% at 256 MiB to
# per-message costs, 16 MiB pieces lose the pipelining at 16 MiB.
RING_MIN = 2 << 20
RING_MIN_SERVED_PAIR = 512 << 10  # two ranks on a fabric whose pulls the peer's CPU serves (tcp)
CHUNK_MIN = 1 << 20
CHUNK_MAX = 16 << 20


def _ring_min_for(capabilities: tuple[str, ...], size: int) -> int:
    """Where all_reduce switches to the ring, from what the fabric can do.
    Recursive doubling moves the whole tensor each step, the ring about
    twice the tensor in all; where every byte costs the CPU at both ends
    (the peer's side serves our pulls: "reads_served", tcp) the ring's
    smaller volume pays off from 512 KiB at two ranks; with one-sided or
    native transfers (verbs, ucx) doubling's fewer steps win up to 2 MiB."""
    if size == 2 and "reads_served" in capabilities and "native_read" not in capabilities:
        return RING_MIN_SERVED_PAIR
    return RING_MIN


def _env_bytes(name: str, default: int) -> int:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected a number of bytes") from None
    if value < 0:
        raise ValueError(f"{name}={text!r}: expected a number of bytes >= 0")
    return value
UNFOLD = 1 << 30            # step number of recursive doubling's last transfer
# Bytes one peer's transfers may occupy here before a receive is posted for
# them (FABRIC_TORCH_EARLY_MAX); past it the group gives up on that peer.
# The reader thread cannot leave them on the connection instead: the
# collectives' messages behind them would wait too.
EARLY_MAX = 1 << 30


class FabricPGError(RuntimeError):
    """A collective or p2p operation of a fabric process group failed."""


# ---------------------------------------------------------------- helpers

def _byte_view(t: torch.Tensor):
    """The bytes of a contiguous CPU tensor as a writable buffer, without a
    copy and without numpy (torch does not require it); the buffer keeps the
    tensor alive."""
    if not t.is_contiguous():
        raise ValueError("fabric process group: internal error: a non-contiguous tensor to move")
    n = t.numel() * t.element_size()
    if n == 0:
        return bytearray()
    view = (ctypes.c_ubyte * n).from_address(t.data_ptr())
    view._tensor = t
    return view


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _op_of(opts):
    """The reduce op of c10d options, as ReduceOp.RedOpType (ReduceOp.SUM ...):
    a ReduceOp object compares equal to them only from its own side."""
    op = opts.reduceOp if opts is not None else ReduceOp.SUM
    return getattr(op, "op", op)


def _reduce_into(dst: torch.Tensor, src: torch.Tensor, op) -> None:
    """dst = dst (op) src, in place, with torch's kernels."""
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        if dst.dtype == torch.bool:
            dst.logical_or_(src)
        else:
            dst.add_(src)
    elif op == ReduceOp.PRODUCT:
        if dst.dtype == torch.bool:
            dst.logical_and_(src)
        else:
            dst.mul_(src)
    elif op == ReduceOp.MIN:
        torch.minimum(dst, src, out=dst)
    elif op == ReduceOp.MAX:
        torch.maximum(dst, src, out=dst)
    elif op == ReduceOp.BAND:
        dst.bitwise_and_(src)
    elif op == ReduceOp.BOR:
        dst.bitwise_or_(src)
    elif op == ReduceOp.BXOR:
        dst.bitwise_xor_(src)
    else:
        raise ValueError(f"fabric process group: reduce op {op} is not supported")


def _check_op(op, dtype) -> None:
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR) and (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"fabric process group: {op} needs an integer or bool tensor, not {dtype}")
    if op in (ReduceOp.MIN, ReduceOp.MAX) and dtype.is_complex:
        raise ValueError(f"fabric process group: {op} is undefined for complex tensors ({dtype})")
    if op == ReduceOp.AVG and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"fabric process group: AVG needs a floating point tensor, not {dtype}")
    if op not in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX,
                  ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        raise ValueError(f"fabric process group: reduce op {op} is not supported")


def _finish_avg(t: torch.Tensor, op, n: int) -> None:
    if op == ReduceOp.AVG:
        t.div_(n)


def _root_cause(message: str) -> str:
    """'fabric process group: rank 3 gave up: fabric process group: rank 7 is
    gone (...)' -> 'rank 7 is gone (...)'."""
    prefix = "fabric process group: "
    while True:
        if message.startswith(prefix):
            message = message[len(prefix):]
        head, sep, rest = message.partition(" gave up: ")
        if sep and head.startswith("rank ") and head[5:].isdigit():
            message = rest
            continue
        return message


def _split_points(numel: int, parts: int) -> list[int]:
    """Element offsets cutting numel into `parts` near-equal pieces."""
    base, extra = divmod(numel, parts)
    points = [0]
    for i in range(parts):
        points.append(points[-1] + base + (1 if i < extra else 0))
    return points


def _local_host() -> str:
    """The address peers reach this process at: FABRIC_TORCH_HOST, else the
    local address of the route to MASTER_ADDR (nothing is sent), else this
    host's name's address, else loopback."""
    explicit = os.environ.get("FABRIC_TORCH_HOST")
    if explicit:
        return explicit
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            family = socket.AF_INET6 if ":" in master else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
                return s.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _address(host: str, port: int) -> str:
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


# ------------------------------------------------------------ connections

class _Waiter:
    """A receive posted for one transfer: filled by the peer's reader thread
    (into `dest`, or as the message itself when dest is None), then `done`
    is set; `then` (if any) runs on the reader thread once it is filled."""

    __slots__ = ("dest", "data", "error", "done", "then", "claim", "source")

    def __init__(self, dest, then=None, claim=None, source: int = -1) -> None:
        self.dest = dest
        self.data = None
        self.error: str | None = None
        self.done = threading.Event()
        self.then = then
        self.claim: _Claim | None = claim      # a receive from any rank: one waiter per rank
        self.source = source

    def nbytes(self) -> int:
        return memoryview(self.dest).nbytes

    def fill(self, data) -> None:
        if self.dest is None:
            self.data = data
        else:
            view = memoryview(data).cast("B")
            if view.nbytes != self.nbytes():
                self.error = (f"{view.nbytes} bytes arrived where {self.nbytes()} were expected "
                              "(tensors of different sizes or dtypes on the ranks?)")
            else:
                memoryview(self.dest).cast("B")[:] = view
        self.finish()

    def fail(self, error: str) -> None:
        self.error = error
        self.finish()

    def finish(self) -> None:
        self.done.set()
        if self.then is not None:
            self.then(self)


class _Claim:
    """The waiters of one receive from any rank: the first rank whose
    transfer matches takes it; the others' waiters are dropped unfilled."""

    __slots__ = ("lock", "winner", "failed")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.winner: int | None = None
        self.failed = 0

    def take(self, rank: int) -> bool:
        with self.lock:
            if self.winner is None:
                self.winner = rank
                return True
            return False

    @property
    def taken(self) -> bool:
        return self.winner is not None


class _Peer:
    """One other rank: its endpoint, the receives posted for its transfers,
    and the transfers that arrived before anyone asked for them. Only its
    reader thread receives from the endpoint; sends take `send_lock` so a
    header and the message it announces stay adjacent."""

    __slots__ = ("rank", "ep", "lock", "send_lock", "posted", "early", "early_bytes", "error", "reader")

    def __init__(self, rank: int, ep) -> None:
        self.rank = rank
        self.ep = ep
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.posted: dict[tuple, deque] = {}
        self.early: dict[tuple, deque] = {}
        self.early_bytes = 0                # what `early` holds (FABRIC_TORCH_EARLY_MAX bounds it)
        self.error: str | None = None
        self.reader: threading.Thread | None = None

    def post(self, key: tuple, waiter: _Waiter) -> _Waiter:
        with self.lock:
            # what arrived before the peer failed is still its to take
            queue_ = self.early.get(key)
            early = None
            if queue_ and (waiter.claim is None or waiter.claim.take(self.rank)):
                early = queue_.popleft()
                self.early_bytes -= memoryview(early).nbytes
                if not queue_:
                    del self.early[key]
            if early is None and self.error is None:
                if waiter.claim is not None and waiter.claim.taken:
                    return waiter                 # another rank's transfer took it
                self.posted.setdefault(key, deque()).append(waiter)
                return waiter
        if early is None:
            waiter.fail(self.error)
        else:
            waiter.fill(early)
        return waiter

    def take_posted(self, key: tuple) -> _Waiter | None:
        """The oldest receive posted for key (the caller holds the lock);
        a receive from any rank that another rank's transfer took is dropped."""
        waiting = self.posted.get(key)
        found = None
        while waiting and found is None:
            waiter = waiting.popleft()
            if waiter.claim is None or waiter.claim.take(self.rank):
                found = waiter
        if waiting is not None and not waiting:
            del self.posted[key]
        return found

    def cancel(self, key: tuple, waiter: _Waiter) -> bool:
        """Withdraw a posted receive nothing arrived for (False: too late)."""
        with self.lock:
            waiting = self.posted.get(key)
            if not waiting or waiter not in waiting:
                return False
            waiting.remove(waiter)
            if not waiting:
                del self.posted[key]
            return True

    def fail(self, error: str, drop_arrived: bool = False) -> None:
        """The peer is unusable: every receive posted for it fails, and so
        does every later one that nothing arrived for (a rank that sent and
        left is gone, but what it sent is not: drop_arrived only when the
        group itself goes)."""
        with self.lock:
            if self.error is None:
                self.error = error
            waiters = [w for q in self.posted.values() for w in q]
            self.posted.clear()
            if drop_arrived:
                self.early.clear()
                self.early_bytes = 0
        for w in waiters:
            w.fail(self.error)


class _Deadline:
    def __init__(self, seconds: float, what: str) -> None:
        self.at = time.monotonic() + seconds
        self.seconds = seconds
        self.what = what

    def left(self) -> float:
        return self.at - time.monotonic()


class _Work(dist._Work):
    """A Work over a torch Future. (torch's `_create_work_from_future` makes
    one whose wait() returns True even when the future failed: errors would
    vanish.) wait() raises the operation's error; with a timeout it raises
    once that passed without completion."""

    def __init__(self, fut: torch.futures.Future, source: int = -1) -> None:
        super().__init__()
        self._fut = fut
        self._source = source
        self._done = threading.Event()
        fut.add_done_callback(lambda _: self._done.set())

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        seconds = timeout.total_seconds() if timeout else 0.0
        if seconds > 0 and not self._done.wait(seconds):
            raise FabricPGError(f"fabric process group: work not completed within {seconds:g} s")
        self._fut.wait()                  # raises the operation's error
        return True

    def get_future(self) -> torch.futures.Future:
        return self._fut

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        return self._fut.done() and self.exception() is None

    def exception(self):
        if not self._fut.done():
            return None
        try:
            self._fut.wait()
        except Exception as e:            # noqa: BLE001 - reported, not raised
            return e
        return None

    def source_rank(self) -> int:
        return self._source

    _source_rank = source_rank       # what dist.recv(src=None) asks

    def synchronize(self) -> None:
        self.wait()


# ---------------------------------------------------------- process group

class FabricProcessGroup(dist.ProcessGroup):
    """A torch.distributed process group over fabric (see the module doc)."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta):
        super().__init__(rank, size)
        self._rank = rank
        self._size = size
        self._timeout = timeout.total_seconds() if timeout is not None else 1800.0
        self._seq = 0                       # collectives issued (same on every rank)
        self._broken: str | None = None
        self._closed = False
        self._scratch: torch.Tensor | None = None
        self._chunk = _env_bytes("FABRIC_TORCH_CHUNK", 0)             # 0: by segment size
        self._ring_min = _env_bytes("FABRIC_TORCH_RING_MIN", -1)       # -1: the fabric's own
        self._early_max = _env_bytes("FABRIC_TORCH_EARLY_MAX", EARLY_MAX)
        self._fabric = fabric.Fabric(os.environ.get("FABRIC_BACKEND") or None)
        if self._ring_min < 0:
            self._ring_min = _ring_min_for(self._fabric.backend.capabilities, size)
        self._peers: dict[int, _Peer] = {}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()       # collectives, in issue order
        self._sends: queue.SimpleQueue = queue.SimpleQueue()       # p2p sends to complete
        try:
            self._connect(store)
        except BaseException:
            self._fabric.close(linger=0)
            raise
        threads = [threading.Thread(target=self._run, name=f"fabric-pg{rank}-collectives", daemon=True),
                   threading.Thread(target=self._complete_sends, name=f"fabric-pg{rank}-sends", daemon=True)]
        for peer in self._peers.values():
            peer.reader = threading.Thread(target=self._read, args=(peer,), daemon=True,
                                           name=f"fabric-pg{rank}-from{peer.rank}")
            threads.append(peer.reader)
        for t in threads:
            t.start()
        logger.debug("%r connected (all_reduce by ring from %d bytes)", self, self._ring_min)
        # abort() closes at once; shutdown() and the finalizer let what is
        # queued leave first (see _shutdown)
        self._close_linger: list[float | None] = [None]
        self._finalizer = weakref.finalize(self, _shutdown, (self._queue, self._sends), self._fabric,
                                           threads, list(self._peers.values()), self._close_linger)

    # ---- set-up
    def _connect(self, store) -> None:
        deadline = _Deadline(self._timeout, "connecting the process group")
        if self._size == 1:
            return
        host = _local_host()
        # listening only while the group connects, on every address of the
        # family peers reach us by
        listener = self._fabric.listen(_address("::" if ":" in host else "0.0.0.0", 0))
        port = int(listener.address.rsplit(":", 1)[1])
        store.set(f"fabric/{self._rank}", _address(host, port))
        try:
            # dial every lower rank; the higher ones dial us
            for peer in range(self._rank):
                address = store.get(f"fabric/{peer}").decode()
                ep = self._fabric.connect(address, timeout=max(1.0, deadline.left()))
                ep.send(struct.pack("<q", self._rank))
                self._peers[peer] = _Peer(peer, ep)
            for _ in range(self._size - 1 - self._rank):
                ep = listener.accept(timeout=max(1.0, deadline.left()))
                (peer,) = struct.unpack("<q", bytes(ep.recv(timeout=max(1.0, deadline.left()))))
                if not self._rank < peer < self._size or peer in self._peers:
                    raise FabricPGError(f"fabric process group: unexpected hello from rank {peer}")
                self._peers[peer] = _Peer(peer, ep)
        finally:
            listener.close()

    # ---- c10d hooks
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def shutdown(self) -> None:
        """Close the group's connections and stop its threads (idempotent)."""
        if not self._closed:
            self._closed = True
            self._finalizer()

    def abort(self) -> None:
        """shutdown() without letting queued sends leave."""
        self._close_linger[0] = 0.0
        self.shutdown()

    # a ProcessGroup written in Python has no backend object to carry its
    # name (c10d keeps it there): destroy_process_group() needs it back
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return getattr(self, "_group_name", "")

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return getattr(self, "_group_desc", "")

    def __repr__(self) -> str:
        return f"<FabricProcessGroup rank {self._rank} of {self._size} on {self._fabric.name}>"

    # ---- the collectives' thread
    def _seconds(self, timeout) -> float:
        if timeout is not None:
            t = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
            if t > 0:
                return t
        return self._timeout

    def _submit(self, name: str, fn: Callable[[_Deadline], Any], result, timeout=None):
        fut = torch.futures.Future()
        if self._closed:
            fut.set_exception(FabricPGError(f"fabric process group: {name} after the group was destroyed"))
        else:
            self._queue.put((name, fn, result, fut, self._seconds(timeout)))
        return _Work(fut)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            name, fn, result, fut, seconds = item
            if self._broken is not None:
                fut.set_exception(FabricPGError(f"fabric process group: {name} not run: {self._broken}"))
                continue
            try:
                fn(_Deadline(seconds, name))
            except BaseException as e:        # noqa: BLE001 - handed to the Work
                message = str(e) if isinstance(e, FabricPGError) else f"fabric process group: {name} failed: {e}"
                if not isinstance(e, (ValueError, TypeError)):
                    self._broken = message    # a transfer failed midway: the group is out of step
                    logger.info("%r is broken: %s", self, message)
                    self._tell_peers(message)
                fut.set_exception(FabricPGError(message))
            else:
                fut.set_result(result)

    def _keep_early(self, p: _Peer, key: tuple, data) -> None:
        """Keep a transfer nobody has asked for yet (p.lock held), within the
        group's bound: a peer may not make this rank hold without limit what
        no receive takes."""
        p.early.setdefault(key, deque()).append(data)
        p.early_bytes += memoryview(data).nbytes
        if p.early_bytes > self._early_max:
            raise FabricPGError(f"rank {p.rank} sent {p.early_bytes} bytes that no receive was posted for, "
                                f"more than FABRIC_TORCH_EARLY_MAX={self._early_max}: post receives sooner "
                                f"or raise the limit")

    def _tell_peers(self, message: str) -> None:
        """Best effort: every other rank learns why this one gave up: the
        root cause, not the chain of ranks that passed it on."""
        body = _root_cause(message).encode()[:4000]
        for peer in self._peers.values():
            try:
                with peer.send_lock:
                    peer.ep.isend([HEADER.pack(ABORT, INLINE_FLAG, 0, 0, 0, 0, len(body)), body])
            except FabricError:
                pass

    # ---- each peer's reader thread
    def _read(self, p: _Peer) -> None:
        """Receive everything rank p sends, in order: each header names the
        transfer it starts; its bytes go straight into the receive posted for
        it, else are kept until one is posted."""
        waiter = None                      # the receive being filled, if any
        while True:
            try:
                waiter = None
                head = p.ep.recv()
                if len(head) < HEADER.size:
                    raise FabricPGError(f"rank {p.rank} sent a malformed header ({len(head)} bytes)")
                kind, flags, _, _, tag, seq, n = HEADER.unpack_from(head, 0)
                inline = bool(flags & INLINE_FLAG)
                if kind not in (COLL, P2P, ABORT) or len(head) != HEADER.size + (n if inline else 0):
                    raise FabricPGError(f"rank {p.rank} sent a malformed header")
                if kind == ABORT:
                    reason = bytes(head[HEADER.size:]).decode(errors="replace")
                    p.fail(f"fabric process group: rank {p.rank} gave up: {reason}")
                    continue
                key = (kind, tag, seq)
                if inline:
                    data = memoryview(head)[HEADER.size:]
                    with p.lock:
                        waiter = p.take_posted(key)
                        if waiter is None:
                            self._keep_early(p, key, data)
                    if waiter is not None:
                        waiter.fill(data)
                    continue
                with p.lock:
                    waiter = p.take_posted(key)
                if waiter is not None and waiter.dest is not None and waiter.nbytes() == n:
                    got = p.ep.recv_into(waiter.dest)     # zero-copy: straight into the tensor
                    if got != n:
                        raise FabricPGError(f"rank {p.rank} announced {n} bytes and sent {got}")
                    waiter.finish()
                    continue
                message = p.ep.recv()
                if len(message) != n:
                    raise FabricPGError(f"rank {p.rank} announced {n} bytes and sent {len(message)}")
                if waiter is None:
                    with p.lock:                           # a receive may have been posted meanwhile
                        waiter = p.take_posted(key)
                        if waiter is None:
                            self._keep_early(p, key, message)
                if waiter is not None:
                    waiter.fill(message)
            except (ConnectionClosed, ConnectionLost) as e:
                error = ("fabric process group: the group was destroyed" if self._closed
                         else f"fabric process group: rank {p.rank} is gone ({e})")
            except FabricPGError as e:
                error = f"fabric process group: {e}"
                p.ep.close(linger=0)
            except FabricError as e:
                error = f"fabric process group: receiving from rank {p.rank} failed: {e}"
            else:
                continue
            p.fail(error)
            if waiter is not None and not waiter.done.is_set():
                waiter.fail(p.error or error)
            return

    # ---- transfers
    def _send(self, peer: int, key: tuple, data) -> list:
        """Start sending data (a buffer) to peer; returns the requests."""
        kind, tag, seq = key
        p = self._peers[peer]
        n = memoryview(data).nbytes
        try:
            with p.send_lock:
                if n <= INLINE:
                    return [p.ep.isend([HEADER.pack(kind, INLINE_FLAG, 0, 0, tag, seq, n), data])]
                return [p.ep.isend(HEADER.pack(kind, 0, 0, 0, tag, seq, n)), p.ep.isend(data)]
        except FabricError as e:
            raise self._peer_failed(peer, e) from None

    def _wait_sent(self, requests: list, deadline: _Deadline) -> None:
        for req in requests:
            try:
                req.wait(timeout=max(0.0, deadline.left()))
            except Timeout:
                rank = next((r for r, p in self._peers.items() if p.ep is req.endpoint), "?")
                raise FabricPGError(f"fabric process group: {deadline.what} timed out after "
                                    f"{deadline.seconds:g} s sending to rank {rank}") from None
            except FabricError as e:
                raise self._peer_failed(req.endpoint, e) from None

    def _post(self, peer: int, key: tuple, dest=None, then=None) -> _Waiter:
        """Post a receive of transfer `key` from peer, into dest (a writable
        buffer of the exact size) or, without one, as the message itself."""
        return self._peers[peer].post(key, _Waiter(dest, then))

    def _wait(self, peer: int, waiter: _Waiter, deadline: _Deadline):
        if not waiter.done.wait(max(0.0, deadline.left())):
            raise FabricPGError(f"fabric process group: {deadline.what} timed out after "
                                f"{deadline.seconds:g} s waiting for rank {peer}")
        if waiter.error is not None:
            raise FabricPGError(waiter.error if waiter.error.startswith("fabric process group")
                                else f"fabric process group: {deadline.what}: rank {peer}: {waiter.error}")
        return waiter.data if waiter.dest is None else waiter.dest

    def _recv(self, peer: int, key: tuple, dest, deadline: _Deadline):
        return self._wait(peer, self._post(peer, key, dest), deadline)

    def _peer_failed(self, peer, error) -> FabricPGError:
        if not isinstance(peer, int):
            peer = next((r for r, p in self._peers.items() if p.ep is peer), "?")
        if isinstance(error, (ConnectionLost, ConnectionClosed)):
            return FabricPGError(f"fabric process group: rank {peer} is gone: {error}")
        return FabricPGError(f"fabric process group: transfer with rank {peer} failed: {error}")

    def _exchange(self, send_to, send_buf, recv_from, recv_dest, key, deadline):
        """Send to one rank and receive from another at once."""
        waiter = self._post(recv_from, key, recv_dest) if recv_from is not None else None
        reqs = self._send(send_to, key, send_buf) if send_to is not None else []
        got = self._wait(recv_from, waiter, deadline) if waiter is not None else None
        self._wait_sent(reqs, deadline)
        return got

    def _scratch_space(self, nbytes: int) -> torch.Tensor:
        """Scratch memory for incoming pieces, kept between collectives (only
        the collectives' thread uses it): a fresh allocation of tens of MiB
        costs a page fault per page on every call."""
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = None
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch[:nbytes]

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    # ---- all_reduce
    def _allreduce_flat(self, t: torch.Tensor, op, deadline: _Deadline, seq: int) -> None:
        """All-reduce a contiguous 1-D tensor in place."""
        n = self._size
        if n == 1 or t.numel() == 0:
            _finish_avg(t, op, n)
            return
        if t.numel() * t.element_size() < self._ring_min or t.numel() < n:
            self._allreduce_doubling(t, op, deadline, seq)
            _finish_avg(t, op, n)
        else:
            self._allreduce_ring(t, op, deadline, seq)        # averages each segment itself

    def _allreduce_doubling(self, t, op, deadline, seq) -> None:
        n, r = self._size, self._rank
        p2 = 1 << (n.bit_length() - 1)
        rem = n - p2
        buf = _byte_view(t)
        # the group's scratch space, not fresh pages per call (collectives run
        # one at a time on this group's thread, so nothing else holds it)
        tmp = self._scratch_space(t.numel() * t.element_size()).view(t.dtype).view(t.shape)
        tmp_buf = _byte_view(tmp)
        step = 0
        # fold: the first 2*rem ranks pair up, the even one hands over its data
        if r < 2 * rem:
            if r % 2 == 0:
                self._wait_sent(self._send(r + 1, (COLL, step, seq), buf), deadline)
                newrank = -1
            else:
                self._recv(r - 1, (COLL, step, seq), tmp_buf, deadline)
                _reduce_into(t, tmp, op)
                newrank = r // 2
        else:
            newrank = r - rem
        step += 1
        if newrank >= 0:
            mask = 1
            while mask < p2:
                partner_new = newrank ^ mask
                partner = partner_new * 2 + 1 if partner_new < rem else partner_new + rem
                self._exchange(partner, buf, partner, tmp_buf, (COLL, step, seq), deadline)
                # every rank reduces the same two halves in the same order: identical results
                lo, hi = (t, tmp) if newrank < partner_new else (tmp, t)
                if lo is t:
                    _reduce_into(t, tmp, op)
                else:
                    _reduce_into(tmp, t, op)
                    t.copy_(tmp)
                mask <<= 1
                step += 1
        # unfold: the ranks that handed over get the result back (a step
        # number of its own: the two sides went through different loops)
        if r < 2 * rem:
            if r % 2 == 0:
                self._recv(r + 1, (COLL, UNFOLD, seq), buf, deadline)
            else:
                self._wait_sent(self._send(r - 1, (COLL, UNFOLD, seq), buf), deadline)

    def _allreduce_ring(self, t, op, deadline, seq) -> None:
        """Ring reduce-scatter then ring all-gather, in chunks (a quarter of a
        segment, 1 to 16 MiB) pipelined along the ring: a chunk goes on to the next rank as soon as
        it is reduced (or, in the all-gather, received), while later chunks
        are still on the wire. Incoming chunks land in two alternating
        scratch buffers (reduce-scatter) or straight in the tensor
        (all-gather)."""
        n, r = self._size, self._rank
        right, left = (r + 1) % n, (r - 1) % n
        points = _split_points(t.numel(), n)
        seg = [t[points[i]:points[i + 1]] for i in range(n)]
        piece = self._chunk or min(max(points[1] * t.element_size() // 4, CHUNK_MIN), CHUNK_MAX)
        per_chunk = max(1, piece // t.element_size())

        def chunks(i):
            size = seg[i].numel()
            return [(a, min(a + per_chunk, size)) for a in range(0, size, per_chunk)]

        def key(step, c):
            return (COLL, (step << 32) | c, seq)

        biggest = max(s.numel() for s in seg)
        space = self._scratch_space(2 * biggest * t.element_size()).view(t.dtype)
        scratch = [space[:biggest], space[biggest:2 * biggest]]
        sends: list = []

        def post_rs(s):
            i = (r - s - 1) % n
            return [self._post(left, key(s, c), _byte_view(scratch[s % 2][a:b])) for c, (a, b) in enumerate(chunks(i))]

        def post_ag(s):
            i = (r - s) % n
            return [self._post(left, key(n - 1 + s, c), _byte_view(seg[i][a:b])) for c, (a, b) in enumerate(chunks(i))]

        # reduce-scatter: at step s this rank sends segment r-s (its own
        # data at step 0, then what it reduced at step s-1) and reduces
        # segment r-s-1 with what arrives from the left
        waiting = post_rs(0)
        for c, (a, b) in enumerate(chunks(r)):
            sends += self._send(right, key(0, c), _byte_view(seg[r][a:b]))
        gathered = None
        for s in range(n - 1):
            i = (r - s - 1) % n
            last = s == n - 2
            upcoming = post_rs(s + 1) if not last else None
            if last:
                gathered = [post_ag(g) for g in range(n - 1)]
            for c, (a, b) in enumerate(chunks(i)):
                self._wait(left, waiting[c], deadline)
                mine = seg[i][a:b]
                _reduce_into(mine, scratch[s % 2][a:b], op)
                if last:
                    _finish_avg(mine, op, n)        # segment r+1 is this rank's, fully reduced
                    sends += self._send(right, key(n - 1, c), _byte_view(mine))
                else:
                    sends += self._send(right, key(s + 1, c), _byte_view(mine))
            waiting = upcoming
        # all-gather: each reduced segment travels once around the ring
        for s in range(n - 1):
            i = (r - s) % n
            for c, (a, b) in enumerate(chunks(i)):
                self._wait(left, gathered[s][c], deadline)
                if s < n - 2:
                    sends += self._send(right, key(n + s, c), _byte_view(seg[i][a:b]))
        self._wait_sent(sends, deadline)

    def _start_reduction(self, tensors, opts):
        """Check the tensors and the op at the call (a refusal leaves the
        group in step), then number the collective: (op, sequence)."""
        self._check_devices(tensors)
        op = _op_of(opts)
        for t in tensors:
            _check_op(op, t.dtype)
        return op, self._next_seq()

    def allreduce(self, tensors, opts=None):
        op, seq = self._start_reduction(tensors, opts)

        def run(deadline):
            for i, t in enumerate(tensors):
                work = _contiguous(t).reshape(-1)
                self._allreduce_flat(work, op, deadline, seq * 64 + i)
                if work.data_ptr() != t.data_ptr() or not t.is_contiguous():
                    t.copy_(work.view(t.shape))
        return self._submit("all_reduce", run, tensors, getattr(opts, "timeout", None))

    def allreduce_coalesced(self, tensors, opts=None):
        op, seq = self._start_reduction(tensors, opts)

        def run(deadline):
            by_dtype: dict = {}
            for t in tensors:
                by_dtype.setdefault(t.dtype, []).append(t)
            for k, group in enumerate(by_dtype.values()):
                flat = torch.cat([t.reshape(-1) for t in group]) if group else None
                self._allreduce_flat(flat, op, deadline, seq * 64 + k)
                offset = 0
                for t in group:
                    t.copy_(flat[offset:offset + t.numel()].view(t.shape))
                    offset += t.numel()
        return self._submit("all_reduce_coalesced", run, tensors, getattr(opts, "timeout", None))

    # ---- broadcast and reduce (binomial trees)
    def broadcast(self, tensors, opts=None):
        self._check_devices(tensors)
        root = opts.rootRank if opts is not None else 0
        seq = self._next_seq()

        def run(deadline):
            n, r = self._size, self._rank
            for i, t in enumerate(tensors):
                work = _contiguous(t)
                buf = _byte_view(work)
                vr = (r - root) % n
                mask = 1
                while mask < n:                         # receive from the parent
                    if vr & mask:
                        self._recv((vr - mask + root) % n, (COLL, i, seq), buf, deadline)
                        break
                    mask <<= 1
                mask >>= 1
                reqs = []
                while mask > 0:                         # send to the children
                    if vr + mask < n:
                        reqs += self._send((vr + mask + root) % n, (COLL, i, seq), buf)
                    mask >>= 1
                self._wait_sent(reqs, deadline)
                if work is not t:
                    t.copy_(work)
        return self._submit("broadcast", run, tensors, getattr(opts, "timeout", None))

    def reduce(self, tensors, opts=None):
        self._check_devices(tensors)
        root = opts.rootRank if opts is not None else 0
        op = _op_of(opts)
        for t in tensors:
            _check_op(op, t.dtype)
        seq = self._next_seq()

        def run(deadline):
            n, r = self._size, self._rank
            for i, t in enumerate(tensors):
                # non-roots reduce into a copy: reduce leaves their input unchanged
                work = _contiguous(t).clone() if r != root else _contiguous(t)
                tmp = torch.empty_like(work)
                vr = (r - root) % n
                mask = 1
                while mask < n:
                    if vr & mask:
                        self._wait_sent(self._send((vr - mask + root) % n, (COLL, i, seq), _byte_view(work)),
                                        deadline)
                        break
                    if vr + mask < n:
                        self._recv((vr + mask + root) % n, (COLL, i, seq), _byte_view(tmp), deadline)
                        _reduce_into(work, tmp, op)
                    mask <<= 1
                if r == root:
                    _finish_avg(work, op, n)
                    if work is not t:
                        t.copy_(work)
        return self._submit("reduce", run, tensors, getattr(opts, "timeout", None))

    # ---- gathers and scatters (rings and direct)
    def _ring_allgather(self, blocks: list, deadline, seq, tag0=0) -> None:
        """blocks[i] (contiguous) holds rank i's part; blocks[rank] is filled."""
        n, r = self._size, self._rank
        right, left = (r + 1) % n, (r - 1) % n
        for s in range(n - 1):
            out_i, in_i = (r - s) % n, (r - s - 1) % n
            self._exchange(right, _byte_view(blocks[out_i]), left, _byte_view(blocks[in_i]),
                           (COLL, tag0 + s, seq), deadline)

    def allgather(self, output_tensors, input_tensors, opts=None):
        self._check_devices(output_tensors, input_tensors)
        seq = self._next_seq()

        def run(deadline):
            for i, (outs, inp) in enumerate(zip(output_tensors, input_tensors)):
                blocks = [_contiguous(o) for o in outs]
                blocks[self._rank].copy_(inp)
                self._ring_allgather(blocks, deadline, seq, tag0=i * self._size)
                for o, b in zip(outs, blocks):
                    if o is not b:
                        o.copy_(b)
        return self._submit("all_gather", run, output_tensors, getattr(opts, "timeout", None))

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        return self.allgather(output_lists, input_list, opts)

    def _allgather_base(self, output, input, opts=None):
        self._check_devices(output, input)
        seq = self._next_seq()

        def run(deadline):
            work = _contiguous(output)
            flat = work.reshape(-1)
            per = input.numel()
            if flat.numel() != per * self._size:
                raise ValueError("all_gather_into_tensor: the output must hold world_size inputs")
            blocks = [flat[i * per:(i + 1) * per] for i in range(self._size)]
            blocks[self._rank].copy_(input.reshape(-1))
            self._ring_allgather(blocks, deadline, seq)
            if work is not output:
                output.copy_(work)
        return self._submit("all_gather_into_tensor", run, output, getattr(opts, "timeout", None))

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        self._check_devices(outputs, inputs)
        seq = self._next_seq()

        def run(deadline):
            for k, (output, input) in enumerate(zip(outputs, inputs)):
                work = _contiguous(output)
                flat = work.reshape(-1)
                per = input.numel()
                blocks = [flat[i * per:(i + 1) * per] for i in range(self._size)]
                blocks[self._rank].copy_(input.reshape(-1))
                self._ring_allgather(blocks, deadline, seq, tag0=k * self._size)
                if work is not output:
                    output.copy_(work)
        return self._submit("all_gather_into_tensor_coalesced", run, outputs, getattr(opts, "timeout", None))

    def _ring_reduce_scatter(self, blocks: list, op, deadline, seq, tag0=0) -> torch.Tensor:
        """blocks[i]: this rank's contribution to rank i's result (left
        unchanged); returns the reduced block for this rank."""
        n, r = self._size, self._rank
        right, left = (r + 1) % n, (r - 1) % n
        acc = [b.clone() for b in blocks]
        tmp = torch.empty(max((b.numel() for b in blocks), default=0), dtype=blocks[0].dtype)
        for s in range(n - 1):
            out_i, in_i = (r - s - 1) % n, (r - s - 2) % n
            incoming = tmp[:acc[in_i].numel()]
            self._exchange(right, _byte_view(acc[out_i]), left, _byte_view(incoming),
                           (COLL, tag0 + s, seq), deadline)
            _reduce_into(acc[in_i], incoming, op)
        mine = acc[r]
        _finish_avg(mine, op, n)
        return mine

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        self._check_devices(output_tensors, input_tensors)
        op = _op_of(opts)
        for t in output_tensors:
            _check_op(op, t.dtype)
        seq = self._next_seq()

        def run(deadline):
            for i, (out, ins) in enumerate(zip(output_tensors, input_tensors)):
                blocks = [_contiguous(b).reshape(-1) for b in ins]
                out.copy_(self._ring_reduce_scatter(blocks, op, deadline, seq, i * self._size).view(out.shape))
        return self._submit("reduce_scatter", run, output_tensors, getattr(opts, "timeout", None))

    def _reduce_scatter_base(self, output, input, opts=None):
        self._check_devices(output, input)
        op = _op_of(opts)
        _check_op(op, output.dtype)
        seq = self._next_seq()

        def run(deadline):
            flat = _contiguous(input).reshape(-1)
            per = output.numel()
            if flat.numel() != per * self._size:
                raise ValueError("reduce_scatter_tensor: the input must hold world_size outputs")
            blocks = [flat[i * per:(i + 1) * per] for i in range(self._size)]
            output.copy_(self._ring_reduce_scatter(blocks, op, deadline, seq).view(output.shape))
        return self._submit("reduce_scatter_tensor", run, output, getattr(opts, "timeout", None))

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        self._check_devices(outputs, inputs)
        op = _op_of(opts)
        seq = self._next_seq()

        def run(deadline):
            for k, (output, input) in enumerate(zip(outputs, inputs)):
                _check_op(op, output.dtype)
                flat = _contiguous(input).reshape(-1)
                per = output.numel()
                blocks = [flat[i * per:(i + 1) * per] for i in range(self._size)]
                output.copy_(self._ring_reduce_scatter(blocks, op, deadline, seq, k * self._size)
                             .view(output.shape))
        return self._submit("reduce_scatter_tensor_coalesced", run, outputs, getattr(opts, "timeout", None))

    def alltoall(self, output_tensors, input_tensors, opts=None):
        self._check_devices(output_tensors, input_tensors)
        seq = self._next_seq()

        def run(deadline):
            self._pairwise([_contiguous(t) for t in input_tensors], output_tensors, deadline, seq)
        return self._submit("all_to_all", run, output_tensors, getattr(opts, "timeout", None))

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        self._check_devices(output, input)
        seq = self._next_seq()

        def run(deadline):
            n = self._size
            src = _contiguous(input)
            dst = _contiguous(output)

            def pieces(t, splits):
                rows = t.shape[0] if t.dim() else 1
                splits = list(splits) if splits else [rows // n] * n
                if sum(splits) != rows or len(splits) != n:
                    raise ValueError("all_to_all_single: split sizes must name a count per rank "
                                     "and add up to the tensor's first dimension")
                out, at = [], 0
                for s in splits:
                    out.append(t[at:at + s])
                    at += s
                return out
            ins = pieces(src, input_split_sizes)
            outs = pieces(dst, output_split_sizes)
            self._pairwise(ins, outs, deadline, seq)
            if dst is not output:
                output.copy_(dst)
        return self._submit("all_to_all_single", run, output, getattr(opts, "timeout", None))

    def _pairwise(self, ins, outs, deadline, seq) -> None:
        n, r = self._size, self._rank
        outs[r].copy_(ins[r])
        for s in range(1, n):
            to, frm = (r + s) % n, (r - s) % n
            dest = _contiguous(outs[frm])
            self._exchange(to, _byte_view(_contiguous(ins[to])), frm, _byte_view(dest), (COLL, s, seq), deadline)
            if dest is not outs[frm]:
                outs[frm].copy_(dest)

    def gather(self, output_tensors, input_tensors, opts=None):
        self._check_devices(output_tensors, input_tensors)
        root = opts.rootRank if opts is not None else 0
        seq = self._next_seq()

        def run(deadline):
            inp = _contiguous(input_tensors[0])
            if self._rank != root:
                self._wait_sent(self._send(root, (COLL, 0, seq), _byte_view(inp)), deadline)
                return
            outs = output_tensors[0]
            for peer in range(self._size):
                if peer == root:
                    outs[peer].copy_(inp)
                    continue
                dest = _contiguous(outs[peer])
                self._recv(peer, (COLL, 0, seq), _byte_view(dest), deadline)
                if dest is not outs[peer]:
                    outs[peer].copy_(dest)
        return self._submit("gather", run, output_tensors, getattr(opts, "timeout", None))

    def scatter(self, output_tensors, input_tensors, opts=None):
        self._check_devices(output_tensors, input_tensors)
        root = opts.rootRank if opts is not None else 0
        seq = self._next_seq()

        def run(deadline):
            out = output_tensors[0]
            if self._rank != root:
                dest = _contiguous(out)
                self._recv(root, (COLL, 0, seq), _byte_view(dest), deadline)
                if dest is not out:
                    out.copy_(dest)
                return
            ins = [_contiguous(t) for t in input_tensors[0]]
            reqs = []
            for peer in range(self._size):
                if peer != root:
                    reqs += self._send(peer, (COLL, 0, seq), _byte_view(ins[peer]))
            out.copy_(ins[root])
            self._wait_sent(reqs, deadline)
        return self._submit("scatter", run, output_tensors, getattr(opts, "timeout", None))

    def barrier(self, opts=None):
        seq = self._next_seq()

        def run(deadline):
            n, r = self._size, self._rank
            k = 1
            step = 0
            while k < n:                     # dissemination: log2(n) rounds
                self._exchange((r + k) % n, b"", (r - k) % n, bytearray(), (COLL, step, seq), deadline)
                k <<= 1
                step += 1
        return self._submit("barrier", run, [], getattr(opts, "timeout", None))

    # ---- point to point: started on the caller's thread, never queued
    # behind collectives or other receives (an irecv posted first must not
    # hold up a send issued after it); sends complete on the group's send
    # thread, receives on the peer's reader thread.
    def send(self, tensors, dst_rank, tag):
        self._check_devices(tensors)
        self._check_peer(dst_rank)
        fut = torch.futures.Future()
        name = f"send to rank {dst_rank} (tag {tag})"
        if self._closed:
            fut.set_exception(FabricPGError(f"fabric process group: {name} after the group was destroyed"))
            return _Work(fut)
        staged = [_contiguous(t) for t in tensors]          # kept alive until sent
        try:
            reqs = [req for t in staged for req in self._send(dst_rank, (P2P, tag, 0), _byte_view(t))]
        except FabricPGError as e:
            fut.set_exception(e)
        else:
            self._sends.put(("send", name, reqs, fut, tensors, staged, time.monotonic() + self._timeout))
        return _Work(fut)

    def recv(self, tensors, src_rank, tag):
        self._check_devices(tensors)
        self._check_peer(src_rank)
        fut = torch.futures.Future()
        name = f"recv from rank {src_rank} (tag {tag})"
        if self._closed:
            fut.set_exception(FabricPGError(f"fabric process group: {name} after the group was destroyed"))
            return _Work(fut)
        staged = [_contiguous(t) for t in tensors]
        remaining = [len(staged)]
        lock = threading.Lock()
        key = (P2P, tag, 0)

        def then(waiter):
            with lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
            failed = next((w.error for w in waiters if w.error is not None), None)
            if failed is not None:
                fut.set_exception(FabricPGError(failed if failed.startswith("fabric process group")
                                                else f"fabric process group: {name}: {failed}"))
                return
            for t, s in zip(tensors, staged):
                if s is not t:
                    t.copy_(s)
            fut.set_result(tensors)

        waiters = [_Waiter(_byte_view(s), then) for s in staged]
        if not waiters:
            fut.set_result(tensors)
        peer = self._peers[src_rank]
        for w in waiters:
            peer.post(key, w)
        self._sends.put(("recv", name, [(peer, w) for w in waiters], key, time.monotonic() + self._timeout))
        return _Work(fut)

    def recv_anysource(self, tensors, tag):
        """A receive from whichever rank's transfer with this tag comes first
        (the Work's source rank says which)."""
        if len(tensors) != 1:
            raise ValueError("fabric process group: a receive from any rank takes one tensor")
        self._check_devices(tensors)
        fut = torch.futures.Future()
        work = _Work(fut)
        name = f"recv from any rank (tag {tag})"
        if self._closed or not self._peers:
            fut.set_exception(FabricPGError(f"fabric process group: {name}: "
                                            + ("the group was destroyed" if self._closed else "no other rank")))
            return work
        t = tensors[0]
        staged = _contiguous(t)
        claim = _Claim()
        key = (P2P, tag, 0)

        def then(waiter):
            if waiter.error is None:
                if staged is not t:
                    t.copy_(staged)
                work._source = waiter.source
                fut.set_result(tensors)
                return
            with claim.lock:
                claim.failed += 1
                if claim.winner is None and claim.failed == len(waiters):
                    claim.winner = -1                 # every rank failed: the receive fails
                elif claim.winner != waiter.source:
                    return                            # another rank may still send, or already did
            fut.set_exception(FabricPGError(waiter.error if waiter.error.startswith("fabric process group")
                                            else f"fabric process group: {name}: {waiter.error}"))

        waiters = [(p, _Waiter(_byte_view(staged), then, claim, rank)) for rank, p in sorted(self._peers.items())]
        for p, w in waiters:
            p.post(key, w)
            if claim.taken:
                break
        self._sends.put(("recv", name, waiters, key, time.monotonic() + self._timeout))
        return work

    def _complete_sends(self) -> None:
        """The group's send thread: completes p2p sends' works, and fails
        p2p receives still unmatched at their deadline (the group's timeout)."""
        due: list = []            # (deadline, n, name, peer, key, waiters)
        count = 0
        while True:
            try:
                timeout = max(0.0, due[0][0] - time.monotonic()) if due else None
                item = self._sends.get(timeout=timeout)
            except queue.Empty:
                item = ()
            if item is None:
                return
            if item and item[0] == "send":
                _, name, reqs, fut, result, _staged, at = item
                try:
                    self._wait_sent(reqs, _Deadline(at - time.monotonic(), name))
                except FabricPGError as e:
                    fut.set_exception(e)
                else:
                    fut.set_result(result)
            elif item:
                _, name, waiters, key, at = item
                count += 1
                heapq.heappush(due, (at, count, name, key, waiters))
                if len(due) > 4096:       # receives long done wait for their deadline: prune
                    due = [d for d in due if not _settled(d[4])]
                    heapq.heapify(due)
            now = time.monotonic()
            while due and (due[0][0] <= now or _settled(due[0][4])):
                at, _, name, key, waiters = heapq.heappop(due)
                for peer, w in waiters:
                    if not w.done.is_set() and peer.cancel(key, w):
                        w.fail(f"fabric process group: {name} timed out after {self._timeout:g} s")

    # torch 2.13's names for the single-tensor and coalesced variants
    all_gather_single = _allgather_base
    reduce_scatter_single = _reduce_scatter_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    @staticmethod
    def _check_devices(*groups) -> None:
        """CPU tensors only (nested lists of them, as c10d passes them)."""
        stack = list(groups)
        while stack:
            item = stack.pop()
            if isinstance(item, (list, tuple)):
                stack.extend(item)
            elif isinstance(item, torch.Tensor) and (item.device.type != "cpu" or item.layout != torch.strided):
                raise ValueError(f"fabric process group: dense CPU tensors only, not a {item.layout} tensor "
                                 f"on {item.device}")

    def _check_peer(self, rank) -> None:
        if not 0 <= rank < self._size or rank == self._rank:
            raise ValueError(f"fabric process group: rank {rank} is not another rank of this group "
                             f"(size {self._size}, this is rank {self._rank})")


def _settled(waiters) -> bool:
    """Nothing left to time out: every waiter done, or the receive from any
    rank they belong to taken."""
    return all(w.done.is_set() or (w.claim is not None and w.claim.taken) for _, w in waiters)


def _shutdown(queues, fab, threads, peers, linger) -> None:
    for q in queues:
        q.put(None)
    try:
        # A send is complete once the engine holds it, not once it left: a
        # rank that leaves right after its last collective must let those
        # go (for at most close_linger seconds; a dead peer fails them at
        # once), or the peers still waiting for them see it gone. Closing
        # then wakes the readers and fails what is pending.
        fab.close(linger=linger[0])
    except FabricError:
        pass
    for t in threads:
        if t is not threading.current_thread():
            t.join(10)
    for p in peers:
        p.fail("fabric process group: the group was destroyed", drop_arrived=True)


def _create_process_group(store, rank, size, timeout):
    return FabricProcessGroup(store, rank, size, timeout)


def _register() -> None:
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create_process_group, devices=["cpu"])


_register()
