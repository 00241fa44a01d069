"""The server side of fabric.grpc: a grpc.Server that add_XServicer_to_server
of generated code takes unchanged, listening on plain TCP (host:port, for
stock gRPC clients) and on fabric addresses (fabric+<backend>://host:port), on
both at once if asked."""
from __future__ import annotations

import collections
import threading
import time
import traceback

import grpc

from fabric.grpc import _http2, _keepalive, _tls, _transport, _wire
from fabric.grpc._http2_core import ErrorCodes


class _Abort(Exception):
    """Raised by context.abort() to unwind the handler."""


class HandlerCallDetails(grpc.HandlerCallDetails):
    def __init__(self, method, invocation_metadata):
        self.method = method
        self.invocation_metadata = invocation_metadata


class _LazyDetails(grpc.HandlerCallDetails):
    """HandlerCallDetails whose metadata is made only if a handler lookup asks."""
    __slots__ = ("method", "_ctx")

    def __init__(self, method, ctx):
        self.method = method
        self._ctx = ctx

    @property
    def invocation_metadata(self):
        return self._ctx.invocation_metadata()


RESPONSE_HEADERS = ((b":status", b"200"), (b"content-type", _wire.CONTENT_TYPE),
                    (b"grpc-accept-encoding", _wire.ACCEPT_ENCODING))
OK_TRAILERS = ((b"grpc-status", b"0"),)


class ServicerContext(grpc.ServicerContext):
    """What a handler sees of its call."""

    def __init__(self, server, conn, stream, method, deadline):
        self._server, self._conn, self._stream = server, conn, stream
        self._method = method
        self._metadata = None            # made from the headers on first use
        self._deadline = deadline
        self._code = None
        self._details = None
        self._trailing = ()
        self._initial_sent = False
        self._finished = False
        self._cancelled = False
        self._callbacks = None
        self._lock = threading.Lock()
        self._compression = None         # set_compression(), else the server's
        self._encoding = None            # what our messages use, fixed with the headers
        self._plain_next = False         # disable_next_message_compression()
        self._waiter = _http2.Waiter()
        stream.owner = self._waiter

    # -- call information
    def invocation_metadata(self):
        if self._metadata is None:
            self._metadata = _wire.headers_to_metadata(self._stream.headers)
        return self._metadata

    def peer(self):
        return _wire.peer_string(getattr(self._conn.stream, "peer_address", "?"))

    def peer_identities(self):
        ctx = self.auth_context()
        key = _tls.peer_identity_key(ctx)
        return None if key is None else ctx[key]

    def peer_identity_key(self):
        return _tls.peer_identity_key(self.auth_context())

    def auth_context(self):
        of = getattr(self._conn.stream, "auth_context", None)
        return of() if of is not None else {}

    def time_remaining(self):
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def is_active(self):
        return not (self._finished or self._cancelled)

    def add_callback(self, callback):
        with self._lock:
            if self._finished or self._cancelled:
                return False
            if self._callbacks is None:
                self._callbacks = []
            self._callbacks.append(callback)
            return True

    def _run_callbacks(self):
        with self._lock:
            callbacks, self._callbacks = self._callbacks, None
        for cb in callbacks or ():
            try:
                cb()
            except Exception:
                pass

    def cancel(self):
        """Cancel the call from the server side (the client sees CANCELLED)."""
        if self._cancelled or self._finished:
            return
        self._cancelled = True
        self._conn.reset(self._stream)
        self._run_callbacks()

    def _on_client_gone(self):
        if not self._finished and not self._cancelled:
            self._cancelled = True
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

    def abort(self, code, details):
        if code == grpc.StatusCode.OK:
            raise ValueError("abort() needs a non-OK status code")
        self._code, self._details = code, details
        raise _Abort()

    def abort_with_status(self, status):
        self.set_trailing_metadata(status.trailing_metadata)
        self.abort(status.code, status.details)

    def set_compression(self, compression):
        """Compress the responses (grpc.Compression) if the client accepts
        it; effective until the response headers are sent."""
        self._compression = _wire.encoding_of(compression)

    def disable_next_message_compression(self):
        self._plain_next = True

    def _choose_encoding(self):
        wanted = self._compression or self._server._encoding
        if wanted in (None, "identity"):
            return None
        accepted = b""
        for k, v in self._stream.headers:
            if k == b"grpc-accept-encoding":
                accepted = v
        return wanted if wanted.encode() in [a.strip() for a in accepted.split(b",")] else None

    # -- sending
    def send_initial_metadata(self, initial_metadata):
        with self._lock:
            if self._initial_sent:
                raise ValueError("initial metadata was already sent")
            self._initial_sent = True
        self._conn.send_headers(self._stream, self._response_headers(initial_metadata))

    def _response_headers(self, metadata=()):
        self._encoding = self._choose_encoding()
        if self._encoding is None and not metadata:
            return RESPONSE_HEADERS
        headers = list(RESPONSE_HEADERS)
        if self._encoding is not None:
            headers.append((b"grpc-encoding", self._encoding.encode()))
        return headers + _wire.metadata_to_headers(metadata)

    def _headers_due(self):
        """The response headers if they are still to be sent (now taken), else None."""
        with self._lock:
            if self._initial_sent:
                return None
            self._initial_sent = True
        return self._response_headers()

    def _serialize(self, response, serializer):
        try:
            data = serializer(response) if serializer else response
            n = memoryview(data).nbytes
        except Exception as e:
            self._code, self._details = grpc.StatusCode.INTERNAL, f"Failed to serialize response: {e!r}"
            raise _Abort() from None
        limit = self._server._max_send
        if limit >= 0 and n > limit:
            self._code = grpc.StatusCode.RESOURCE_EXHAUSTED
            self._details = f"Sent message larger than max ({n} vs. {limit})"
            raise _Abort()
        return data

    def _send_response(self, response, serializer):
        """One message of a streaming response."""
        if not self.is_active():
            return False
        data = self._serialize(response, serializer)
        headers = self._headers_due()
        if headers is not None:
            self._conn.send_headers(self._stream, headers, flush=False)
        encoding, self._plain_next = (None if self._plain_next else self._encoding), False
        self._conn.send_message(self._stream, self._waiter, data, deadline=self._deadline, encoding=encoding)
        return True

    def _respond_unary(self, response, serializer):
        """Headers, the response and the OK trailers in one write."""
        data = self._serialize(response, serializer)
        headers = self._headers_due()
        encoding, self._plain_next = (None if self._plain_next else self._encoding), False
        payload, compressed = _wire.maybe_compress(data, encoding)
        with self._lock:
            if self._finished or self._cancelled:
                return
            self._finished = True
        code = self._code or grpc.StatusCode.OK
        trailers = OK_TRAILERS if code == grpc.StatusCode.OK and not self._details and not self._trailing \
            else self._trailers(code, self._details)
        try:
            if not self._conn.respond(self._stream, headers, payload, compressed, trailers):
                self._conn.finish_message(self._stream, self._waiter, self._deadline)
                self._conn.send_headers(self._stream, trailers, end_stream=True)
            self._after_trailers()
        except (_http2.ConnectionFailed, TimeoutError):
            pass
        except Exception:
            self._conn.reset(self._stream, ErrorCodes.INTERNAL_ERROR)
        finally:
            self._run_callbacks()

    def _trailers(self, code, details):
        try:
            return _wire.trailers(code, details, self._trailing)
        except Exception as e:
            return _wire.trailers(grpc.StatusCode.INTERNAL, f"bad status or trailing metadata: {e}")

    def _after_trailers(self):
        if not self._stream.ended and self._stream.reset_code is None:
            # the request is not read to its end: the client may stop
            # sending; the call is complete (RFC 9113 8.1, as grpcio does)
            self._conn.reset(self._stream, ErrorCodes.NO_ERROR)

    def _finish(self, code, details):
        """Trailers (or Trailers-Only) with the status; once. Never raises,
        and always ends the call on the wire: if the trailers cannot be
        built or sent, the stream is reset."""
        with self._lock:
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
        except _http2.ConnectionFailed:
            pass
        except Exception:
            self._conn.reset(self._stream, ErrorCodes.INTERNAL_ERROR)
        finally:
            self._run_callbacks()

    # -- receiving
    def _wait_request(self, ready):
        """(no lock) Until ready() or the stream failed; the messages taken
        (all of them), and whether the wait ended in time."""
        s = self._stream
        conn = self._conn
        with conn.lock:
            ok = conn.await_(self._waiter, ready, self._deadline)
            msgs = []
            while s.messages:
                msgs.append(conn.take_message(s))
        if msgs:
            conn.sent_acks()
        return msgs, ok

    def _request_failure(self, ok):
        """Raise what ends the call when the request cannot be read."""
        s = self._stream
        failure = s.failure
        if isinstance(failure, _wire.WireError):
            self._code, self._details = failure.code, failure.details
            raise _Abort()
        if failure is not None or s.reset_code is not None or not ok:
            self._on_client_gone()
            raise _http2.ConnectionFailed("the client went away")


class _RequestIterator:
    """Requests of a streaming-request call, as the handler iterates them."""

    def __init__(self, context, deserializer):
        self._context = context
        self._deserialize = deserializer
        self._taken = collections.deque()

    def __iter__(self):
        return self

    def __next__(self):
        ctx = self._context
        if not self._taken:
            s = ctx._stream
            msgs, ok = ctx._wait_request(lambda: bool(s.messages) or s.ended or s.failure is not None
                                         or s.reset_code is not None)
            self._taken.extend(msgs)
            if not self._taken:
                try:
                    ctx._request_failure(ok)
                except _http2.ConnectionFailed:
                    raise _Abort() from None
                raise StopIteration
        return _deserialize(ctx, self._deserialize, self._taken.popleft())

    next = __next__


def _deserialize(ctx, deserializer, msg):
    try:
        return deserializer(msg) if deserializer else msg
    except Exception as e:
        ctx._code, ctx._details = grpc.StatusCode.INTERNAL, f"Exception deserializing request! {e!r}"
        raise _Abort() from None


def intercepted(interceptors, index, find, details):
    if index == len(interceptors):
        return find(details)
    return interceptors[index].intercept_service(
        lambda d: intercepted(interceptors, index + 1, find, d), details)


class HandlerRegistry:
    """The handlers of a server (sync or aio): registered methods first, then
    the generic handlers in the order they were added, as grpcio looks them up."""

    def _init_handlers(self, handlers):
        self._generic = list(handlers or ())
        self._registered = {}

    def add_generic_rpc_handlers(self, generic_rpc_handlers):
        self._generic.extend(generic_rpc_handlers)

    def add_registered_method_handlers(self, service_name, method_handlers):
        for method, handler in method_handlers.items():
            self._registered[f"/{service_name}/{method}"] = handler

    def _find_handler(self, details):
        handler = self._registered.get(details.method)
        if handler is not None:
            return handler
        for generic in self._generic:
            handler = generic.service(details)
            if handler is not None:
                return handler
        return None


class Server(HandlerRegistry, grpc.Server):
    """fabric.grpc.server(thread_pool, handlers=None, options=None, ...)."""

    def __init__(self, thread_pool, handlers=None, interceptors=None, options=None,
                 maximum_concurrent_rpcs=None, compression=None, fabric=None):
        for interceptor in interceptors or ():
            if not isinstance(interceptor, grpc.ServerInterceptor):
                raise TypeError(f"{interceptor!r} is not a grpc.ServerInterceptor")
        self._interceptors = tuple(interceptors or ())
        opts = {k: v for k, v in (options or ())}
        self._pool = thread_pool
        self._encoding = _wire.encoding_of(compression if compression is not None
                                           else opts.get("grpc.default_compression_algorithm"))
        self._init_handlers(handlers)
        self._max_receive = int(opts.get("grpc.max_receive_message_length", _wire.DEFAULT_MAX_RECEIVE))
        self._max_send = int(opts.get("grpc.max_send_message_length", -1))
        self._max_concurrent = maximum_concurrent_rpcs
        self._keepalive = _keepalive.Settings(opts, server=True)
        self._active_rpcs = 0
        self._fabric = fabric
        self._listeners = []
        self._pending_addresses = []
        self._connections = set()
        self._lock = threading.Lock()
        self._started = False
        self._timers = _keepalive.Timers("fabric-grpc-server-deadlines")
        self._stopped = threading.Event()
        self._shutdown_started = False

    # -- configuration
    def add_insecure_port(self, address):
        """Listen on address (host:port plain TCP, or fabric+<backend>://host:port);
        returns the port bound (useful with port 0)."""
        listener = _transport.open_listener(address, self._fabric)
        self._listeners.append(listener)
        if self._started:
            self._start_listener(listener)
        return listener.port

    def add_secure_port(self, address, server_credentials):
        """Listen with TLS on address (host:port); server_credentials from
        fabric.grpc.ssl_server_credentials. Returns the port bound."""
        context = _tls.server_credentials(server_credentials).context()
        listener = _transport.open_listener(address, self._fabric, tls_context=context)
        self._listeners.append(listener)
        if self._started:
            self._start_listener(listener)
        return listener.port

    # -- lifecycle
    def start(self):
        if self._started:
            raise ValueError("server already started")
        self._started = True
        for listener in self._listeners:
            self._start_listener(listener)

    def _start_listener(self, listener):
        threading.Thread(target=self._accept_loop, args=(listener,), daemon=True,
                         name="fabric-grpc-accept").start()

    def _accept_loop(self, listener):
        secure = getattr(listener, "tls_context", None) is not None
        while not self._shutdown_started:
            try:
                stream = listener.accept_socket() if secure else listener.accept()
            except Exception:
                if self._shutdown_started:
                    return
                time.sleep(0.01)          # a failed handshake: keep serving others
                continue
            if self._shutdown_started:
                stream.close()
                return
            if secure:                    # each TLS handshake in its own thread, bounded in time
                threading.Thread(target=self._handshake, args=(listener, stream), daemon=True,
                                 name="fabric-grpc-tls-handshake").start()
            else:
                self._serve_stream(stream)

    def _handshake(self, listener, sock):
        try:
            stream = listener.handshake(sock)
        except Exception:                 # noqa: BLE001 - a bad or slow client costs only its connection
            return
        if self._shutdown_started:
            stream.close()
            return
        self._serve_stream(stream)

    def _serve_stream(self, stream):
        try:
            conn = _http2.Connection(stream, client_side=False, max_receive=self._max_receive,
                                     keepalive=self._keepalive,
                                     trusted_peer=isinstance(stream, _transport.FabricStreamAdapter),
                                     on_request=self._on_request, on_close=self._on_conn_close,
                                     name="fabric-grpc-server")
        except Exception:                 # noqa: BLE001 - that connection only
            stream.close()
            return
        with self._lock:
            if not self._shutdown_started:
                self._connections.add(conn)
                return
        conn.close(graceful=False)        # stop() began while this one was being set up

    def _on_conn_close(self, conn):
        with self._lock:
            self._connections.discard(conn)

    def stop(self, grace):
        done = threading.Event()
        self._shutdown_started = True
        for listener in self._listeners:
            try:
                listener.close()
            except Exception:
                pass

        with self._lock:
            conns = list(self._connections)
        for conn in conns:                # open calls go on; new ones are refused (clients go elsewhere)
            conn.go_away()

        def finish():
            if grace:
                end = time.monotonic() + grace
                while self._active_rpcs and time.monotonic() < end:
                    time.sleep(0.01)
            with self._lock:
                conns = list(self._connections)
            for conn in conns:
                conn.close(graceful=True)
            self._timers.close()
            self._stopped.set()
            done.set()

        if grace:
            threading.Thread(target=finish, daemon=True).start()
        else:
            finish()
        return done

    def wait_for_termination(self, timeout=None):
        return self._stopped.wait(timeout)

    # -- calls
    def _lookup(self, method, ctx):
        """The handler of method, through the interceptors (the first given
        is the outermost, as grpcio chains them)."""
        handler = self._registered.get(method)
        if handler is not None and not self._interceptors:
            return handler
        details = _LazyDetails(method, ctx)
        if not self._interceptors:
            return self._find_handler(details)
        return intercepted(self._interceptors, 0, self._find_handler, details)

    def _on_request(self, conn, stream):
        """(reader thread) A new call: check its headers, then run it on the pool."""
        method = path = ct = timeout = None
        enc = b"identity"
        for k, v in stream.headers:
            if k == b":path":
                path = v
            elif k == b":method":
                method = v
            elif k == b"content-type":
                ct = v
            elif k == b"grpc-timeout":
                timeout = v
            elif k == b"grpc-encoding":
                enc = v
        name = path.decode("ascii", "replace") if path is not None else ""
        ctx = ServicerContext(self, conn, stream, name, None)
        try:
            failure = stream.failure
            if isinstance(failure, _wire.WireError):
                self._pool.submit(ctx._finish, failure.code, failure.details)
                return
            if method != b"POST" or ct is None or not ct.startswith(_wire.CONTENT_TYPE):
                self._pool.submit(ctx._finish, grpc.StatusCode.INTERNAL, f"not a gRPC request (content-type {ct!r})")
                return
            if timeout is not None:
                try:
                    ctx._deadline = time.monotonic() + _wire.decode_timeout(timeout)
                except _wire.WireError as e:
                    self._pool.submit(ctx._finish, e.code, e.details)
                    return
            if enc != b"identity":
                encoding = enc.decode("ascii", "replace")
                if encoding not in _wire.ENCODINGS:
                    # the trailers carry grpc-accept-encoding: what we do support
                    self._pool.submit(ctx._finish, grpc.StatusCode.UNIMPLEMENTED,
                                      f"Compression algorithm {encoding!r} is not supported (accepted: "
                                      f"{_wire.ACCEPT_ENCODING.decode()})")
                    return
            if self._max_concurrent is not None and self._active_rpcs >= self._max_concurrent:
                self._pool.submit(ctx._finish, grpc.StatusCode.RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded!")
                return
            # the client is gone if it reset the call or the connection failed; a
            # request it got wrong (WireError) ends the call with a status instead
            stream.on_event = lambda s, c=ctx: (c._on_client_gone()
                                                if s.reset_code is not None or (
                                                    s.failure is not None
                                                    and not isinstance(s.failure, _wire.WireError))
                                                else None)
            self._pool.submit(self._run, ctx, name)
        except RuntimeError:            # pool shut down
            conn.reset(stream)

    def _run(self, ctx, method):
        with self._lock:
            self._active_rpcs += 1
        try:
            self._serve(ctx, method)
        finally:
            with self._lock:
                self._active_rpcs -= 1

    def _serve(self, ctx, method):
        handler = self._lookup(method, ctx)
        if handler is None:
            ctx._finish(grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {method}")
            return
        if ctx._deadline is not None:
            self._schedule_deadline(ctx)
        try:
            if handler.request_streaming:
                request = _RequestIterator(ctx, handler.request_deserializer)
            else:
                request = self._single_request(ctx, handler.request_deserializer)
            if handler.response_streaming:
                behavior = handler.stream_stream if handler.request_streaming else handler.unary_stream
                for response in behavior(request, ctx):
                    if not ctx._send_response(response, handler.response_serializer):
                        return
            else:
                behavior = handler.stream_unary if handler.request_streaming else handler.unary_unary
                response = behavior(request, ctx)
                if not ctx.is_active():
                    return
                if response is None and ctx._code in (None, grpc.StatusCode.OK):
                    ctx._finish(grpc.StatusCode.INTERNAL, "the handler returned no response")
                    return
                if ctx._code in (None, grpc.StatusCode.OK):
                    ctx._respond_unary(response, handler.response_serializer)
                    return
            code = ctx._code or grpc.StatusCode.OK
            ctx._finish(code, ctx._details)
        except _Abort:
            ctx._finish(ctx._code or grpc.StatusCode.UNKNOWN, ctx._details)
        except _http2.ConnectionFailed:
            ctx._on_client_gone()
        except Exception as e:
            if ctx.is_active():
                if ctx._code not in (None, grpc.StatusCode.OK):
                    ctx._finish(ctx._code, ctx._details)
                else:
                    ctx._finish(grpc.StatusCode.UNKNOWN, f"Exception calling application: {e}")
            if not isinstance(e, NotImplementedError):
                traceback.print_exc()

    def _single_request(self, ctx, deserializer):
        s = ctx._stream
        if s.ended and len(s.messages) == 1 and s.failure is None:
            with ctx._conn.lock:                 # the common case: all of it came with the headers
                msgs = [ctx._conn.take_message(s)]
            ok = True
        else:
            msgs, ok = ctx._wait_request(lambda: s.ended or len(s.messages) > 1 or s.failure is not None
                                         or s.reset_code is not None)
        if not msgs or not s.ended:
            ctx._request_failure(ok)
        if len(msgs) != 1:
            ctx._code = grpc.StatusCode.UNIMPLEMENTED
            ctx._details = "No request message for unary call" if not msgs else "Too many requests for unary call"
            raise _Abort()
        return _deserialize(ctx, deserializer, msgs[0])

    def _schedule_deadline(self, ctx):
        def expire():
            # The client learns DEADLINE_EXCEEDED from the status (as from
            # grpcio servers), the handler from is_active() and its callbacks.
            if ctx.is_active():
                ctx._finish(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        self._timers.schedule(ctx._deadline, expire)
