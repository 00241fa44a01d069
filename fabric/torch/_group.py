"""The process group: one Fabric per group, the full mesh of connections
made through the c10d store, a reader thread per peer, the collectives
thread, failure and shutdown."""
from __future__ import annotations

import datetime
import ipaddress
import os
import queue
import socket
import struct
import threading
import weakref
from collections import deque
from typing import Any, Callable

import torch
import torch.distributed as dist

import fabric
from fabric.errors import ConnectionClosed, ConnectionLost, FabricError, Timeout
from fabric.torch._collectives import Collectives, _ring_min_for
from fabric.torch._common import (ABORT, BACKEND_NAME, COLL, EARLY_MAX, HEADER, INLINE, INLINE_FLAG, P2P, FabricPGError,
                                  _env_bytes, _root_cause, logger)
from fabric.torch._p2p import PointToPoint, _Deadline, _Peer, _Waiter, _Work


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


def _group_fabric() -> fabric.Fabric:
    """The group's Fabric. On fabrics whose large transfers this side's CPU
    serves (tcp) its receives are pulled, not posted (a rank's reader offers
    each tensor's buffer only once the transfer's header has arrived): a
    two-rank all_reduce of 16 MiB ran at 0.65-0.70x gloo posted against
    1.06-1.07x pulled, alternating runs (bench/RESULTS.md, session 19; why
    posting loses here is not isolated). FABRIC_POSTED_RECEIVES decides when
    it is set."""
    name = os.environ.get("FABRIC_BACKEND") or None
    options = {}
    backend, _ = fabric.backends.choose(name or "auto")
    if "reads_served" in backend.capabilities and "FABRIC_POSTED_RECEIVES" not in os.environ:
        options["posted_receives"] = 0
    return fabric.Fabric(name, **options)


class FabricProcessGroup(Collectives, PointToPoint, dist.ProcessGroup):
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
        self._fabric = _group_fabric()
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
