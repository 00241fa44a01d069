"""The aio server: ports (plain TCP and fabric), connections, and calls
run as tasks of the loop (sync handlers on the migration pool, as grpc.aio)."""
from __future__ import annotations

import asyncio
import collections
import inspect
import socket

import grpc
import grpc.aio

from fabric import errors
from fabric.grpc import _keepalive, _tls, _transport, _wire
from fabric.grpc._aio_http2 import AioConnection, FabricTransport, SocketTransport
from fabric.grpc._channel import _options_dict
from fabric.grpc._http2_core import ConnectionFailed
from fabric.grpc._server import HandlerRegistry, _LazyDetails
from fabric.grpc.aio._channel import fabric_address
from fabric.grpc.aio._context import RequestIterator, ServicerContext


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
            listener = fab.listen_stream(fabric_address(host, port))
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
            tls = {} if tls_context is None else {"ssl": tls_context,
                                                  "ssl_handshake_timeout": _tls.HANDSHAKE_TIMEOUT}
            self._serving.append(await loop.create_server(lambda: SocketTransport(on_made=self._on_socket),
                                                          sock=obj, **tls))
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

    def _on_socket(self, protocol):
        try:
            protocol.check_tls()
        except errors.FabricError:           # e.g. TLS without ALPN h2: that client only
            protocol.close()
            return
        self._attach(protocol, trusted=False)

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
    async def _lookup(self, method, ctx):
        """The handler of method through the interceptors (the first given is
        the outermost, as grpc.aio chains them)."""
        if not self._interceptors:
            handler = self._registered.get(method)
            return handler if handler is not None else self._find_handler(_LazyDetails(method, ctx))
        details = _LazyDetails(method, ctx)

        async def at(index, d):
            if index == len(self._interceptors):
                return self._find_handler(d)

            async def continuation(next_details):
                return await at(index + 1, next_details)
            return await self._interceptors[index].intercept_service(continuation, d)
        return await at(0, details)

    def _on_request(self, conn, stream):
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
        failure = stream.failure
        if isinstance(failure, _wire.WireError):
            ctx._finish(failure.code, failure.details)
            return
        if method != b"POST" or ct is None or not ct.startswith(_wire.CONTENT_TYPE):
            ctx._finish(grpc.StatusCode.INTERNAL, f"not a gRPC request (content-type {ct!r})")
            return
        if timeout is not None:
            try:
                ctx._deadline = conn.loop.time() + _wire.decode_timeout(timeout)
            except _wire.WireError as e:
                ctx._finish(e.code, e.details)
                return
        if enc != b"identity":
            encoding = enc.decode("ascii", "replace")
            if encoding not in _wire.ENCODINGS:
                ctx._finish(grpc.StatusCode.UNIMPLEMENTED, f"Compression algorithm {encoding!r} is not supported "
                                                           f"(accepted: {_wire.ACCEPT_ENCODING.decode()})")
                return
        if self._max_concurrent is not None and len(self._calls) >= self._max_concurrent:
            ctx._finish(grpc.StatusCode.RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded!")
            return
        stream.on_event = lambda s, c=ctx: (c._on_client_gone() if s.reset_code is not None or (
            s.failure is not None and not isinstance(s.failure, _wire.WireError)) else None)
        self._calls.add(ctx)
        ctx._task = conn.loop.create_task(self._serve(ctx, name))
        ctx._task.add_done_callback(lambda t, c=ctx: self._calls.discard(c))

    async def _serve(self, ctx, method):
        try:
            handler = await self._lookup(method, ctx)
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
                request = RequestIterator(ctx)
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
                    await ctx._respond_unary(response, handler.response_serializer)
                    return
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
        ok = True
        if not (s.ended and len(s.messages) == 1):
            ok = await ctx._conn.await_(ctx._waiter, lambda: s.ended or len(s.messages) > 1 or
                                        s.failure is not None or s.reset_code is not None, ctx._deadline)
        msgs = [ctx._conn.take_message(s) for _ in range(len(s.messages))]
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
            return d(msgs[0]) if d else msgs[0]
        except Exception as e:                        # noqa: BLE001 - reported as the call's status
            ctx._code, ctx._details = grpc.StatusCode.INTERNAL, f"Exception deserializing request! {e!r}"
            raise grpc.aio.AbortError() from None
