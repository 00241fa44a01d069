"""fabric.grpc for asyncio, as grpc.aio: channels and servers whose calls run
as tasks of the event loop (no thread per call or per connection), over
plain TCP (host:port, stock gRPC peers) and fabric streams
(fabric[+backend]://host:port).

    channel = fabric.grpc.aio.insecure_channel("fabric+ucx://10.0.0.1:50051")
    stub = helloworld_pb2_grpc.GreeterStub(channel)
    reply = await stub.SayHello(request)

    server = fabric.grpc.aio.server()
    helloworld_pb2_grpc.add_GreeterServicer_to_server(Greeter(), server)
    server.add_insecure_port("0.0.0.0:50051")
    await server.start()
    await server.wait_for_termination()

The classes subclass grpc.aio's (isinstance checks of other libraries pass);
errors are grpc.aio.AioRpcError, the end of a stream grpc.aio.EOF.
"""
from __future__ import annotations

import asyncio
import collections
import inspect
import socket
import ssl
import time

import grpc
import grpc.aio
from grpc.aio import EOF, AioRpcError, Metadata

from fabric import errors
from fabric.grpc import _keepalive, _tls, _transport, _wire
from fabric.grpc._aio_http2 import AioConnection, FabricTransport, SocketTransport
from fabric.grpc._channel import USER_AGENT, _options_dict
from fabric.grpc._http2 import ConnectionFailed
from fabric.grpc._server import HandlerCallDetails, HandlerRegistry

__all__ = ["insecure_channel", "secure_channel", "server", "Channel", "Server", "ServicerContext", "AioRpcError", "EOF",
           "Metadata"]

_CANCELLED_DETAILS = "Locally cancelled by application!"


def _metadata(pairs) -> Metadata:
    return Metadata(*pairs) if pairs else Metadata()


def _fabric_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _open_transport(target: str, timeout, fab, tls=None):
    """(transport, trusted) to target; tls: (ssl context, server name) for TLS
    on a plain TCP target."""
    backend, host, port = _transport.parse_target(target)
    if backend is None:
        kwargs = {} if tls is None else {"ssl": tls[0], "server_hostname": tls[1],
                                         "ssl_handshake_timeout": _tls.HANDSHAKE_TIMEOUT}
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, **kwargs), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"connect to {host}:{port} timed out") from None
        except ssl.SSLCertVerificationError as e:
            raise errors.ConnectionLost(f"TLS certificate verification failed: {e.verify_message}") from None
        except (OSError, ssl.SSLError) as e:
            raise errors.ConnectionLost(f"connect to {host}:{port} failed: {e}") from None
        try:
            return SocketTransport(reader, writer), False
        except errors.FabricError:
            writer.close()
            raise
    if tls is not None:
        raise ValueError(f"secure channels are for plain TCP targets (host:port), not {target!r}: "
                         "fabric connections are meant for a trusted cluster network")
    fab = fab or _transport.shared_fabric(backend)
    stream = await fab.aconnect_stream(_fabric_address(host, port), timeout=timeout)
    return FabricTransport(stream), True


# ==================================================================== client

class _Call:
    """One RPC of an aio channel: its HTTP/2 stream, status and metadata."""

    _plugins = ()                 # metadata plugins of the call's credentials

    def __init__(self, channel, method, serializer, deserializer, timeout, metadata, wait_for_ready,
                 compression, unary_response):
        self._channel = channel
        self._method = method
        self._serialize = serializer
        self._deserialize = deserializer
        self._loop = asyncio.get_running_loop()
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
        self._stream = None
        self._conn = None
        self._status = self._loop.create_future()
        self._done_callbacks = []
        self._timer = None if self._deadline is None else self._loop.call_at(self._deadline, self._expire)

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
            self._conn.forget(self._stream)
            self._stream.signal.notify()
        self._channel._calls.discard(self)
        if not self._status.done():
            self._status.set_result(None)
        callbacks, self._done_callbacks = self._done_callbacks, []
        for cb in callbacks:
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
        return AioRpcError(self._code, _metadata(self._initial or ()), _metadata(self._trailing),
                           self._details, f"{self._code}: {self._details}")

    def _settle(self):
        """If the stream has ended or failed, record the status."""
        s = self._stream
        if s is None or self._code is not None:
            return
        if s.failure is not None:
            if isinstance(s.failure, _wire.WireError):
                self._abort(s.failure.code, s.failure.details)
            else:
                self._finish(grpc.StatusCode.UNAVAILABLE, f"connection lost: {s.failure}")
        elif s.ended and (not s.messages or not self._unary_response):
            # (a streaming call's status is known before its last responses are read)
            self._finish_from_headers(s.headers, s.trailers)
        elif s.reset_code is not None:
            self._finish(grpc.StatusCode.CANCELLED if s.reset_code == 8 else grpc.StatusCode.INTERNAL,
                         f"Received RST_STREAM with error code {int(s.reset_code)}")

    def _finish_from_headers(self, headers, trailers):
        hdr = dict(headers or ())
        if trailers is None:
            trailers, headers = headers, None
            if self._initial is None:
                self._initial = ()
        status = hdr.get(b":status", b"200")
        if status != b"200":
            self._finish(_wire.status_from_http(int(status)), f"Received http2 header with status: {int(status)}")
            return
        code, details = _wire.status_of(dict(trailers or ()))
        if code == grpc.StatusCode.OK and self._unary_response and not self._got_response:
            code, details = grpc.StatusCode.INTERNAL, "No message returned for unary call"
        self._finish(code, details, trailing=_wire.headers_to_metadata(trailers or ()))

    def _capture_initial(self):
        s = self._stream
        if self._initial is None and s is not None and s.headers is not None:
            hdr = dict(s.headers)
            self._initial = () if b"grpc-status" in hdr else _wire.headers_to_metadata(s.headers)

    # -- sending
    async def _start(self, end_stream=False) -> bool:
        headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", self._method.encode()),
                   (b":authority", self._channel._authority), (b"te", b"trailers"),
                   (b"content-type", _wire.CONTENT_TYPE), (b"user-agent", USER_AGENT),
                   (b"grpc-accept-encoding", _wire.ACCEPT_ENCODING)]
        if self._encoding not in (None, "identity"):
            headers.append((b"grpc-encoding", self._encoding.encode()))
        if self._deadline is not None:
            headers.append((b"grpc-timeout", _wire.encode_timeout(max(self._deadline - self._loop.time(), 0))))
        try:
            headers.extend(_wire.metadata_to_headers(self._metadata))
            if self._plugins:
                headers.extend(_wire.metadata_to_headers(await self._credential_metadata()))
        except ValueError as e:
            self._finish(grpc.StatusCode.INTERNAL, str(e))
            return False
        except _tls.CallCredentialsError as e:
            self._finish(e.code, e.details)
            return False
        try:
            self._conn = await self._channel._connection(self._deadline)
            if self._code is not None:
                return False
            self._stream = await self._conn.open_call(headers, end_stream=end_stream, deadline=self._deadline)
        except (TimeoutError, asyncio.TimeoutError):
            self._finish(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            return False
        except (ConnectionFailed, errors.FabricError, OSError) as e:
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
        try:
            data = self._serialize(request) if self._serialize else request
        except Exception as e:                  # noqa: BLE001 - reported as the call's status
            self._abort(grpc.StatusCode.INTERNAL, f"Exception serializing request: {e!r}")
            return False
        n = memoryview(data).nbytes
        max_send = self._channel._max_send
        if max_send >= 0 and n > max_send:
            self._abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"Sent message larger than max ({n} vs. {max_send})")
            return False
        try:
            await self._conn.send_message(self._stream, data, end_stream=end_stream, deadline=self._deadline,
                                          encoding=self._encoding)
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
    async def _next_message(self):
        """The next response (deserialized), or None when the call is over."""
        s = self._stream
        if s is None:
            return None
        await s.wait(lambda: bool(s.messages) or s.ended or self._code is not None, None)
        self._capture_initial()
        if s.messages and self._code in (None, grpc.StatusCode.OK):
            msg = s.take_message()
            self._got_response = True
            try:
                return self._deserialize(bytes(msg)) if self._deserialize else bytes(msg)
            except Exception as e:               # noqa: BLE001 - reported as the call's status
                self._abort(grpc.StatusCode.INTERNAL, f"Exception deserializing response! {e!r}")
                raise self._error() from None
        self._settle()
        return None

    async def _wait_status(self):
        while self._code is None:
            s = self._stream
            if s is None:
                await asyncio.shield(self._status)
                break
            await s.wait(lambda: s.ended or self._code is not None, None)
            self._settle()
            if self._code is None and s.ended:
                # the unary response is not taken yet: its reader settles the call
                await asyncio.shield(self._status)
        return self._code

    async def _unary_result(self):
        msg = await self._next_message()
        if msg is None:
            await self._wait_status()
            raise self._error()
        s = self._stream
        await s.wait(lambda: bool(s.messages) or s.ended or self._code is not None, None)
        if s.messages and self._code is None:
            self._abort(grpc.StatusCode.INTERNAL, "Too many responses for unary call")
        self._settle()
        await self._wait_status()
        if self._code != grpc.StatusCode.OK:
            raise self._error()
        return msg

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
        self._abort(grpc.StatusCode.CANCELLED, _CANCELLED_DETAILS)
        return True

    def add_done_callback(self, callback) -> None:
        if self._code is not None:
            callback(self)
        else:
            self._done_callbacks.append(callback)

    async def initial_metadata(self):
        s = self._stream
        while self._initial is None and self._code is None:
            if s is None:
                await asyncio.sleep(0)
                s = self._stream
                continue
            await s.wait(lambda: s.headers is not None or s.ended or self._code is not None, None)
            self._capture_initial()
            if s.over():
                self._settle()
        return _metadata(self._initial or ())

    async def trailing_metadata(self):
        await self._wait_status()
        return _metadata(self._trailing)

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
        if self._code == grpc.StatusCode.CANCELLED and self._details == _CANCELLED_DETAILS:
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
            if self._code == grpc.StatusCode.CANCELLED and self._details == _CANCELLED_DETAILS:
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
    def __init__(self, request, *args):
        super().__init__(*args, unary_response=True)
        self._task = self._loop.create_task(self._run(request))

    async def _run(self, request):
        if await self._start():
            await self._send(request, end_stream=True)
        if self._code is not None and self._stream is None:
            raise self._error()
        try:
            return await self._unary_result()
        except AioRpcError:
            if self._code == grpc.StatusCode.CANCELLED and self._details == _CANCELLED_DETAILS:
                raise asyncio.CancelledError() from None
            raise

    def __await__(self):
        return self._task.__await__()


class UnaryStreamCall(_ResponseReader, _Call, grpc.aio.UnaryStreamCall):
    def __init__(self, request, *args):
        super().__init__(*args, unary_response=False)
        self._writer_task = None
        self._started = self._loop.create_task(self._begin(request))

    async def _begin(self, request):
        if await self._start():
            return await self._send(request, end_stream=True)
        return False


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
            if self._code == grpc.StatusCode.CANCELLED and self._details == _CANCELLED_DETAILS:
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


# ------------------------------------------------------------ client interceptors

class _WriteQueue:
    """The request iterator behind write()/done_writing() of an intercepted call."""

    def __init__(self):
        self.queue = asyncio.Queue()

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.queue.get()
        if item is EOF:
            raise StopAsyncIteration
        return item


class _InterceptedCall:
    """A call whose invocation went through client interceptors: it
    delegates to the call the chain produced (or serves what an interceptor
    returned in its place: a response, or an async iterator of responses)."""

    def __init__(self, interceptors, kind, request, details, invoke):
        self._loop = asyncio.get_running_loop()
        self._inner = None                 # the grpc.aio call, once the chain made it
        self._inner_ready = self._loop.create_future()
        self._result = None                # what the chain returned
        self._writes = None
        self._deadline = None if details.timeout is None else self._loop.time() + details.timeout
        if kind.startswith("stream") and request is None:
            self._writes = request = _WriteQueue()
        self._task = self._loop.create_task(self._run(interceptors, kind, request, details, invoke))

    async def _run(self, interceptors, kind, request, details, invoke):
        method = f"intercept_{kind}"

        async def at(index, d, req):
            if index == len(interceptors):
                call = invoke(d, req)
                if self._inner is None:
                    self._set_inner(call)
                return call

            async def continuation(next_details, next_request):
                return await at(index + 1, next_details, next_request)
            return await getattr(interceptors[index], method)(continuation, d, req)
        try:
            self._result = await at(0, details, request)
        finally:
            if not self._inner_ready.done():
                self._inner_ready.set_result(None)
        if isinstance(self._result, grpc.aio.Call) and self._result is not self._inner:
            self._inner = self._result
        return self._result

    def _set_inner(self, call):
        self._inner = call
        if not self._inner_ready.done():
            self._inner_ready.set_result(None)

    async def _call(self):
        await self._task
        return self._inner

    def cancel(self) -> bool:
        if self._inner is not None:
            return self._inner.cancel()
        return self._task.cancel()

    def cancelled(self) -> bool:
        return self._inner.cancelled() if self._inner is not None else self._task.cancelled()

    def done(self) -> bool:
        return self._inner.done() if self._inner is not None else self._task.done()

    def time_remaining(self):
        return None if self._deadline is None else max(0.0, self._deadline - self._loop.time())

    def add_done_callback(self, callback):
        if self._inner is not None:
            self._inner.add_done_callback(lambda _call: callback(self))
        else:
            self._task.add_done_callback(lambda _t: self.add_done_callback(callback))

    async def initial_metadata(self):
        inner = await self._call()
        return await inner.initial_metadata() if inner is not None else Metadata()

    async def trailing_metadata(self):
        inner = await self._call()
        return await inner.trailing_metadata() if inner is not None else Metadata()

    async def code(self):
        try:
            inner = await self._call()
        except asyncio.CancelledError:
            return grpc.StatusCode.CANCELLED
        except AioRpcError as e:
            return e.code()
        return await inner.code() if inner is not None else grpc.StatusCode.OK

    async def details(self):
        try:
            inner = await self._call()
        except AioRpcError as e:
            return e.details()
        return await inner.details() if inner is not None else ""

    async def wait_for_connection(self):
        await self._inner_ready
        if self._inner is not None:
            await self._inner.wait_for_connection()

    # -- unary responses
    async def _response(self):
        result = await self._task
        if isinstance(result, grpc.aio.Call):
            return await result
        return result

    def __await__(self):
        return self._response().__await__()

    # -- streaming responses
    async def read(self):
        result = await self._task
        if isinstance(result, grpc.aio.Call):
            return await result.read()
        if not hasattr(self, "_source"):
            self._source = result.__aiter__()
        try:
            return await self._source.__anext__()
        except StopAsyncIteration:
            return EOF

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        while True:
            msg = await self.read()
            if msg is EOF:
                return
            yield msg

    # -- streaming requests
    async def write(self, request):
        if self._writes is None:
            raise grpc.aio.UsageError("write() is not allowed with a request iterator")
        await self._writes.queue.put(request)

    async def done_writing(self):
        if self._writes is None:
            raise grpc.aio.UsageError("done_writing() is not allowed with a request iterator")
        await self._writes.queue.put(EOF)


class InterceptedUnaryUnaryCall(_InterceptedCall, grpc.aio.UnaryUnaryCall):
    pass


class InterceptedUnaryStreamCall(_InterceptedCall, grpc.aio.UnaryStreamCall):
    pass


class InterceptedStreamUnaryCall(_InterceptedCall, grpc.aio.StreamUnaryCall):
    pass


class InterceptedStreamStreamCall(_InterceptedCall, grpc.aio.StreamStreamCall):
    pass


_INTERCEPTOR_KINDS = {"unary_unary": (grpc.aio.UnaryUnaryClientInterceptor, InterceptedUnaryUnaryCall),
                      "unary_stream": (grpc.aio.UnaryStreamClientInterceptor, InterceptedUnaryStreamCall),
                      "stream_unary": (grpc.aio.StreamUnaryClientInterceptor, InterceptedStreamUnaryCall),
                      "stream_stream": (grpc.aio.StreamStreamClientInterceptor, InterceptedStreamStreamCall)}


class _MultiCallable:
    _call_class = None
    _kind = None

    def __init__(self, channel, method, request_serializer, response_deserializer):
        self._channel = channel
        self._method = method
        self._serialize = request_serializer
        self._deserialize = response_deserializer

    def __call__(self, request=None, *, timeout=None, metadata=None, credentials=None, wait_for_ready=None,
                 compression=None):
        self._channel._check_open()
        intercepted = _INTERCEPTOR_KINDS[self._kind][1]
        interceptors = self._channel._interceptors_of[self._kind]
        if not interceptors:
            return self._invoke(request, self._method, timeout, metadata, wait_for_ready, compression, credentials)
        details = grpc.aio.ClientCallDetails(self._method.encode(), timeout, Metadata(*tuple(metadata or ())),
                                             credentials, wait_for_ready)     # bytes, as grpc.aio gives it
        return intercepted(interceptors, self._kind, request, details,
                           lambda d, req: self._invoke(req, d.method, d.timeout, d.metadata,
                                                       d.wait_for_ready, compression, d.credentials))

    def _invoke(self, request, method, timeout, metadata, wait_for_ready, compression, credentials=None):
        if isinstance(method, bytes):
            method = method.decode()
        call = self._call_class(request, self._channel, method, self._serialize, self._deserialize,
                                timeout, metadata, wait_for_ready, compression)
        call._plugins = self._channel._call_plugins + _tls.call_plugins(credentials)
        self._channel._calls.add(call)
        return call


class UnaryUnaryMultiCallable(_MultiCallable, grpc.aio.UnaryUnaryMultiCallable):
    _call_class = UnaryUnaryCall
    _kind = "unary_unary"


class UnaryStreamMultiCallable(_MultiCallable, grpc.aio.UnaryStreamMultiCallable):
    _call_class = UnaryStreamCall
    _kind = "unary_stream"


class _StreamingRequests(_MultiCallable):
    def __call__(self, request_iterator=None, *, timeout=None, metadata=None, credentials=None,
                 wait_for_ready=None, compression=None):
        return super().__call__(request_iterator, timeout=timeout, metadata=metadata, credentials=credentials,
                                wait_for_ready=wait_for_ready, compression=compression)


class StreamUnaryMultiCallable(_StreamingRequests, grpc.aio.StreamUnaryMultiCallable):
    _call_class = StreamUnaryCall
    _kind = "stream_unary"


class StreamStreamMultiCallable(_StreamingRequests, grpc.aio.StreamStreamMultiCallable):
    _call_class = StreamStreamCall
    _kind = "stream_stream"


class Channel(grpc.aio.Channel):
    """fabric.grpc.aio.insecure_channel(target, options=None, compression=None)."""

    def __init__(self, target: str, options=None, compression=None, interceptors=None, fabric=None,
                 credentials=None):
        backend, host, port = _transport.parse_target(target)
        for interceptor in interceptors or ():
            if not isinstance(interceptor, grpc.aio.ClientInterceptor):        # as grpc.aio checks
                raise ValueError(f"Interceptor {interceptor!r} must be a grpc.aio client interceptor")
        # each interceptor serves the first call kind it is an interceptor
        # of, as grpc.aio sorts them (one class for two kinds serves one)
        self._interceptors_of = {kind: [] for kind in _INTERCEPTOR_KINDS}
        for interceptor in interceptors or ():
            for kind, (interface, _) in _INTERCEPTOR_KINDS.items():
                if isinstance(interceptor, interface):
                    self._interceptors_of[kind].append(interceptor)
                    break
        opts = _options_dict(options)
        self._target = target
        self._fabric = fabric
        self._max_send = int(opts.get("grpc.max_send_message_length", -1))
        self._max_receive = int(opts.get("grpc.max_receive_message_length", _wire.DEFAULT_MAX_RECEIVE))
        self._keepalive = _keepalive.Settings(opts, server=False)
        self._tls, self._call_plugins, authority = _tls.channel_security(credentials, opts, backend, target,
                                                                         host, port)
        self._authority = str(opts.get("grpc.default_authority", authority)).encode()
        self._encoding = _wire.encoding_of(compression if compression is not None
                                           else opts.get("grpc.default_compression_algorithm"))
        self._conn = None
        self._connecting = None
        self._closed = False
        self._calls = set()

    def _check_open(self):
        if self._closed:
            raise grpc.aio.UsageError("Channel is closed.")

    async def _connection(self, deadline=None) -> AioConnection:
        while True:
            if self._closed:
                raise ConnectionFailed("Channel closed!")
            conn = self._conn
            if conn is not None and conn.alive:
                return conn
            if self._connecting is None:
                self._connecting = asyncio.get_running_loop().create_task(self._connect(deadline))
            connecting = self._connecting
            try:
                return await asyncio.shield(connecting)
            finally:
                if connecting.done() and self._connecting is connecting:
                    self._connecting = None

    async def _connect(self, deadline):
        loop = asyncio.get_running_loop()
        timeout = 20.0 if deadline is None else max(deadline - loop.time(), 0.001)
        transport, fabric_stream = await _open_transport(self._target, timeout, self._fabric, self._tls)
        self._conn = AioConnection(transport, client_side=True, max_receive=self._max_receive,
                                   trusted_peer=fabric_stream, keepalive=self._keepalive)
        return self._conn

    def unary_unary(self, method, request_serializer=None, response_deserializer=None,
                    _registered_method=False):
        return UnaryUnaryMultiCallable(self, method, request_serializer, response_deserializer)

    def unary_stream(self, method, request_serializer=None, response_deserializer=None,
                     _registered_method=False):
        return UnaryStreamMultiCallable(self, method, request_serializer, response_deserializer)

    def stream_unary(self, method, request_serializer=None, response_deserializer=None,
                     _registered_method=False):
        return StreamUnaryMultiCallable(self, method, request_serializer, response_deserializer)

    def stream_stream(self, method, request_serializer=None, response_deserializer=None,
                      _registered_method=False):
        return StreamStreamMultiCallable(self, method, request_serializer, response_deserializer)

    def get_state(self, try_to_connect: bool = False):
        if self._closed:
            return grpc.ChannelConnectivity.SHUTDOWN
        if self._conn is not None and self._conn.alive:
            return grpc.ChannelConnectivity.READY
        if try_to_connect and self._connecting is None:
            try:
                self._connecting = asyncio.get_running_loop().create_task(self._connect(None))
                self._connecting.add_done_callback(lambda t: t.exception())
            except RuntimeError:
                pass
        return grpc.ChannelConnectivity.CONNECTING if self._connecting else grpc.ChannelConnectivity.IDLE

    async def wait_for_state_change(self, last_observed_state):
        while self.get_state() == last_observed_state:
            await asyncio.sleep(0.01)

    async def channel_ready(self):
        while True:
            try:
                await self._connection(None)
                return
            except (ConnectionFailed, errors.FabricError, OSError, TimeoutError):
                if self._closed:
                    raise
                await asyncio.sleep(0.05)

    async def close(self, grace=None):
        if self._closed:
            return
        self._closed = True
        if grace:
            end = time.monotonic() + grace
            while self._calls and time.monotonic() < end:
                await asyncio.sleep(0.005)
        for call in list(self._calls):
            call._abort(grpc.StatusCode.CANCELLED, "Channel closed!")
        if self._conn is not None:
            self._conn.close()
        if self._connecting is not None:
            self._connecting.cancel()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


# ==================================================================== server

class ServicerContext(grpc.aio.ServicerContext):
    """What an asyncio handler sees of its call."""

    def __init__(self, server, conn, stream, method, metadata, deadline):
        self._server, self._conn, self._stream = server, conn, stream
        self._loop = conn.loop
        self._method = method
        self._metadata = metadata
        self._deadline = deadline
        self._code = None
        self._details = None
        self._trailing = ()
        self._initial_sent = False
        self._finished = False
        self._cancelled = False
        self._done_callbacks = []
        self._compression = None
        self._encoding = None
        self._plain_next = False
        self._task = None
        self._reading = False

    # -- call information
    def invocation_metadata(self):
        return self._metadata            # a tuple of (key, value), as grpc.aio's servers give it

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
            self._done_callbacks.append(callback)

    def _run_callbacks(self):
        callbacks, self._done_callbacks = self._done_callbacks, []
        for cb in callbacks:
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

    def _send_headers(self, metadata=()):
        self._initial_sent = True
        headers = [(b":status", b"200"), (b"content-type", _wire.CONTENT_TYPE),
                   (b"grpc-accept-encoding", _wire.ACCEPT_ENCODING)]
        wanted = self._compression or self._server._encoding
        if wanted not in (None, "identity"):
            accepted = dict(self._stream.headers).get(b"grpc-accept-encoding", b"")
            if wanted.encode() in [a.strip() for a in accepted.split(b",")]:
                self._encoding = wanted
                headers.append((b"grpc-encoding", wanted.encode()))
        self._conn.send_headers(self._stream, headers + _wire.metadata_to_headers(metadata))

    async def write(self, message):
        if self.done():
            raise grpc.aio.AbortError() if self._cancelled else grpc.aio.UsageError("the call is over")
        await self._write(message, self._handler.response_serializer)

    async def _write(self, response, serializer):
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
        if not self._initial_sent:
            self._send_headers()
        encoding, self._plain_next = (None if self._plain_next else self._encoding), False
        await self._conn.send_message(self._stream, data, deadline=self._deadline, encoding=encoding)

    async def read(self):
        """The next request of a streaming-request call, or grpc.aio.EOF."""
        s = self._stream
        ok = await s.wait(lambda: bool(s.messages) or s.ended, self._deadline)
        if s.messages:
            msg = s.take_message()
            try:
                return self._handler.request_deserializer(bytes(msg)) \
                    if self._handler.request_deserializer else bytes(msg)
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

    def _finish(self, code, details):
        """Trailers (or Trailers-Only) with the status; once; never raises."""
        if self._finished or self._cancelled:
            return
        self._finished = True
        trailers_only = not self._initial_sent
        self._initial_sent = True
        try:
            try:
                trailers = _wire.trailers(code, details, self._trailing)
            except Exception as e:              # noqa: BLE001 - still end the call
                trailers = _wire.trailers(grpc.StatusCode.INTERNAL, f"bad status or trailing metadata: {e}")
            if trailers_only:
                trailers = [(b":status", b"200"), (b"content-type", _wire.CONTENT_TYPE),
                            (b"grpc-accept-encoding", _wire.ACCEPT_ENCODING)] + trailers
            self._conn.send_headers(self._stream, trailers, end_stream=True)
            if not self._stream.ended:
                import h2.errors
                self._conn.reset(self._stream, h2.errors.ErrorCodes.NO_ERROR)
        except ConnectionFailed:
            pass
        except Exception:                       # noqa: BLE001 - still end the call
            import h2.errors
            self._conn.reset(self._stream, h2.errors.ErrorCodes.INTERNAL_ERROR)
        finally:
            self._conn.forget(self._stream)
            self._run_callbacks()


class _RequestIterator:
    def __init__(self, ctx):
        self._ctx = ctx

    def __aiter__(self):
        return self

    async def __anext__(self):
        msg = await self._ctx.read()
        if msg is EOF:
            raise StopAsyncIteration
        return msg


class Server(HandlerRegistry, grpc.aio.Server):
    """fabric.grpc.aio.server(migration_thread_pool=None, handlers=None, ...)."""

    def __init__(self, migration_thread_pool=None, handlers=None, interceptors=None, options=None,
                 maximum_concurrent_rpcs=None, compression=None, fabric=None):
        for interceptor in interceptors or ():
            if not isinstance(interceptor, grpc.aio.ServerInterceptor):          # as grpc.aio checks
                raise ValueError(f"Interceptor {interceptor!r} must be grpc.aio.ServerInterceptor")
        self._interceptors = tuple(interceptors or ())
        opts = _options_dict(options)
        self._pool = migration_thread_pool
        self._init_handlers(handlers)
        self._max_receive = int(opts.get("grpc.max_receive_message_length", _wire.DEFAULT_MAX_RECEIVE))
        self._max_send = int(opts.get("grpc.max_send_message_length", -1))
        self._encoding = _wire.encoding_of(compression if compression is not None
                                           else opts.get("grpc.default_compression_algorithm"))
        self._max_concurrent = maximum_concurrent_rpcs
        self._keepalive = _keepalive.Settings(opts, server=True)
        self._fabric = fabric
        self._ports = []                 # (kind, listening object, TLS context) bound at add_*_port
        self._serving = []               # asyncio servers and accept tasks
        self._connections = set()
        self._closed_reasons = collections.deque(maxlen=16)
        self._calls = set()
        self._started = False
        self._stopping = False
        self._stopped = None

    # -- configuration
    def add_insecure_port(self, address: str) -> int:
        """Bind now (host:port plain TCP, or fabric[+backend]://host:port);
        returns the port (useful with port 0)."""
        return self._add_port(address, None)

    def add_secure_port(self, address, server_credentials) -> int:
        """Bind now, TLS on plain TCP (host:port); server_credentials from
        fabric.grpc.ssl_server_credentials. Returns the port."""
        return self._add_port(address, _tls.server_credentials(server_credentials).context())

    def _add_port(self, address: str, tls_context) -> int:
        backend, host, port = _transport.parse_target(address)
        if backend is not None and tls_context is not None:
            raise ValueError(f"TLS is for plain TCP addresses (host:port), not {address!r}: fabric connections "
                             "are meant for a trusted cluster network")
        if backend is None:
            sock = socket.create_server((host or "0.0.0.0", port), family=socket.AF_INET6 if ":" in host
                                        else socket.AF_INET, backlog=1024, reuse_port=False)
            sock.setblocking(False)
            self._ports.append(("socket", sock, tls_context))
            bound = sock.getsockname()[1]
        else:
            fab = self._fabric or _transport.shared_fabric(backend)
            listener = fab.listen_stream(_fabric_address(host, port))
            self._ports.append(("fabric", listener, None))
            bound = int(listener.address.rsplit(":", 1)[1])
        if self._started:                     # serve it too (from within the running loop)
            asyncio.get_running_loop().create_task(self._serve_port(*self._ports[-1]))
        return bound

    # -- lifecycle
    async def start(self):
        if self._started:
            raise grpc.aio.UsageError("server already started")
        self._started = True
        self._stopped = asyncio.get_running_loop().create_future()
        for kind, obj, tls_context in self._ports:
            await self._serve_port(kind, obj, tls_context)

    async def _serve_port(self, kind, obj, tls_context=None):
        loop = asyncio.get_running_loop()
        if kind == "socket":
            async def on_client(reader, writer):
                try:
                    transport = SocketTransport(reader, writer)
                except errors.FabricError:           # e.g. TLS without ALPN h2: that client only
                    writer.close()
                    return
                self._attach(transport, trusted=False)
            tls = {} if tls_context is None else {"ssl": tls_context,
                                                  "ssl_handshake_timeout": _tls.HANDSHAKE_TIMEOUT}
            self._serving.append(await asyncio.start_server(on_client, sock=obj, **tls))
        else:
            self._serving.append(loop.create_task(self._accept_fabric(obj)))

    async def _accept_fabric(self, listener):
        while not self._stopping:
            try:
                stream = await listener.aaccept()
            except errors.ConnectionClosed:
                return
            except errors.FabricError:
                continue                     # a failed handshake: keep serving others
            self._attach(FabricTransport(stream), trusted=True)

    def _attach(self, transport, trusted):
        if self._stopping:
            transport.close()
            return
        conn = AioConnection(transport, client_side=False, max_receive=self._max_receive,
                             on_request=self._on_request, on_close=self._conn_closed,
                             trusted_peer=trusted, keepalive=self._keepalive)
        self._connections.add(conn)

    def _conn_closed(self, conn):
        self._connections.discard(conn)
        self._closed_reasons.append(conn.dead)          # (diagnostics: why connections ended)

    async def stop(self, grace):
        if self._stopped is None:
            return
        self._stopping = True
        for s in self._serving:
            if isinstance(s, asyncio.Task):
                s.cancel()
            else:
                s.close()
        for kind, obj, _ in self._ports:
            try:
                obj.close()
            except (OSError, errors.FabricError):
                pass
        for conn in list(self._connections):     # open calls go on; new ones are refused
            conn.go_away()
        if grace:
            end = asyncio.get_running_loop().time() + grace
            while self._calls and asyncio.get_running_loop().time() < end:
                await asyncio.sleep(0.005)
        for ctx in list(self._calls):
            ctx._on_client_gone()
            if ctx._stream is not None:
                ctx._conn.reset(ctx._stream)
        for conn in list(self._connections):
            conn.close(graceful=True)
        if not self._stopped.done():
            self._stopped.set_result(None)

    async def wait_for_termination(self, timeout=None) -> bool:
        if self._stopped is None:
            return False
        try:
            await asyncio.wait_for(asyncio.shield(self._stopped), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    # -- calls
    async def _lookup(self, method, metadata):
        """The handler of method through the interceptors (the first given is
        the outermost, as grpc.aio chains them)."""
        details = HandlerCallDetails(method, metadata)

        async def at(index, d):
            if index == len(self._interceptors):
                return self._find_handler(d)

            async def continuation(next_details):
                return await at(index + 1, next_details)
            return await self._interceptors[index].intercept_service(continuation, d)
        return await at(0, details)

    def _on_request(self, conn, stream):
        headers = dict(stream.headers)
        method = headers.get(b":path", b"").decode("ascii", "replace")
        ctx = ServicerContext(self, conn, stream, method, _wire.headers_to_metadata(stream.headers), None)
        ct = headers.get(b"content-type", b"")
        if headers.get(b":method") != b"POST" or not ct.startswith(_wire.CONTENT_TYPE):
            ctx._finish(grpc.StatusCode.INTERNAL, f"not a gRPC request (content-type {ct!r})")
            return
        if b"grpc-timeout" in headers:
            try:
                ctx._deadline = conn.loop.time() + _wire.decode_timeout(headers[b"grpc-timeout"])
            except _wire.WireError as e:
                ctx._finish(e.code, e.details)
                return
        enc = headers.get(b"grpc-encoding", b"identity").decode("ascii", "replace")
        if enc not in _wire.ENCODINGS:
            ctx._finish(grpc.StatusCode.UNIMPLEMENTED, f"Compression algorithm {enc!r} is not supported "
                                                       f"(accepted: {_wire.ACCEPT_ENCODING.decode()})")
            return
        if self._max_concurrent is not None and len(self._calls) >= self._max_concurrent:
            ctx._finish(grpc.StatusCode.RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded!")
            return
        stream.on_event = lambda s, c=ctx: (c._on_client_gone() if s.reset_code is not None or (
            s.failure is not None and not isinstance(s.failure, _wire.WireError)) else None)
        self._calls.add(ctx)
        ctx._task = conn.loop.create_task(self._serve(ctx, method))
        ctx._task.add_done_callback(lambda t, c=ctx: self._calls.discard(c))

    async def _serve(self, ctx, method):
        try:
            handler = await self._lookup(method, ctx._metadata)
        except Exception as e:                        # noqa: BLE001 - an interceptor's failure is the status
            ctx._finish(grpc.StatusCode.UNKNOWN, f"Exception in an interceptor: {e!r}")
            return
        if handler is None:
            ctx._finish(grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {method}")
            return
        ctx._handler = handler
        timer = None
        if ctx._deadline is not None:
            timer = ctx._loop.call_at(ctx._deadline, self._expire, ctx)
        try:
            if handler.request_streaming:
                request = _RequestIterator(ctx)
            else:
                request = await self._single_request(ctx)
            if handler.response_streaming:
                behavior = handler.stream_stream if handler.request_streaming else handler.unary_stream
                result = await self._invoke(behavior, request, ctx)
                if hasattr(result, "__aiter__"):
                    async for response in result:
                        await ctx._write(response, handler.response_serializer)
                elif result is not None and hasattr(result, "__iter__"):
                    for response in result:
                        await ctx._write(response, handler.response_serializer)
            else:
                behavior = handler.stream_unary if handler.request_streaming else handler.unary_unary
                response = await self._invoke(behavior, request, ctx)
                if ctx.done():
                    return
                if ctx._code in (None, grpc.StatusCode.OK):
                    if response is None:
                        ctx._finish(grpc.StatusCode.INTERNAL, "the handler returned no response")
                        return
                    await ctx._write(response, handler.response_serializer)
            ctx._finish(ctx._code or grpc.StatusCode.OK, ctx._details)
        except grpc.aio.AbortError:
            ctx._finish(ctx._code or grpc.StatusCode.UNKNOWN, ctx._details)
        except asyncio.CancelledError:
            if not ctx._cancelled:
                ctx._finish(grpc.StatusCode.CANCELLED, "the handler was cancelled")
        except ConnectionFailed:
            ctx._on_client_gone()
        except Exception as e:                        # noqa: BLE001 - the handler's failure is the status
            if not ctx.done():
                if ctx._code not in (None, grpc.StatusCode.OK):
                    ctx._finish(ctx._code, ctx._details)
                else:
                    ctx._finish(grpc.StatusCode.UNKNOWN, f"Unexpected {type(e).__name__}: {e}")
        finally:
            if timer is not None:
                timer.cancel()

    async def _invoke(self, behavior, request, ctx):
        if inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior):
            result = behavior(request, ctx)
            return await result if inspect.iscoroutine(result) else result
        if self._pool is not None:
            # a sync handler: on the migration pool, as grpc.aio runs it
            if not hasattr(request, "__aiter__"):
                return await ctx._loop.run_in_executor(self._pool, behavior, request, ctx)
        result = behavior(request, ctx)
        if inspect.isawaitable(result):
            result = await result
        return result

    def _expire(self, ctx):
        if not ctx.done():
            ctx._finish(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            ctx._cancelled = True
            if ctx._task is not None:
                ctx._task.cancel()

    async def _single_request(self, ctx):
        s = ctx._stream
        ok = await s.wait(lambda: s.ended or len(s.messages) > 1, ctx._deadline)
        msgs = [s.take_message() for _ in range(len(s.messages))]
        if isinstance(s.failure, _wire.WireError):
            ctx._code, ctx._details = s.failure.code, s.failure.details
            raise grpc.aio.AbortError()
        if s.failure is not None or s.reset_code is not None or not ok:
            ctx._on_client_gone()
            raise ConnectionFailed("the client went away")
        if len(msgs) != 1:
            ctx._code = grpc.StatusCode.UNIMPLEMENTED
            ctx._details = "No request message for unary call" if not msgs else "Too many requests for unary call"
            raise grpc.aio.AbortError()
        try:
            d = ctx._handler.request_deserializer
            return d(bytes(msgs[0])) if d else bytes(msgs[0])
        except Exception as e:                        # noqa: BLE001 - reported as the call's status
            ctx._code, ctx._details = grpc.StatusCode.INTERNAL, f"Exception deserializing request! {e!r}"
            raise grpc.aio.AbortError() from None


def insecure_channel(target, options=None, compression=None, interceptors=None, fabric=None) -> Channel:
    """A grpc.aio.Channel to target (host:port, or fabric[+backend]://host:port)."""
    return Channel(target, options, compression, interceptors, fabric)


def secure_channel(target, credentials, options=None, compression=None, interceptors=None) -> Channel:
    """A grpc.aio.Channel over TLS to target (host:port); credentials from
    grpc.ssl_channel_credentials or fabric.grpc.ssl_channel_credentials."""
    return Channel(target, options, compression, interceptors, None, credentials)


def server(migration_thread_pool=None, handlers=None, interceptors=None, options=None,
           maximum_concurrent_rpcs=None, compression=None, fabric=None) -> Server:
    """A grpc.aio.Server; add_insecure_port takes host:port and fabric[+backend]://host:port."""
    return Server(migration_thread_pool, handlers, interceptors, options, maximum_concurrent_rpcs,
                  compression, fabric)
