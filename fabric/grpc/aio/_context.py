"""What an asyncio handler sees of its call (grpc.aio.ServicerContext):
metadata, deadline, status, and the stream's reads and writes."""
from __future__ import annotations

import asyncio

import grpc
import grpc.aio
from grpc.aio import EOF

from fabric.grpc import _tls, _wire
from fabric.grpc._aio_http2 import Waiter
from fabric.grpc._http2_core import ConnectionFailed, ErrorCodes
from fabric.grpc._server import OK_TRAILERS, RESPONSE_HEADERS


class ServicerContext(grpc.aio.ServicerContext):
    """What an asyncio handler sees of its call."""

    def __init__(self, server, conn, stream, method, deadline):
        self._server, self._conn, self._stream = server, conn, stream
        self._loop = conn.loop
        self._method = method
        self._metadata = None            # made from the headers on first use
        self._deadline = deadline
        self._code = None
        self._details = None
        self._trailing = ()
        self._initial_sent = False
        self._finished = False
        self._cancelled = False
        self._done_callbacks = None
        self._compression = None
        self._encoding = None
        self._plain_next = False
        self._task = None
        self._handler = None
        self._waiter = Waiter()
        stream.owner = self._waiter

    # -- call information
    def invocation_metadata(self):
        if self._metadata is None:       # a tuple of (key, value), as grpc.aio's servers give it
            self._metadata = _wire.headers_to_metadata(self._stream.headers)
        return self._metadata

    def peer(self):
        return _wire.peer_string(getattr(self._conn.transport, "peer_address", "?"))

    def peer_identities(self):
        ctx = self.auth_context()
        key = _tls.peer_identity_key(ctx)
        return None if key is None else ctx[key]

    def peer_identity_key(self):
        return _tls.peer_identity_key(self.auth_context())

    def auth_context(self):
        of = getattr(self._conn.transport, "auth_context", None)
        return of() if of is not None else {}

    def time_remaining(self):
        return None if self._deadline is None else max(0.0, self._deadline - self._loop.time())

    def cancelled(self):
        return self._cancelled

    def done(self):
        return self._finished or self._cancelled

    def add_done_callback(self, callback):
        if self.done():
            callback(self)
        else:
            if self._done_callbacks is None:
                self._done_callbacks = []
            self._done_callbacks.append(callback)

    def _run_callbacks(self):
        callbacks, self._done_callbacks = self._done_callbacks, None
        for cb in callbacks or ():
            try:
                cb(self)
            except Exception:                   # noqa: BLE001 - a callback's failure is its own
                pass

    def _on_client_gone(self):
        if not self._finished and not self._cancelled:
            self._cancelled = True
            if self._task is not None and self._task is not asyncio.current_task():
                self._task.cancel()
            self._run_callbacks()

    # -- status
    def set_code(self, code):
        self._code = code

    def set_details(self, details):
        self._details = details

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailing

    def set_trailing_metadata(self, trailing_metadata):
        self._trailing = tuple(trailing_metadata or ())

    async def abort(self, code, details="", trailing_metadata=()):
        if code == grpc.StatusCode.OK:
            raise ValueError("abort() needs a non-OK status code")
        self._code, self._details = code, details
        if trailing_metadata:
            self.set_trailing_metadata(trailing_metadata)
        raise grpc.aio.AbortError()

    async def abort_with_status(self, status):
        await self.abort(status.code, status.details, status.trailing_metadata)

    def set_compression(self, compression):
        self._compression = _wire.encoding_of(compression)

    def disable_next_message_compression(self):
        self._plain_next = True

    # -- sending
    async def send_initial_metadata(self, initial_metadata):
        if self._initial_sent:
            raise grpc.aio.UsageError("initial metadata was already sent")
        self._send_headers(initial_metadata)

    def _response_headers(self, metadata=()):
        self._initial_sent = True
        wanted = self._compression or self._server._encoding
        if wanted not in (None, "identity"):
            accepted = b""
            for k, v in self._stream.headers:
                if k == b"grpc-accept-encoding":
                    accepted = v
            if wanted.encode() in [a.strip() for a in accepted.split(b",")]:
                self._encoding = wanted
        if self._encoding is None and not metadata:
            return RESPONSE_HEADERS
        headers = list(RESPONSE_HEADERS)
        if self._encoding is not None:
            headers.append((b"grpc-encoding", self._encoding.encode()))
        return headers + _wire.metadata_to_headers(metadata)

    def _send_headers(self, metadata=(), write=True):
        self._conn.send_headers(self._stream, self._response_headers(metadata), write=write)

    async def write(self, message):
        if self.done():
            raise grpc.aio.AbortError() if self._cancelled else grpc.aio.UsageError("the call is over")
        await self._write(message, self._handler.response_serializer)

    def _serialized(self, response, serializer):
        try:
            data = serializer(response) if serializer else response
            n = memoryview(data).nbytes
        except Exception as e:                  # noqa: BLE001 - reported as the call's status
            self._code, self._details = grpc.StatusCode.INTERNAL, f"Failed to serialize response: {e!r}"
            raise grpc.aio.AbortError() from None
        limit = self._server._max_send
        if limit >= 0 and n > limit:
            self._code = grpc.StatusCode.RESOURCE_EXHAUSTED
            self._details = f"Sent message larger than max ({n} vs. {limit})"
            raise grpc.aio.AbortError()
        return data

    async def _write(self, response, serializer):
        """One message of a streaming response."""
        data = self._serialized(response, serializer)
        if not self._initial_sent:
            self._send_headers(write=False)
        encoding, self._plain_next = (None if self._plain_next else self._encoding), False
        await self._conn.send_message(self._stream, self._waiter, data, deadline=self._deadline, encoding=encoding)

    async def _respond_unary(self, response, serializer):
        """Headers, the response and the trailers in one write."""
        data = self._serialized(response, serializer)
        if self._finished or self._cancelled:
            return
        self._finished = True
        code = self._code or grpc.StatusCode.OK
        trailers = OK_TRAILERS if code == grpc.StatusCode.OK and not self._details and not self._trailing \
            else self._trailers(code, self._details)
        try:
            if not self._initial_sent:
                self._send_headers(write=False)
            encoding, self._plain_next = (None if self._plain_next else self._encoding), False
            await self._conn.send_message(self._stream, self._waiter, data, deadline=self._deadline,
                                          encoding=encoding, trailers=trailers)
            self._after_trailers()
        except (ConnectionFailed, TimeoutError):
            pass
        except Exception:                       # noqa: BLE001 - still end the call
            self._conn.reset(self._stream, ErrorCodes.INTERNAL_ERROR)
        finally:
            self._conn.forget(self._stream)
            self._run_callbacks()

    async def read(self):
        """The next request of a streaming-request call, or grpc.aio.EOF."""
        s = self._stream
        ok = await self._conn.await_(self._waiter, lambda: bool(s.messages) or s.ended or s.failure is not None or
                                     s.reset_code is not None, self._deadline)
        if s.messages:
            msg = self._conn.take_message(s)
            try:
                return self._handler.request_deserializer(msg) if self._handler.request_deserializer else msg
            except Exception as e:              # noqa: BLE001 - reported as the call's status
                self._code, self._details = grpc.StatusCode.INTERNAL, f"Exception deserializing request! {e!r}"
                raise grpc.aio.AbortError() from None
        if isinstance(s.failure, _wire.WireError):
            self._code, self._details = s.failure.code, s.failure.details
            raise grpc.aio.AbortError()
        if s.failure is not None or s.reset_code is not None or not ok:
            self._on_client_gone()
            raise asyncio.CancelledError()
        return EOF

    def _trailers(self, code, details):
        try:
            return _wire.trailers(code, details, self._trailing)
        except Exception as e:              # noqa: BLE001 - still end the call
            return _wire.trailers(grpc.StatusCode.INTERNAL, f"bad status or trailing metadata: {e}")

    def _after_trailers(self):
        s = self._stream
        if not s.ended and s.reset_code is None:
            # the request is not read to its end: the client may stop
            # sending; the call is complete (RFC 9113 8.1, as grpcio does)
            self._conn.reset(s, ErrorCodes.NO_ERROR)

    def _finish(self, code, details):
        """Trailers (or Trailers-Only) with the status; once; never raises."""
        if self._finished or self._cancelled:
            return
        self._finished = True
        trailers_only = not self._initial_sent
        self._initial_sent = True
        try:
            trailers = self._trailers(code, details)
            if trailers_only:
                trailers = list(RESPONSE_HEADERS) + trailers
            self._conn.send_headers(self._stream, trailers, end_stream=True)
            self._after_trailers()
        except ConnectionFailed:
            pass
        except Exception:                       # noqa: BLE001 - still end the call
            self._conn.reset(self._stream, ErrorCodes.INTERNAL_ERROR)
        finally:
            self._conn.forget(self._stream)
            self._run_callbacks()


class RequestIterator:
    def __init__(self, ctx):
        self._ctx = ctx

    def __aiter__(self):
        return self

    async def __anext__(self):
        msg = await self._ctx.read()
        if msg is EOF:
            raise StopAsyncIteration
        return msg
