"""A byte stream over a fabric endpoint, with the semantics gRPC asks of its
transport (the layer AR-gRPC replaced under gRPC's HTTP/2):

  read()        at least one byte, or b"" at end of stream, or an exception;
                never data and end-of-stream together, never a dropped byte
  read_into(b)  the same into a caller's buffer (the fabric receives straight
                into it when the next message fits)
  write(data)   one buffer or a list of buffers; returns when every byte was
                handed to the fabric (small writes coalesce, large ones go by
                rendezvous straight from the caller's buffers)
  at most one outstanding read and one outstanding write (BusyError)
  shutdown_write()  half-close: the peer reads end-of-stream, we still read
  close()       fails pending operations of both directions, on any thread

Each write is one fabric message; a zero-length message marks the end of the
writer's side (empty writes are not sent). Blocking and asyncio forms
(aread, aread_into, awrite, ashutdown_write, aclose).
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from fabric import errors

if TYPE_CHECKING:
    from collections.abc import Sequence

    from typing_extensions import Buffer, Self, TypeAlias

    from fabric.protocol.engine import Endpoint, Listener, Message, Request

    # what a write takes: one buffer, or a list or tuple of buffers
    _Data: TypeAlias = "Buffer | Sequence[Buffer]"

DEFAULT_READ = 1 << 20


class _Gate:
    """At most one operation of a kind at a time."""

    __slots__ = ("kind", "_lock")

    def __init__(self, kind: str):
        self.kind = kind
        self._lock = threading.Lock()

    def __enter__(self) -> _Gate:
        if not self._lock.acquire(blocking=False):
            raise errors.BusyError(f"a {self.kind} is already outstanding on this stream")
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def _nbytes(data) -> int:
    if isinstance(data, (list, tuple)):
        return sum(memoryview(d).nbytes for d in data)
    return memoryview(data).nbytes


class Stream:
    """A byte stream view of an Endpoint (which it owns from now on)."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._pending: memoryview | None = None     # a received message not yet read
        self._pending_msg: Message | None = None
        self._eof = False
        self._write_shut = False
        self._reading = _Gate("read")
        self._writing = _Gate("write")

    # -- addresses
    @property
    def local_address(self) -> str:
        return self.endpoint.local_address

    @property
    def peer_address(self) -> str:
        return self.endpoint.peer_address

    # -- reading
    def _take_pending(self, limit: int | None = None) -> memoryview:
        """The next bytes of the pending message, at most limit (all: None)."""
        view = self._pending
        if view is None:           # callers check first; never an assert (gone under python -O)
            raise errors.FabricError("stream: no pending message to read from")
        if limit is None or len(view) <= limit:
            self._pending = self._pending_msg = None
            return view
        self._pending = view[limit:]
        return view[:limit]

    def _accept_message(self, msg: Message) -> bool:
        """Keep a received message; False if it was the end-of-stream mark."""
        view = memoryview(msg).cast("B")
        if len(view) == 0:
            self._eof = True
            return False
        self._pending, self._pending_msg = view, msg
        return True

    def read(self, max_bytes: int = DEFAULT_READ, timeout: float | None = None) -> bytes:
        if max_bytes < 1:
            raise ValueError("max_bytes must be at least 1")
        with self._reading:
            if self._pending is None:
                if self._eof or not self._accept_message(self.endpoint.recv(timeout=timeout)):
                    return b""
            return bytes(self._take_pending(max_bytes))

    def read_message(self, timeout: float | None = None) -> memoryview | None:
        """The next whole write of the peer as a buffer (no copy), or None at
        end of stream. Bytes already buffered by read() come first."""
        with self._reading:
            if self._pending is None:
                if self._eof or not self._accept_message(self.endpoint.recv(timeout=timeout)):
                    return None
            return self._take_pending()

    def read_into(self, buf: Buffer, timeout: float | None = None) -> int:
        """Bytes read into buf (>= 1), or 0 at end of stream."""
        out = memoryview(buf).cast("B")
        if len(out) == 0:
            raise ValueError("read_into needs a non-empty buffer")
        with self._reading:
            if self._pending is None:
                if self._eof:
                    return 0
                try:
                    n = self.endpoint.recv_into(out, timeout=timeout)
                except errors.MessageTooLarge:
                    self._accept_message(self.endpoint.recv(timeout=timeout))
                else:
                    if n == 0:
                        self._eof = True
                    return n
            view = self._take_pending(len(out))
            out[:len(view)] = view
            return len(view)

    # -- writing
    def write(self, data: _Data, timeout: float | None = None) -> None:
        with self._writing:
            if self._write_shut:
                raise errors.ConnectionClosed("write side of the stream is shut down")
            if _nbytes(data) == 0:
                return
            if timeout is None:
                self.endpoint.send(data)
            else:
                self.endpoint.isend(data).wait(timeout)

    def write_nowait(self, data: _Data) -> Request:
        """Start a write and return its fabric.Request at once; the buffers
        must stay untouched until it is done (pass immutable ones). Writes,
        waited or not, reach the peer in call order."""
        with self._writing:
            if self._write_shut:
                raise errors.ConnectionClosed("write side of the stream is shut down")
            return self.endpoint.isend(data)

    def shutdown_write(self) -> None:
        with self._writing:
            if not self._write_shut:
                self._write_shut = True
                self.endpoint.send(b"")

    def close(self) -> None:
        """Close both directions; pending reads and writes fail."""
        self.endpoint.close(linger=0)

    @property
    def closed(self) -> bool:
        return self.endpoint.closed

    # -- asyncio
    async def aread(self, max_bytes: int = DEFAULT_READ, timeout: float | None = None) -> bytes:
        if max_bytes < 1:
            raise ValueError("max_bytes must be at least 1")
        with self._reading:
            if self._pending is None:
                if self._eof or not self._accept_message(await self.endpoint.arecv(timeout=timeout)):
                    return b""
            return bytes(self._take_pending(max_bytes))

    async def aread_message(self, timeout: float | None = None) -> memoryview | None:
        with self._reading:
            if self._pending is None:
                if self._eof or not self._accept_message(await self.endpoint.arecv(timeout=timeout)):
                    return None
            return self._take_pending()

    async def aread_into(self, buf: Buffer, timeout: float | None = None) -> int:
        out = memoryview(buf).cast("B")
        if len(out) == 0:
            raise ValueError("read_into needs a non-empty buffer")
        with self._reading:
            if self._pending is None:
                if self._eof:
                    return 0
                try:
                    n = await self.endpoint.arecv_into(out, timeout=timeout)
                except errors.MessageTooLarge:
                    self._accept_message(await self.endpoint.arecv(timeout=timeout))
                else:
                    if n == 0:
                        self._eof = True
                    return n
            view = self._take_pending(len(out))
            out[:len(view)] = view
            return len(view)

    async def awrite(self, data: _Data, timeout: float | None = None) -> None:
        with self._writing:
            if self._write_shut:
                raise errors.ConnectionClosed("write side of the stream is shut down")
            if _nbytes(data) == 0:
                return
            await self.endpoint.asend(data, timeout=timeout)

    async def ashutdown_write(self) -> None:
        with self._writing:
            if not self._write_shut:
                self._write_shut = True
                await self.endpoint.asend(b"")

    async def aclose(self) -> None:
        await self.endpoint.aclose(linger=0)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<fabric.Stream {self.endpoint!r}>"


class StreamListener:
    """Accepts Streams (a Listener whose endpoints are wrapped)."""

    def __init__(self, listener: Listener) -> None:
        self.listener = listener

    @property
    def address(self) -> str:
        return self.listener.address

    def accept(self, timeout: float | None = None) -> Stream:
        return Stream(self.listener.accept(timeout=timeout))

    async def aaccept(self, timeout: float | None = None) -> Stream:
        return Stream(await self.listener.aaccept(timeout=timeout))

    def close(self) -> None:
        self.listener.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
