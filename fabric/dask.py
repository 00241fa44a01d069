"""fabric as a Dask distributed comm backend.

Installed with the package (entry point group ``distributed.comm.backends``):
the schemes ``fabric+tcp://``, ``fabric+ucx://``, ``fabric+verbs://`` name a
fabric backend, ``fabric://`` takes fabric's automatic choice (both ends must
make the same one). ``LocalCluster(protocol="fabric+ucx://")``, ``dask
scheduler --protocol fabric+tcp``, ``Client("fabric+ucx://host:port")`` then
move Dask's messages over fabric.

Wire format of one Dask message (a list of frames) on a fabric endpoint: a
first fabric message holding the header and the small frames, then each
large frame as a fabric message of its own, in order::

    b"FDK1" | u32 frame count | u64 length per frame | small frames' bytes

A length with the top bit set is a frame that follows as its own message
(received by ``recv_into`` straight into a fresh writable buffer from fabric's
receive memory, huge pages already faulted in (``fabric.empty``), so numpy
arrays deserialize without a copy and without page faults; sent from the frame's own memory,
so a large frame moves zero-copy by the engine's rendezvous, in one piece
whatever its size). Small frames are writable slices of the first message.

One Fabric per backend and process serves every comm and listener; it is
closed when the last of them goes (no descriptor or engine thread outlives a
cluster). A Fabric cannot cross a fork: a forked child makes its own.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import os
import struct
import threading
import weakref
from typing import Any

from distributed.comm.addressing import parse_host_port, unparse_host_port
from distributed.comm.core import BaseListener, Comm, CommClosedError, Connector
from distributed.comm.registry import Backend
from distributed.comm.utils import ensure_concrete_host, from_frames, to_frames
from distributed.system import MEMORY_LIMIT
from distributed.utils import ensure_ip, ensure_memoryview, get_ip, get_ipv6

import fabric
from fabric.errors import AddressError, FabricError
from fabric.protocol.engine import new_message as empty

logger = logging.getLogger("fabric.dask")

MAGIC = b"FDK1"
HEADER = struct.Struct("<4sI")
SEPARATE = 1 << 63              # length flag: the frame is a fabric message of its own
# frames smaller than this travel inside the first message (copied once into it)
INLINE_MAX = 64 * 1024
# a first message naming more frames than this is refused (Dask's largest
# messages, gathers of many keys, stay far below)
MAX_FRAMES = 1 << 20
# bytes a peer may announce in one Dask message: as Dask's own tcp comm
MAX_MESSAGE = int(MEMORY_LIMIT // 2)
NO_SHARDS = 1 << 62             # frame_split_size: Dask splits nothing this small


# ------------------------------------------------------------ shared Fabrics

class _Fabrics:
    """One Fabric per backend name in this process, open while comms or
    listeners hold a lease on it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str | None, list[Any]] = {}   # name -> [Fabric, leases, pid]

    def acquire(self, name: str | None) -> _Lease:
        with self._lock:
            entry = self._by_name.get(name)
            if entry is not None and (entry[2] != os.getpid() or entry[0].closed):
                entry = None          # a forked parent's (unusable here) or closed behind our back
            if entry is None:
                entry = [fabric.Fabric(name), 0, os.getpid()]
                self._by_name[name] = entry
            entry[1] += 1
            return _Lease(self, name, entry[0])

    def release(self, name: str | None, fab: fabric.Fabric) -> None:
        close = False
        with self._lock:
            entry = self._by_name.get(name)
            if entry is None or entry[0] is not fab:
                return
            entry[1] -= 1
            if entry[1] <= 0:
                del self._by_name[name]
                close = True
        if close:
            try:
                fab.close(linger=0)
            except FabricError:          # pragma: no cover - forked or already gone
                pass


class _Lease:
    """A comm's or listener's hold on a shared Fabric; release() is idempotent."""

    __slots__ = ("_pool", "_name", "fabric", "__weakref__")

    def __init__(self, pool: _Fabrics, name: str | None, fab: fabric.Fabric) -> None:
        self._pool, self._name, self.fabric = pool, name, fab

    def release(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.release(self._name, self.fabric)


_fabrics = _Fabrics()


def _comm_closed(what: str, error: BaseException) -> CommClosedError:
    return CommClosedError(f"{what}: {error}")


def _abandon(ep: Any, lease: _Lease) -> None:
    """A comm garbage-collected without close(): drop its endpoint."""
    try:
        ep.close(linger=0)
    except Exception:         # noqa: BLE001 - nothing to report to at this point
        pass
    lease.release()


# ----------------------------------------------------------------- frames

def pack(frames: list[Any]) -> tuple[list[Any], list[memoryview], int]:
    """The first message's parts (header, small frames) and the large frames
    that follow it; plus the byte count Dask reports for the write."""
    views = [ensure_memoryview(f) for f in frames]
    lengths = bytearray(8 * len(views))
    first: list[Any] = [None]
    separate: list[memoryview] = []
    total = 0
    for i, v in enumerate(views):
        n = v.nbytes
        total += n
        if n >= INLINE_MAX:
            struct.pack_into("<Q", lengths, 8 * i, n | SEPARATE)
            separate.append(v)
        else:
            struct.pack_into("<Q", lengths, 8 * i, n)
            if n:
                first.append(v)
    first[0] = HEADER.pack(MAGIC, len(views)) + lengths
    total += len(first[0])
    if len(first) > 32:
        # many small frames: one copy beats a long scatter list
        first = [b"".join(first)]
    return first, separate, total


def unpack(first: Any, max_message: int = MAX_MESSAGE) -> tuple[list[Any], list[tuple[int, int]]]:
    """Frames of a first message: small frames as slices of it, and the
    (index, length) of each frame that follows as its own message. Raises
    ValueError for anything that is not a well-formed header within limits."""
    view = memoryview(first).cast("B")
    if view.nbytes < HEADER.size:
        raise ValueError(f"message of {view.nbytes} bytes is shorter than a header")
    magic, count = HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise ValueError(f"not a fabric Dask message (magic {bytes(magic)!r})")
    if count > MAX_FRAMES:
        raise ValueError(f"{count} frames announced (at most {MAX_FRAMES})")
    offset = HEADER.size + 8 * count
    if offset > view.nbytes:
        raise ValueError(f"{count} frames announced in a message of {view.nbytes} bytes")
    frames: list[Any] = [None] * count
    later: list[tuple[int, int]] = []
    announced = 0
    for i in range(count):
        (word,) = struct.unpack_from("<Q", view, HEADER.size + 8 * i)
        n = word & ~SEPARATE
        announced += n
        if announced > max_message:
            raise ValueError(f"message announces more than {max_message} bytes")
        if word & SEPARATE:
            later.append((i, n))
        else:
            if offset + n > view.nbytes:
                raise ValueError("frame lengths run past the end of the message")
            frames[i] = view[offset:offset + n]
            offset += n
    if offset != view.nbytes:
        raise ValueError(f"{view.nbytes - offset} bytes after the last frame")
    return frames, later


# ------------------------------------------------------------------- comm

class FabricComm(Comm):
    """A Dask comm over one fabric endpoint."""

    def __init__(self, ep: Any, local_addr: str, peer_addr: str, deserialize: bool, lease: _Lease):
        super().__init__(deserialize=deserialize)
        self._ep = ep
        self._local_addr = local_addr
        self._peer_addr = peer_addr
        self._lease = lease
        self._closed = False
        self._extra = {"fabric_backend": lease.fabric.name}
        self._finalizer = weakref.finalize(self, _abandon, ep, lease)

    @property
    def local_address(self) -> str:
        return self._local_addr

    @property
    def peer_address(self) -> str:
        return self._peer_addr

    @property
    def extra_info(self) -> dict:
        return self._extra

    def closed(self) -> bool:
        return self._closed or self._ep.closed

    async def read(self, deserializers=None):
        # (only our own close: after the peer's, what it sent first is still read)
        if self._closed:
            raise CommClosedError(f"{self!r} is closed")
        try:
            first = await self._ep.arecv()
            try:
                frames, later = unpack(first)
            except ValueError as e:
                raise _Refused(str(e)) from None
            for index, length in later:
                buf = memoryview(empty(length))
                got = await self._ep.arecv_into(buf)
                if got != length:
                    raise _Refused(f"frame {index} has {got} bytes, announced {length}")
                frames[index] = buf
        except _Refused as e:
            self.abort()
            raise CommClosedError(f"{self._peer_addr} sent a malformed message ({e}); comm aborted") from None
        except FabricError as e:
            self.abort()
            raise _comm_closed(f"in {type(self).__name__}.read from {self._peer_addr}", e) from e
        except BaseException:
            # cancelled or interrupted part-way: what follows on the endpoint
            # belongs to a message we no longer have, so the comm is unusable
            self.abort()
            raise
        try:
            return await from_frames(frames, deserialize=self.deserialize, deserializers=deserializers,
                                     allow_offload=self.allow_offload)
        except EOFError:
            self.abort()
            raise CommClosedError("aborted comm on truncated data") from None

    async def write(self, msg, serializers=None, on_error="message"):
        if self.closed():
            raise CommClosedError(f"{self!r} is closed")
        # Dask shards large frames (64 MiB) for compression and for sockets;
        # fabric moves a frame of any size in one piece, and shards would be
        # received into separate buffers that deserializing copies together
        # (a 256 MiB array: 0.06 s of its 0.15 s here). Uncompressed, no shards.
        compressed = self.handshake_options.get("compression") is not None
        frames = await to_frames(msg, allow_offload=self.allow_offload, serializers=serializers,
                                 on_error=on_error,
                                 context={"sender": self.local_info, "recipient": self.remote_info,
                                          **self.handshake_options},
                                 frame_split_size=None if compressed else NO_SHARDS)
        first, separate, total = pack(frames)
        ep = self._ep
        try:
            # every part queued at once, in order; each leaves from the frame's own memory
            requests = [ep.isend(first)] + [ep.isend(v) for v in separate]
            for request in requests:
                await request.await_done()
        except FabricError as e:
            self.abort()
            raise _comm_closed(f"in {type(self).__name__}.write to {self._peer_addr}", e) from e
        except BaseException:
            self.abort()
            raise
        return total

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        try:
            await self._ep.aclose()      # sends what is queued, then tells the peer
        except Exception as e:           # noqa: BLE001 - errors while closing are not the caller's
            logger.debug("closing %r: %s", self, e)
            self._ep.close(linger=0)
        finally:
            self._lease.release()

    def abort(self) -> None:
        if not self._closed:
            self._closed = True
            self._finalizer.detach()
        try:
            self._ep.close(linger=0)
        except Exception as e:           # noqa: BLE001
            logger.debug("aborting %r: %s", self, e)
        self._lease.release()


class _Refused(Exception):
    """A peer's message broke the wire format (internal to FabricComm.read)."""


# ------------------------------------------------------- connect and listen

class FabricConnector(Connector):
    def __init__(self, backend: str | None, prefix: str):
        self.backend = backend
        self.prefix = prefix

    async def connect(self, address, deserialize=True, **connection_args):
        host, port = parse_host_port(address)
        lease = _fabrics.acquire(self.backend)
        try:
            ep = await lease.fabric.aconnect(unparse_host_port(host, port))
        except BaseException as e:
            lease.release()
            if isinstance(e, AddressError):
                raise ValueError(str(e)) from e
            if isinstance(e, OSError):
                raise            # ConnectionLost, Timeout: what Dask retries on
            if isinstance(e, FabricError):
                raise _comm_closed(f"connect to {self.prefix}{address}", e) from e
            raise
        return FabricComm(ep, self.prefix + ep.local_address, self.prefix + unparse_host_port(host, port),
                          deserialize, lease)


class FabricListener(BaseListener):
    def __init__(self, backend: str | None, prefix: str, address: str, comm_handler, deserialize=True,
                 allow_offload=True, default_host=None, default_port=0, **connection_args):
        super().__init__()
        self.backend = backend
        self.prefix = prefix
        self.ip, self.port = parse_host_port(address, default_port)
        self.comm_handler = comm_handler
        self.deserialize = deserialize
        self.allow_offload = allow_offload
        self.default_host = default_host
        self._lease: _Lease | None = None
        self._listener: Any = None
        self._bound: tuple[str, int] | None = None
        self._accepting: asyncio.Task | None = None
        self._handlers: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._lease = _fabrics.acquire(self.backend)
        host = self.ip if self.ip else "0.0.0.0"
        try:
            self._listener = self._lease.fabric.listen(unparse_host_port(host, self.port))
        except BaseException:
            self._lease.release()
            self._lease = None
            raise
        bound_host, bound_port = parse_host_port(self._listener.address)
        self._bound = (bound_host, bound_port)
        self._accepting = asyncio.ensure_future(self._accept_loop())

    async def _accept_loop(self) -> None:
        listener = self._listener
        while True:
            try:
                ep = await listener.aaccept()
            except FabricError:
                if listener.closed:
                    return
                continue     # a failed handshake is the listener's business, not ours
            task = asyncio.ensure_future(self._serve(ep))
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    async def _serve(self, ep: Any) -> None:
        if self._listener is None or self._lease is None:
            ep.close(linger=0)          # stopped while this one was accepted
            return
        lease = _fabrics.acquire(self.backend)
        comm = FabricComm(ep, self.prefix + ep.local_address, self.prefix + ep.peer_address,
                          self.deserialize, lease)
        comm.allow_offload = self.allow_offload
        try:
            await self.on_connection(comm)
        except CommClosedError:
            logger.info("connection from %s closed before the handshake completed", comm.peer_address)
            comm.abort()
            return
        result = self.comm_handler(comm)
        if inspect.isawaitable(result):
            await result

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        if self._accepting is not None:
            self._accepting.cancel()
            self._accepting = None
        self.abort_handshaking_comms()
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.release()

    def get_host_port(self) -> tuple[str, int]:
        if self._bound is None:
            raise ValueError("invalid operation on a listener that was not started")
        return self._bound

    @property
    def listen_address(self) -> str:
        return self.prefix + unparse_host_port(*self.get_host_port())

    @property
    def contact_address(self) -> str:
        host, port = self.get_host_port()
        host = ensure_concrete_host(host, default_host=self.default_host)
        return self.prefix + unparse_host_port(host, port)


# ---------------------------------------------------------------- backends

class FabricBackend(Backend):
    """fabric:// - fabric's automatic backend choice."""

    fabric_backend: str | None = None
    prefix = "fabric://"

    def get_connector(self):
        return FabricConnector(self.fabric_backend, self.prefix)

    def get_listener(self, loc, handle_comm, deserialize, **connection_args):
        return FabricListener(self.fabric_backend, self.prefix, loc, handle_comm, deserialize,
                              **connection_args)

    def get_address_host(self, loc):
        return parse_host_port(loc)[0]

    def get_address_host_port(self, loc):
        return parse_host_port(loc)

    def resolve_address(self, loc):
        host, port = parse_host_port(loc)
        return unparse_host_port(ensure_ip(host), port)

    def get_local_address_for(self, loc):
        host, _ = parse_host_port(loc)
        host = ensure_ip(host)
        local = get_ipv6(host) if ":" in host else get_ip(host)
        return unparse_host_port(local, None)


class TcpBackend(FabricBackend):
    """fabric+tcp://"""
    fabric_backend = "tcp"
    prefix = "fabric+tcp://"


class UcxBackend(FabricBackend):
    """fabric+ucx://"""
    fabric_backend = "ucx"
    prefix = "fabric+ucx://"


class VerbsBackend(FabricBackend):
    """fabric+verbs://"""
    fabric_backend = "verbs"
    prefix = "fabric+verbs://"
