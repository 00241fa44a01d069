"""The calls of an aio channel: one HTTP/2 stream each, its status and
metadata, and the grpc.aio faces (awaitable unary responses, read() and
async iteration of streaming ones, write()/done_writing())."""
from __future__ import annotations

import asyncio

import grpc
import grpc.aio
from grpc.aio import EOF, AioRpcError, Metadata

from fabric import errors
from fabric.grpc import _h2, _tls, _wire
from fabric.grpc._aio_http2 import Waiter
from fabric.grpc._http2_core import ConnectionFailed

CANCELLED_DETAILS = "Locally cancelled by application!"


def metadata_of(pairs) -> Metadata:
    return Metadata(*pairs) if pairs else Metadata()


class _Call:
    """One RPC of an aio channel: its HTTP/2 stream, status and metadata."""

    _plugins = ()                 # metadata plugins of the call's credentials

    def __init__(self, channel, method, path, serializer, deserializer, timeout, metadata, wait_for_ready,
                 compression, plugins, unary_response):
        self._channel = channel
        self._method = method
        self._path = path
        self._serialize = serializer
        self._deserialize = deserializer
        self._loop = channel._loop_now()
        self._timeout = timeout
        self._deadline = None if timeout is None else self._loop.time() + timeout
        self._metadata = tuple(metadata or ())
        self._wait_for_ready = wait_for_ready
        self._encoding = channel._encoding if compression is None else _wire.encoding_of(compression)
        self._unary_response = unary_response
        self._got_response = False
        self._code = None
        self._details = ""
        self._initial = None
        self._trailing = ()
        self._raw_initial = None        # response headers, made metadata only if asked for
        self._raw_trailing = None
        self._stream = None
        self._conn = None
        self._waiter = Waiter()
        self._status = None            # a future, made when someone awaits the status before it is known
        self._done_callbacks = None
        self._timer = None if self._deadline is None else self._loop.call_at(self._deadline, self._expire)
        if plugins:
            self._plugins = plugins
        channel._calls.add(self)

    # -- status
    def _finish(self, code, details, trailing=None) -> bool:
        if self._code is not None:
            return False
        self._code, self._details = code, details
        if trailing is not None:
            self._trailing = trailing
        if self._timer is not None:
            self._timer.cancel()
        if self._stream is not None:
            self._waiter.wake()
            self._conn.forget(self._stream)
        self._channel._calls.discard(self)
        if self._status is not None and not self._status.done():
            self._status.set_result(None)
        callbacks, self._done_callbacks = self._done_callbacks, None
        for cb in callbacks or ():
            try:
                cb(self)
            except Exception:               # noqa: BLE001 - a callback's failure is its own
                pass
        return True

    def _abort(self, code, details):
        if self._finish(code, details) and self._stream is not None:
            self._conn.reset(self._stream)

    def _expire(self):
        self._abort(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    def _error(self) -> AioRpcError:
        return AioRpcError(self._code, metadata_of(self._initial_metadata()), metadata_of(self._trailing_metadata()),
                           self._details, f"{self._code}: {self._details}")

    def _settle(self):
        """If the stream has ended or failed, record the status."""
        s = self._stream
        if s is None or self._code is not None:
            return
        if s.failure is not None:
            if isinstance(s.failure, _wire.WireError):
                self._abort(s.failure.code, s.failure.details)
            elif isinstance(s.failure, _h2.H2Error):
                self._finish(grpc.StatusCode.INTERNAL, str(s.failure))
            else:
                self._finish(grpc.StatusCode.UNAVAILABLE, f"connection lost: {s.failure}")
        elif (s.ended or s.peer_done) and (not s.messages or not self._unary_response):
            # (a streaming call's status is known before its last responses are read)
            self._finish_from_headers(s.headers, s.trailers)
        elif s.reset_code is not None:
            self._finish(grpc.StatusCode.CANCELLED if s.reset_code == 8 else grpc.StatusCode.INTERNAL,
                         f"Received RST_STREAM with error code {int(s.reset_code)}")

    def _finish_from_headers(self, headers, trailers):
        if trailers is None:
            trailers, headers = headers, None
            if self._initial is None:
                self._initial = ()
        status = b"200"
        for k, v in trailers or ():
            if k == b":status":
                status = v
                break
        if status != b"200":
            try:
                number = int(status)
            except ValueError:
                number = 0
            self._finish(_wire.status_from_http(number), f"Received http2 header with status: {number}")
            return
        code, details = _wire.status_of_headers(trailers or ())
        if code == grpc.StatusCode.OK and self._unary_response and not self._got_response:
            code, details = grpc.StatusCode.INTERNAL, "No message returned for unary call"
        self._raw_trailing = trailers
        self._finish(code, details)

    def _capture_initial(self):
        s = self._stream
        if self._initial is None and self._raw_initial is None and s is not None and s.headers is not None:
            if s.trailers is None and s.ended and any(k == b"grpc-status" for k, _ in s.headers):
                self._initial = ()
            else:
                self._raw_initial = s.headers

    def _initial_metadata(self):
        if self._initial is None and self._raw_initial is not None:
            self._initial = _wire.headers_to_metadata(self._raw_initial)
        return self._initial or ()

    def _trailing_metadata(self):
        if self._raw_trailing is not None:
            self._trailing, self._raw_trailing = _wire.headers_to_metadata(self._raw_trailing), None
        return self._trailing

    # -- sending
    def _headers(self):
        headers = self._channel._headers_of(self._path)
        if self._encoding not in (None, "identity"):
            headers.append((b"grpc-encoding", self._encoding.encode()))
        if self._deadline is not None:
            headers.append((b"grpc-timeout", _wire.encode_timeout(max(self._deadline - self._loop.time(), 0))))
        if self._metadata:
            headers.extend(_wire.metadata_to_headers(self._metadata))
        return headers

    def _serialized(self, request):
        """The request's bytes, or None (the call ended with an error)."""
        try:
            data = self._serialize(request) if self._serialize else request
            n = memoryview(data).nbytes
        except Exception as e:                  # noqa: BLE001 - reported as the call's status
            self._abort(grpc.StatusCode.INTERNAL, f"Exception serializing request: {e!r}")
            return None
        max_send = self._channel._max_send
        if max_send >= 0 and n > max_send:
            self._abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"Sent message larger than max ({n} vs. {max_send})")
            return None
        return data

    async def _start(self, request=None, unary_request=False) -> bool:
        """Headers (and, unary_request, the one request and end of stream)
        in one write."""
        try:
            headers = self._headers()
            if self._plugins:
                headers.extend(_wire.metadata_to_headers(await self._credential_metadata()))
        except ValueError as e:
            self._finish(grpc.StatusCode.INTERNAL, str(e))
            return False
        except _tls.CallCredentialsError as e:
            self._finish(e.code, e.details)
            return False
        payload, compressed = None, False
        if unary_request:
            data = self._serialized(request)
            if data is None:
                return False
            payload, compressed = _wire.maybe_compress(data, self._encoding)
        try:
            conn = self._channel._conn
            if conn is None or not conn.alive:
                conn = await self._channel._connection(self._deadline)
            self._conn = conn
            if self._code is not None:
                return False
            self._stream = await conn.open_call(self._waiter, headers, payload, compressed, self._deadline)
        except (TimeoutError, asyncio.TimeoutError):
            self._finish(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            return False
        except (ConnectionFailed, errors.FabricError, OSError) as e:
            if self._stream is None and self._conn is not None and self._conn.dead is not None:
                self._finish(grpc.StatusCode.UNAVAILABLE, f"connection lost: {e}")
            else:
                self._finish(grpc.StatusCode.UNAVAILABLE, f"failed to connect to {self._channel._target}: {e}")
            return False
        if self._code is not None:                 # cancelled or expired meanwhile
            self._conn.reset(self._stream)
            return False
        return True

    async def _credential_metadata(self):
        """What the call credentials' plugins add (TLS channels only, as
        grpcio); plugins may block (a token refresh): off the event loop."""
        if self._channel._tls is None:
            raise _tls.CallCredentialsError(grpc.StatusCode.UNAUTHENTICATED, "Established channel does not have "
                                            "a sufficient security level to transfer call credential.")
        left = None if self._deadline is None else self._deadline - self._loop.time()
        return await self._loop.run_in_executor(
            None, _tls.plugin_metadata, self._plugins, _tls.service_url(self._channel._authority, self._method),
            self._method, left)

    async def _send(self, request, end_stream=False) -> bool:
        if self._code is not None:
            return False
        data = self._serialized(request)
        if data is None:
            return False
        try:
            await self._conn.send_message(self._stream, self._send_waiter, data, end_stream=end_stream,
                                          deadline=self._deadline, encoding=self._encoding)
        except TimeoutError:
            self._abort(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            return False
        except ConnectionFailed:
            self._settle()
            return False
        return True

    def _close_send(self):
        if self._stream is not None and self._code is None:
            try:
                self._conn.end_stream(self._stream)
            except ConnectionFailed:
                pass

    # -- receiving
    def _ready(self):
        s = self._stream
        return bool(s.messages) or s.ended or s.peer_done or s.failure is not None or s.reset_code is not None \
            or self._code is not None

    async def _next_message(self):
        """The next response (deserialized), or None when the call is over."""
        s = self._stream
        if s is None:
            return None
        if not self._ready():
            await self._conn.await_(self._waiter, self._ready, None)
        self._capture_initial()
        if s.messages and self._code in (None, grpc.StatusCode.OK):
            msg = self._conn.take_message(s)
            self._got_response = True
            try:
                return self._deserialize(msg) if self._deserialize else msg
            except Exception as e:               # noqa: BLE001 - reported as the call's status
                self._abort(grpc.StatusCode.INTERNAL, f"Exception deserializing response! {e!r}")
                raise self._error() from None
        self._settle()
        return None

    async def _wait_status(self):
        while self._code is None:
            s = self._stream
            if s is None:
                await asyncio.shield(self._status_future())
                break
            await self._conn.await_(self._waiter, lambda: s.ended or s.peer_done or s.failure is not None or
                                    s.reset_code is not None or self._code is not None, None)
            self._settle()
            if self._code is None and s.ended:
                # the unary response is not taken yet: its reader settles the call
                await asyncio.shield(self._status_future())
        return self._code

    def _status_future(self):
        if self._status is None:
            self._status = self._loop.create_future()
            if self._code is not None:
                self._status.set_result(None)
        return self._status

    async def _unary_result(self):
        """The single response and the status: one wait, woken once when the
        response (with its trailers, usually in the same read) is in."""
        s = self._stream
        if s is not None and self._code is None:
            def ready():
                return s.ended or s.peer_done or len(s.messages) > 1 or s.failure is not None or \
                    s.reset_code is not None or self._code is not None
            if not ready():
                await self._conn.await_(self._waiter, ready, None)
            self._capture_initial()
            if self._code is None:
                if len(s.messages) > 1:
                    self._abort(grpc.StatusCode.INTERNAL, "Too many responses for unary call")
                elif s.messages and s.failure is None:
                    msg = self._conn.take_message(s)
                    try:
                        result = self._deserialize(msg) if self._deserialize else msg
                    except Exception as e:               # noqa: BLE001 - reported as the call's status
                        self._abort(grpc.StatusCode.INTERNAL, f"Exception deserializing response! {e!r}")
                        raise self._error() from None
                    self._got_response = True
                    self._settle()
                    if self._code is None:
                        await self._wait_status()
                    if self._code == grpc.StatusCode.OK:
                        return result
                    raise self._error()
                self._settle()
        await self._wait_status()
        raise self._error()

    # -- grpc.aio.Call
    def cancelled(self) -> bool:
        return self._code == grpc.StatusCode.CANCELLED

    def done(self) -> bool:
        return self._code is not None

    def time_remaining(self):
        return None if self._deadline is None else max(0.0, self._deadline - self._loop.time())

    def cancel(self) -> bool:
        if self._code is not None:
            return False
        self._abort(grpc.StatusCode.CANCELLED, CANCELLED_DETAILS)
        return True

    def add_done_callback(self, callback) -> None:
        if self._code is not None:
            callback(self)
        else:
            if self._done_callbacks is None:
                self._done_callbacks = []
            self._done_callbacks.append(callback)

    async def initial_metadata(self):
        while self._initial is None and self._raw_initial is None and self._code is None:
            s = self._stream
            if s is None:
                await asyncio.sleep(0)
                continue
            await self._conn.await_(self._waiter, lambda: s.headers is not None or s.ended or s.failure is not None
                                    or s.reset_code is not None or self._code is not None, None)
            self._capture_initial()
            if s.failure is not None or s.reset_code is not None:
                self._settle()
        return metadata_of(self._initial_metadata())

    async def trailing_metadata(self):
        await self._wait_status()
        return metadata_of(self._trailing_metadata())

    async def code(self):
        return await self._wait_status()

    async def details(self):
        await self._wait_status()
        return self._details

    async def wait_for_connection(self):
        while self._stream is None and self._code is None:
            await asyncio.sleep(0.001)
        if self._code is not None and self._code != grpc.StatusCode.OK:
            raise self._error()

    def __repr__(self):
        return f"<fabric.grpc.aio call {self._method} code={self._code}>"


class _ResponseReader:
    """read() and async iteration of a streaming response."""

    async def read(self):
        await self._started
        msg = await self._next_message()
        if msg is not None:
            return msg
        await self._wait_status()
        if self._code == grpc.StatusCode.OK:
            return EOF
        if self._code == grpc.StatusCode.CANCELLED and self._details == CANCELLED_DETAILS:
            raise asyncio.CancelledError()
        raise self._error()

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        while True:
            msg = await self.read()
            if msg is EOF:
                return
            yield msg


class _RequestWriter:
    """write()/done_writing(), or a request iterator consumed by a task."""

    def _begin_requests(self, request_iterator):
        self._send_waiter = Waiter()
        self._writer_task = None
        self._iterator_given = request_iterator is not None
        if request_iterator is not None:
            self._writer_task = self._loop.create_task(self._consume(request_iterator))

    async def _consume(self, request_iterator):
        if not await self._started:
            return
        try:
            if hasattr(request_iterator, "__aiter__"):
                async for request in request_iterator:
                    if not await self._send(request):
                        return
            else:
                for request in request_iterator:
                    if not await self._send(request):
                        return
        except asyncio.CancelledError:
            raise
        except Exception as e:                       # noqa: BLE001 - the iterator's failure ends the call
            self._abort(grpc.StatusCode.UNKNOWN, f"Exception iterating requests: {e!r}")
            return
        self._close_send()

    async def write(self, request) -> None:
        if self._iterator_given:
            raise grpc.aio.UsageError("write() is not allowed with a request iterator")
        if self._done_writing:
            raise grpc.aio.UsageError("write() after done_writing()")
        if not await self._started:
            raise self._error()
        if not await self._send(request):
            await self._wait_status()
            if self._code == grpc.StatusCode.CANCELLED and self._details == CANCELLED_DETAILS:
                raise asyncio.InvalidStateError("the call was cancelled")
            raise self._error()

    async def done_writing(self) -> None:
        if self._iterator_given:
            raise grpc.aio.UsageError("done_writing() is not allowed with a request iterator")
        if self._done_writing:
            return
        self._done_writing = True
        if await self._started:
            self._close_send()


class UnaryUnaryCall(_Call, grpc.aio.UnaryUnaryCall):
    """A unary call needs no task of its own: its request is written when
    the call is made, the connection's reader settles it when the response
    and trailers are in (the stream's owner is the call: wake() below), and
    awaiting it waits for that. A task runs only when the call cannot start
    at once (no connection yet, call credentials, windows full)."""

    def __init__(self, request, *args):
        super().__init__(*args, unary_response=True)
        self._result = None
        self._awaiters = None
        self._task = None
        if not self._start_now(request):
            self._task = self._loop.create_task(self._start_later(request))

    def _start_now(self, request) -> bool:
        """True if the call started (or ended) here, False if a task must start it."""
        conn = self._channel._conn
        if conn is None or not conn.alive or self._plugins:
            return False
        try:
            headers = self._headers()
        except ValueError as e:
            self._finish(grpc.StatusCode.INTERNAL, str(e))
            return True
        data = self._serialized(request)
        if data is None:
            return True
        payload, compressed = _wire.maybe_compress(data, self._encoding)
        self._conn = conn
        try:
            stream, done = conn.start_call(self, headers, payload, compressed)
        except (ConnectionFailed, errors.FabricError) as e:
            self._finish(grpc.StatusCode.UNAVAILABLE, f"connection lost: {e}")
            return True
        if stream is None:                      # the peer's stream limit: wait in a task
            return False
        self._stream = stream
        if not done or (len(payload) >= _h2.ZERO_COPY_MIN and type(payload) is not bytes):
            self._task = self._loop.create_task(self._send_rest(payload))
        self.wake()                             # (a failure while sending is seen at once)
        return True

    async def _start_later(self, request):
        if await self._start(request, unary_request=True) and self._stream is not None:
            self._stream.owner = self
            self.wake()

    async def _send_rest(self, payload):
        try:
            await self._conn.finish_message(self._stream, self._waiter, payload, self._deadline)
        except TimeoutError:
            self._abort(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        except ConnectionFailed:
            self._settle()

    def wake(self):
        """(the connection's reader, as the stream's owner) The stream moved:
        settle the call once its response is complete."""
        s = self._stream
        self._waiter.wake()                     # whoever awaits metadata or the status
        if s is None or self._code is not None:
            return
        if not (s.ended or s.peer_done or len(s.messages) > 1 or s.failure is not None or s.reset_code is not None):
            return
        self._capture_initial()
        if len(s.messages) > 1:
            self._abort(grpc.StatusCode.INTERNAL, "Too many responses for unary call")
            return
        if s.messages and s.failure is None:
            msg = self._conn.take_message(s)
            try:
                self._result = self._deserialize(msg) if self._deserialize else msg
            except Exception as e:               # noqa: BLE001 - reported as the call's status
                self._abort(grpc.StatusCode.INTERNAL, f"Exception deserializing response! {e!r}")
                return
            self._got_response = True
        self._settle()

    def _finish(self, code, details, trailing=None) -> bool:
        if not super()._finish(code, details, trailing):
            return False
        awaiters, self._awaiters = self._awaiters, None
        for fut in awaiters or ():
            if not fut.done():
                fut.set_result(None)
        return True

    def _outcome(self):
        if self._code == grpc.StatusCode.OK:
            return self._result
        if self._code == grpc.StatusCode.CANCELLED and self._details == CANCELLED_DETAILS:
            raise asyncio.CancelledError()
        raise self._error()

    def __await__(self):
        if self._code is None:
            fut = self._loop.create_future()
            if self._awaiters is None:
                self._awaiters = []
            self._awaiters.append(fut)
            try:
                yield from fut.__await__()
            except asyncio.CancelledError:
                if self._code is None:          # the awaiting task was cancelled: so is the call
                    self.cancel()
                raise
        return self._outcome()


class UnaryStreamCall(_ResponseReader, _Call, grpc.aio.UnaryStreamCall):
    def __init__(self, request, *args):
        super().__init__(*args, unary_response=False)
        self._writer_task = None
        self._started = self._loop.create_task(self._start(request, unary_request=True))


class StreamUnaryCall(_RequestWriter, _Call, grpc.aio.StreamUnaryCall):
    def __init__(self, request_iterator, *args):
        super().__init__(*args, unary_response=True)
        self._done_writing = False
        self._started = self._loop.create_task(self._start())
        self._begin_requests(request_iterator)
        self._task = self._loop.create_task(self._result())

    async def _result(self):
        if not await self._started:
            raise self._error()
        try:
            return await self._unary_result()
        except AioRpcError:
            if self._code == grpc.StatusCode.CANCELLED and self._details == CANCELLED_DETAILS:
                raise asyncio.CancelledError() from None
            raise

    def __await__(self):
        return self._task.__await__()


class StreamStreamCall(_ResponseReader, _RequestWriter, _Call, grpc.aio.StreamStreamCall):
    def __init__(self, request_iterator, *args):
        super().__init__(*args, unary_response=False)
        self._done_writing = False
        self._started = self._loop.create_task(self._start())
        self._begin_requests(request_iterator)
