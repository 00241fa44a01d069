"""The client side of fabric.grpc: a grpc.Channel that generated stubs take
unchanged, over a fabric byte stream (fabric+<backend>://host:port) or a plain
TCP socket (host:port, for stock gRPC servers)."""
from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc

from fabric.grpc import _h2, _http2, _keepalive, _tls, _transport, _wire

USER_AGENT = b"fabric-grpc/0.1"


def _options_dict(options) -> dict:
    return {k: v for k, v in (options or ())}


class RpcError(grpc.RpcError, grpc.Call, grpc.Future):
    """A finished call that did not end OK (what grpcio raises, same methods)."""

    def __init__(self, code, details, initial_metadata=(), trailing_metadata=(), debug=""):
        super().__init__()
        self._code, self._details = code, details
        self._initial, self._trailing, self._debug = initial_metadata, trailing_metadata, debug

    def __str__(self):
        return (f"<RpcError of RPC that terminated with:\n\tstatus = {self._code}\n"
                f"\tdetails = \"{self._details}\"\n>")

    __repr__ = __str__

    def code(self):
        return self._code

    def details(self):
        return self._details

    def initial_metadata(self):
        return self._initial

    def trailing_metadata(self):
        return self._trailing

    def debug_error_string(self):
        return self._debug or f"{self._code}: {self._details}"

    def is_active(self):
        return False

    def time_remaining(self):
        return None

    def cancel(self):
        return False

    def add_callback(self, callback):
        return False

    # grpc.Future
    def cancelled(self):
        return self._code == grpc.StatusCode.CANCELLED

    def running(self):
        return False

    def done(self):
        return True

    def result(self, timeout=None):
        raise self

    def exception(self, timeout=None):
        return self

    def traceback(self, timeout=None):
        return None

    def add_done_callback(self, fn):
        fn(self)


class _Call(grpc.Call, grpc.Future):
    """One RPC in flight (client side): the HTTP/2 stream, its status, and
    the grpc.Call / grpc.Future / response-iterator faces grpcio gives it."""

    _plugins = ()                 # metadata plugins of the call's credentials
    _unary = False                # one response expected: OK without it is INTERNAL
    _encoding = None              # grpc-encoding of our requests (None: identity)

    def __init__(self, channel, method: str, path: bytes, deserializer, timeout, metadata, wait_for_ready=None):
        self._channel = channel
        self._method = method
        self._path = path
        self._deserialize = deserializer
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._timeout = timeout
        self._metadata = metadata
        self._code = None
        self._details = ""
        self._initial = None
        self._trailing = ()
        self._raw_initial = None        # response headers, made metadata only if asked for
        self._raw_trailing = None       # the same for the trailers
        self._callbacks = None
        self._done_callbacks = None
        self._state_lock = threading.Lock()
        self._done = None             # a threading.Event, made only for result() / exception()
        self._result = None
        self._got_response = False
        self._stream = None
        self._conn = None
        self._waiter = _http2.Waiter()
        self._wait_for_ready = wait_for_ready

    # -- starting
    def _headers(self):
        """The request headers, or None (the call ended with an error)."""
        headers = self._channel._headers_of(self._path)
        if self._encoding not in (None, "identity"):
            headers.append((b"grpc-encoding", self._encoding.encode()))
        if self._timeout is not None:
            headers.append((b"grpc-timeout", _wire.encode_timeout(max(self._deadline - time.monotonic(), 0))))
        try:
            if self._metadata:
                headers.extend(_wire.metadata_to_headers(self._metadata))
            if self._plugins:
                headers.extend(_wire.metadata_to_headers(self._credential_metadata()))
        except ValueError as e:
            self._finish(grpc.StatusCode.INTERNAL, str(e))
            return None
        except _tls.CallCredentialsError as e:
            self._finish(e.code, e.details)
            return None
        return headers

    def _serialize(self, request, serializer):
        """The request's bytes, or None (the call ended with an error)."""
        try:
            data = serializer(request) if serializer else request
            n = memoryview(data).nbytes
        except Exception as e:
            self._finish(grpc.StatusCode.INTERNAL, f"Exception serializing request: {e!r}")
            return None
        max_send = self._channel._max_send
        if max_send >= 0 and n > max_send:
            self._finish(grpc.StatusCode.RESOURCE_EXHAUSTED, f"Sent message larger than max ({n} vs. {max_send})")
            return None
        return data

    def _start(self, request=None, serializer=None, unary_request=False) -> bool:
        """Headers (and, unary_request, the one request and end of stream)
        in one write."""
        headers = self._headers()
        if headers is None:
            return False
        payload, compressed = None, False
        if unary_request:
            data = self._serialize(request, serializer)
            if data is None:
                return False
            payload, compressed = _wire.maybe_compress(data, self._encoding)
        try:
            conn = self._channel._connection(self._deadline, self._wait_for_ready)
            self._conn = conn
            self._stream = conn.open_call(self._waiter, headers, payload, compressed, self._deadline)
        except TimeoutError:
            self._finish(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            return False
        except Exception as e:
            if self._deadline is not None and time.monotonic() >= self._deadline:
                self._finish(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            elif self._conn is not None:
                self._finish(grpc.StatusCode.UNAVAILABLE, f"connection lost: {e}")
            else:
                self._finish(grpc.StatusCode.UNAVAILABLE, f"failed to connect to {self._channel._target}: {e}")
            return False
        if self._deadline is not None:
            self._channel._timers.schedule(self._deadline, self._on_deadline)
        return True

    def _credential_metadata(self):
        """What the call credentials' plugins add (TLS channels only, as grpcio)."""
        if self._channel._tls is None:
            raise _tls.CallCredentialsError(grpc.StatusCode.UNAUTHENTICATED, "Established channel does not have "
                                            "a sufficient security level to transfer call credential.")
        left = None if self._deadline is None else self._deadline - time.monotonic()
        return _tls.plugin_metadata(self._plugins, _tls.service_url(self._channel._authority, self._method),
                                    self._method, left)

    def _on_deadline(self):
        if self._code is None:
            self._abort(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    def _abort(self, code, details):
        """End the call locally (deadline, cancel, client-side error) and reset its stream."""
        if self._finish(code, details) and self._stream is not None:
            self._conn.reset(self._stream)

    def _finish(self, code, details, trailing=None) -> bool:
        with self._state_lock:
            if self._code is not None:
                return False
            self._code, self._details = code, details
            if trailing is not None:
                self._trailing = trailing
            callbacks, self._callbacks = self._callbacks, None
            done_callbacks, self._done_callbacks = self._done_callbacks, None
            if self._done is not None:
                self._done.set()
        s = self._stream
        if s is not None:
            conn = self._conn
            with conn.lock:
                self._waiter.wake()         # a thread of ours may be waiting on the stream
            conn.forget(s)
        for cb in callbacks or ():
            try:
                cb()
            except Exception:
                pass
        for cb in done_callbacks or ():
            try:
                cb(self)
            except Exception:
                pass
        return True

    # -- sending (streaming requests)
    def _send(self, request, serializer, end_stream: bool) -> bool:
        data = self._serialize(request, serializer)
        if data is None:
            if self._stream is not None:
                self._conn.reset(self._stream)
            return False
        try:
            self._conn.send_message(self._stream, self._send_waiter, data, end_stream=end_stream,
                                    deadline=self._deadline, encoding=self._encoding)
        except TimeoutError:
            self._abort(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            return False
        except _http2.ConnectionFailed:
            self._settle()       # the server may have ended the call already (status in trailers)
            return False
        return True

    def _close_send(self):
        try:
            self._conn.end_stream(self._stream)
        except _http2.ConnectionFailed:
            pass

    def _consume_requests(self, iterator, serializer):
        """Send every request of an iterator, then half-close (own thread)."""
        self._send_waiter = _http2.Waiter()
        try:
            for request in iterator:
                if self._code is not None:
                    return
                if not self._send(request, serializer, False):
                    return
        except Exception as e:
            self._abort(grpc.StatusCode.UNKNOWN, f"Exception iterating requests: {e!r}")
            return
        if self._code is None:
            self._close_send()

    # -- receiving
    def _settle(self, pending=None):
        """If the stream has ended or failed, record the status. pending:
        messages are still to be taken (the status waits for them)."""
        s = self._stream
        if s is None or self._code is not None:
            return
        conn = self._conn
        with conn.lock:
            failure, reset, ended, trailers, headers = s.failure, s.reset_code, s.ended, s.trailers, s.headers
            if pending is None:
                pending = bool(s.messages)
        if failure is not None:
            if isinstance(failure, _wire.WireError):
                self._abort(failure.code, failure.details)
            elif isinstance(failure, _h2.H2Error):
                self._finish(grpc.StatusCode.INTERNAL, str(failure))
            else:
                self._finish(grpc.StatusCode.UNAVAILABLE, f"connection lost: {failure}")
        elif ended and not pending:
            self._finish_from_headers(headers, trailers)
        elif s.peer_done and not pending:
            self._finish_from_headers(headers, trailers)
        elif reset is not None:
            self._finish(grpc.StatusCode.CANCELLED if reset == 8 else grpc.StatusCode.INTERNAL,
                         f"Received RST_STREAM with error code {int(reset)}")

    def _finish_from_headers(self, headers, trailers):
        if trailers is None:
            # Trailers-Only: the status is in the only HEADERS frame
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
        if code == grpc.StatusCode.OK and self._unary and not self._got_response:
            code, details = grpc.StatusCode.INTERNAL, "No message returned for unary call"
        self._raw_trailing = trailers
        self._finish(code, details)

    def _ready(self):
        s = self._stream
        return bool(s.messages) or s.ended or s.failure is not None or s.reset_code is not None or \
            s.peer_done or self._code is not None

    def _next_message(self):
        """The next response message, or None when the call is over."""
        s = self._stream
        if s is None:
            return None
        conn = self._conn
        with conn.lock:
            ok = conn.await_(self._waiter, self._ready, self._deadline)
            self._capture_initial(s)
            msg = conn.take_message(s) if s.messages and self._code is None else None
        if msg is not None:
            conn.sent_acks()
            return msg
        if not ok:
            self._on_deadline()
        self._settle()
        return None

    def _capture_initial(self, s):
        """(connection lock held) Initial metadata once the response headers
        are in; a Trailers-Only response (status in its only HEADERS) has none."""
        if self._initial is None and self._raw_initial is None and s.headers is not None:
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

    def _deserialize_message(self, msg):
        try:
            return self._deserialize(msg) if self._deserialize else msg
        except Exception as e:
            self._abort(grpc.StatusCode.INTERNAL, f"Exception deserializing response! {e!r}")
            raise self._error() from None

    def _wait_done(self, timeout=None):
        s = self._stream
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._code is None:
            if s is None:
                break
            conn = self._conn
            with conn.lock:
                ok = conn.await_(self._waiter, lambda: (s.ended or s.peer_done) or s.failure is not None or
                                 s.reset_code is not None or self._code is not None,
                                 min(x for x in (deadline, self._deadline) if x is not None)
                                 if deadline or self._deadline else None)
                pending = bool(s.messages)
            self._settle(pending=False if (s.ended and not pending) else None)
            if not ok:
                if self._deadline and time.monotonic() >= self._deadline:
                    self._on_deadline()
                elif deadline and time.monotonic() >= deadline:
                    raise grpc.FutureTimeoutError()
            elif pending and self._code is None:
                # messages nobody will read (a streaming response not iterated to its end)
                with conn.lock:
                    while s.messages:
                        conn.take_message(s)
                conn.sent_acks()
        return self._code

    def _error(self):
        return RpcError(self._code, self._details, self._initial_metadata(), self._trailing_metadata())

    def _unary_response(self):
        """Wait for the single response of a unary-response call and the
        status: one wait, woken once, when the response (with its trailers,
        usually in the same read) is in."""
        s = self._stream
        conn = self._conn
        if s is not None:
            with conn.lock:
                ok = conn.await_(self._waiter, lambda: s.ended or len(s.messages) > 1 or s.failure is not None or
                                 s.reset_code is not None or s.peer_done or self._code is not None,
                                 self._deadline)
                self._capture_initial(s)
                msgs = []
                while s.messages:
                    msgs.append(conn.take_message(s))
            if conn.pending:
                conn.sent_acks()
            if not ok:
                self._on_deadline()
            elif self._code is None:
                if len(msgs) > 1:
                    self._abort(grpc.StatusCode.INTERNAL, "Too many responses for unary call")
                elif msgs and s.failure is None:
                    self._result = self._deserialize_message(msgs[0])
                    self._got_response = True
                self._settle(pending=False)
                if self._code is None:
                    self._wait_done()
        if self._code != grpc.StatusCode.OK:
            raise self._error()
        return self._result

    # -- grpc.Call / RpcContext
    def initial_metadata(self):
        s = self._stream
        if self._initial is None and self._raw_initial is None and s is not None:
            conn = self._conn
            with conn.lock:
                conn.await_(self._waiter, lambda: s.headers is not None or s.ended or s.failure is not None or
                            s.reset_code is not None or self._code is not None, self._deadline)
                self._capture_initial(s)
        return self._initial_metadata()

    def trailing_metadata(self):
        self._wait_done()
        return self._trailing_metadata()

    def code(self):
        self._wait_done()
        return self._code

    def details(self):
        self._wait_done()
        return self._details

    def debug_error_string(self):
        return f"{self._code}: {self._details}"

    def is_active(self):
        return self._code is None

    def time_remaining(self):
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def cancel(self):
        if self._code is not None:
            return False
        self._abort(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")
        return True

    def add_callback(self, callback):
        with self._state_lock:
            if self._code is None:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(callback)
                return True
        return False

    # -- grpc.Future
    def _done_event(self):
        with self._state_lock:
            if self._done is None:
                self._done = threading.Event()
                if self._code is not None:
                    self._done.set()
            return self._done

    def cancelled(self):
        return self._code == grpc.StatusCode.CANCELLED

    def running(self):
        return self._code is None

    def done(self):
        return self._code is not None

    def result(self, timeout=None):
        if not self._done_event().wait(timeout):
            raise grpc.FutureTimeoutError()
        if self._code == grpc.StatusCode.OK:
            return self._result
        if self._code == grpc.StatusCode.CANCELLED:
            raise grpc.FutureCancelledError()
        raise self._error()

    def exception(self, timeout=None):
        if not self._done_event().wait(timeout):
            raise grpc.FutureTimeoutError()
        if self._code == grpc.StatusCode.OK:
            return None
        if self._code == grpc.StatusCode.CANCELLED:
            raise grpc.FutureCancelledError()
        return self._error()

    def traceback(self, timeout=None):
        self.exception(timeout)
        return None

    def add_done_callback(self, fn):
        with self._state_lock:
            if self._code is None:
                if self._done_callbacks is None:
                    self._done_callbacks = []
                self._done_callbacks.append(fn)
                return
        fn(self)

    # -- response iterator (unary_stream / stream_stream)
    def __iter__(self):
        return self

    def __next__(self):
        msg = self._next_message()
        if msg is not None:
            return self._deserialize_message(msg)
        if self._code is None:
            self._wait_done()
        if self._code == grpc.StatusCode.OK:
            raise StopIteration
        raise self._error()

    next = __next__

    def __repr__(self):
        return f"<fabric.grpc call {self._method} code={self._code}>"


class _MultiCallable:
    def __init__(self, channel, method, request_serializer, response_deserializer):
        self._channel = channel
        self._method = method
        self._path = method.encode()
        self._serialize = request_serializer
        self._deserialize = response_deserializer

    _unary_response = False

    def _new_call(self, timeout, metadata, wait_for_ready, compression=None, credentials=None):
        call = _Call(self._channel, self._method, self._path, self._deserialize, timeout, metadata, wait_for_ready)
        plugins = self._channel._call_plugins
        if credentials is not None:
            plugins = plugins + _tls.call_plugins(credentials)
        if plugins:
            call._plugins = plugins
        if self._unary_response:
            call._unary = True
        encoding = self._channel._encoding if compression is None else _wire.encoding_of(compression)
        if encoding is not None:
            call._encoding = encoding
        return call

    def _start_streaming(self, request_iterator, timeout, metadata, wait_for_ready, compression, credentials):
        call = self._new_call(timeout, metadata, wait_for_ready, compression, credentials)
        if call._start():
            threading.Thread(target=call._consume_requests, args=(request_iterator, self._serialize),
                             daemon=True, name="fabric-grpc-requests").start()
        return call


class UnaryUnaryMultiCallable(_MultiCallable, grpc.UnaryUnaryMultiCallable):
    _unary_response = True

    def _invoke(self, request, timeout, metadata, wait_for_ready, compression, credentials=None):
        call = self._new_call(timeout, metadata, wait_for_ready, compression, credentials)
        call._start(request, self._serialize, unary_request=True)
        return call

    def __call__(self, request, timeout=None, metadata=None, credentials=None, wait_for_ready=None,
                 compression=None):
        call = self._invoke(request, timeout, metadata, wait_for_ready, compression, credentials)
        if call._code is not None:
            raise call._error()
        return call._unary_response()

    def with_call(self, request, timeout=None, metadata=None, credentials=None, wait_for_ready=None,
                  compression=None):
        call = self._invoke(request, timeout, metadata, wait_for_ready, compression, credentials)
        if call._code is not None:
            raise call._error()
        return call._unary_response(), call

    def future(self, request, timeout=None, metadata=None, credentials=None, wait_for_ready=None,
               compression=None):
        call = self._invoke(request, timeout, metadata, wait_for_ready, compression, credentials)
        if call._code is None:
            self._channel._pool.submit(_complete_unary, call)
        return call


def _complete_unary(call):
    try:
        call._unary_response()
    except grpc.RpcError:
        pass


class UnaryStreamMultiCallable(_MultiCallable, grpc.UnaryStreamMultiCallable):
    def __call__(self, request, timeout=None, metadata=None, credentials=None, wait_for_ready=None,
                 compression=None):
        call = self._new_call(timeout, metadata, wait_for_ready, compression, credentials)
        call._start(request, self._serialize, unary_request=True)
        return call


class StreamUnaryMultiCallable(_MultiCallable, grpc.StreamUnaryMultiCallable):
    _unary_response = True

    def __call__(self, request_iterator, timeout=None, metadata=None, credentials=None,
                 wait_for_ready=None, compression=None):
        return self.with_call(request_iterator, timeout, metadata, credentials, wait_for_ready,
                              compression)[0]

    def with_call(self, request_iterator, timeout=None, metadata=None, credentials=None,
                  wait_for_ready=None, compression=None):
        call = self._start_streaming(request_iterator, timeout, metadata, wait_for_ready, compression, credentials)
        if call._code is not None:
            raise call._error()
        return call._unary_response(), call

    def future(self, request_iterator, timeout=None, metadata=None, credentials=None,
               wait_for_ready=None, compression=None):
        call = self._start_streaming(request_iterator, timeout, metadata, wait_for_ready, compression, credentials)
        if call._code is None:
            self._channel._pool.submit(_complete_unary, call)
        return call


class StreamStreamMultiCallable(_MultiCallable, grpc.StreamStreamMultiCallable):
    def __call__(self, request_iterator, timeout=None, metadata=None, credentials=None,
                 wait_for_ready=None, compression=None):
        return self._start_streaming(request_iterator, timeout, metadata, wait_for_ready, compression, credentials)


class Channel(grpc.Channel):
    """fabric.grpc.insecure_channel(target, options=None): a grpc.Channel.

    target: host:port (plain TCP, HTTP/2 as any gRPC peer speaks it) or
    fabric+<backend>://host:port (tcp, ucx, verbs; fabric://host:port picks
    the backend as fabric.Fabric does). Options understood:
    grpc.max_send_message_length (default unlimited), grpc.max_receive_message_length
    (default 4 MiB), grpc.default_authority, grpc.default_compression_algorithm
    (a grpc.Compression value, as the compression argument); others are
    accepted and ignored.
    """

    def __init__(self, target: str, options=None, compression=None, fabric=None, credentials=None):
        backend, host, port = _transport.parse_target(target)        # fail early on a bad target
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
        self._header_blocks = {}
        self._conn = None
        self._conn_lock = threading.Lock()
        self._closed = False
        self._timers = _keepalive.Timers("fabric-grpc-deadlines")
        self._pool = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="fabric-grpc-future")
        self._subscribers = []

    def _headers_of(self, path: bytes) -> list:
        """The request headers every call of a method starts with (a new list)."""
        block = self._header_blocks.get(path)
        if block is None:
            block = ((b":method", b"POST"), (b":scheme", b"https" if self._tls is not None else b"http"),
                     (b":path", path), (b":authority", self._authority), (b"te", b"trailers"),
                     (b"content-type", _wire.CONTENT_TYPE), (b"user-agent", USER_AGENT),
                     (b"grpc-accept-encoding", _wire.ACCEPT_ENCODING))
            if len(self._header_blocks) < 1024:
                self._header_blocks[path] = block
        return list(block)

    def _connection(self, deadline=None, wait_for_ready=None) -> _http2.Connection:
        conn = self._conn
        if conn is not None and conn.dead is None and conn.goaway_last_stream is None and not conn.closing \
                and (not conn.callers_read or time.monotonic() - conn.last_read <= _http2.IDLE_CHECK_AFTER):
            return conn                         # the common case, without the channel's lock
        with self._conn_lock:
            if self._closed:
                raise _http2.ConnectionFailed("Channel closed!")
            conn = self._conn
            if conn is not None:
                conn.check_idle()
            if conn is not None and conn.alive:
                return conn
            timeout = None if deadline is None else max(deadline - time.monotonic(), 0.001)
            stream = _transport.open_stream(self._target, timeout if timeout is not None else 20.0, self._fabric,
                                            self._tls)
            fabric_stream = isinstance(stream, _transport.FabricStreamAdapter)
            self._conn = _http2.Connection(stream, client_side=True, max_receive=self._max_receive,
                                           keepalive=self._keepalive,
                                           callers_read=True, trusted_peer=fabric_stream)
            for cb in list(self._subscribers):
                self._pool.submit(cb, grpc.ChannelConnectivity.READY)
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

    def subscribe(self, callback, try_to_connect=False):
        self._subscribers.append(callback)
        conn = self._conn
        if conn is not None and conn.alive:
            self._pool.submit(callback, grpc.ChannelConnectivity.READY)
        elif try_to_connect:
            def connect():
                try:
                    self._connection(time.monotonic() + 20)
                except Exception:
                    callback(grpc.ChannelConnectivity.TRANSIENT_FAILURE)
            self._pool.submit(connect)
        else:
            self._pool.submit(callback, grpc.ChannelConnectivity.IDLE)

    def unsubscribe(self, callback):
        try:
            self._subscribers.remove(callback)
        except ValueError:
            pass

    def close(self):
        with self._conn_lock:
            self._closed = True
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
        self._timers.close()
        self._pool.shutdown(wait=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
