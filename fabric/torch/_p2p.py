"""Point to point and works: the receives posted for transfers, each
peer's connection state, deadlines, the Work objects torch waits on, and
send/recv/recv_anysource with the thread that completes them."""
from __future__ import annotations

import datetime
import heapq
import queue
import threading
import time
from collections import deque

import torch
import torch.distributed as dist

from fabric.torch._common import P2P, FabricPGError
from fabric.torch._tensors import _byte_view, _contiguous


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


class PointToPoint:
    """send, recv and recv_anysource of FabricProcessGroup."""

    def _begin(self, tensors, rank, name):
        """What every point-to-point call checks first: its future, and a
        Work already failed if the group was destroyed (else None)."""
        self._check_devices(tensors)
        self._check_peer(rank)
        fut = torch.futures.Future()
        if not self._closed:
            return fut, None
        fut.set_exception(FabricPGError(f"fabric process group: {name} after the group was destroyed"))
        return fut, _Work(fut)

    def send(self, tensors, dst_rank, tag):
        name = f"send to rank {dst_rank} (tag {tag})"
        fut, failed = self._begin(tensors, dst_rank, name)
        if failed is not None:
            return failed
        staged = [_contiguous(t) for t in tensors]          # kept alive until sent
        try:
            reqs = [req for t in staged for req in self._send(dst_rank, (P2P, tag, 0), _byte_view(t))]
        except FabricPGError as e:
            fut.set_exception(e)
        else:
            self._sends.put(("send", name, reqs, fut, tensors, staged, time.monotonic() + self._timeout))
        return _Work(fut)

    def recv(self, tensors, src_rank, tag):
        name = f"recv from rank {src_rank} (tag {tag})"
        fut, failed = self._begin(tensors, src_rank, name)
        if failed is not None:
            return failed
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
                fut.set_exception(_failure(name, failed))
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
            fut.set_exception(_failure(name, waiter.error))

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


def _failure(name: str, error: str) -> FabricPGError:
    """A waiter's error as the error of the call `name` (said once)."""
    return FabricPGError(error if error.startswith("fabric process group")
                         else f"fabric process group: {name}: {error}")


def _settled(waiters) -> bool:
    """Nothing left to time out: every waiter done, or the receive from any
    rank they belong to taken."""
    return all(w.done.is_set() or (w.claim is not None and w.claim.taken) for _, w in waiters)
