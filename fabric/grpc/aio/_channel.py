"""The aio channel: its connection (opened on first use, again after it
failed), the multi-callables generated stubs take, and connectivity."""
from __future__ import annotations

import asyncio
import ssl
import time

import grpc
import grpc.aio
from grpc.aio import Metadata

from fabric import errors
from fabric.grpc import _keepalive, _tls, _transport, _wire
from fabric.grpc._aio_http2 import AioConnection, FabricTransport, SocketTransport
from fabric.grpc._channel import USER_AGENT, _options_dict
from fabric.grpc._http2_core import ConnectionFailed
from fabric.grpc.aio._call import StreamStreamCall, StreamUnaryCall, UnaryStreamCall, UnaryUnaryCall
from fabric.grpc.aio._interceptors import INTERCEPTOR_KINDS


def fabric_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def open_transport(target: str, timeout, fab, tls=None):
    """(transport, trusted) to target; tls: (ssl context, server name) for TLS
    on a plain TCP target."""
    backend, host, port = _transport.parse_target(target)
    loop = asyncio.get_running_loop()
    if backend is None:
        kwargs = {} if tls is None else {"ssl": tls[0], "server_hostname": tls[1],
                                         "ssl_handshake_timeout": _tls.HANDSHAKE_TIMEOUT}
        try:
            _, protocol = await asyncio.wait_for(loop.create_connection(SocketTransport, host, port, **kwargs),
                                                 timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"connect to {host}:{port} timed out") from None
        except ssl.SSLCertVerificationError as e:
            raise errors.ConnectionLost(f"TLS certificate verification failed: {e.verify_message}") from None
        except (OSError, ssl.SSLError) as e:
            raise errors.ConnectionLost(f"connect to {host}:{port} failed: {e}") from None
        try:
            protocol.check_tls()
        except errors.FabricError:
            protocol.close()
            raise
        return protocol, False
    if tls is not None:
        raise ValueError(f"secure channels are for plain TCP targets (host:port), not {target!r}: "
                         "fabric connections are meant for a trusted cluster network")
    fab = fab or _transport.shared_fabric(backend)
    stream = await fab.aconnect_stream(fabric_address(host, port), timeout=timeout)
    return FabricTransport(stream), True


class _MultiCallable:
    _call_class = None
    _kind = None

    def __init__(self, channel, method, request_serializer, response_deserializer):
        self._channel = channel
        self._method = method
        self._path = method.encode()
        self._serialize = request_serializer
        self._deserialize = response_deserializer

    def __call__(self, request=None, *, timeout=None, metadata=None, credentials=None, wait_for_ready=None,
                 compression=None):
        channel = self._channel
        if channel._closed:
            raise grpc.aio.UsageError("Channel is closed.")
        interceptors = channel._interceptors_of[self._kind]
        if not interceptors:
            return self._invoke(request, self._method, timeout, metadata, wait_for_ready, compression, credentials)
        details = grpc.aio.ClientCallDetails(self._path, timeout, Metadata(*tuple(metadata or ())),
                                             credentials, wait_for_ready)     # bytes, as grpc.aio gives it
        return INTERCEPTOR_KINDS[self._kind][1](
            interceptors, self._kind, request, details,
            lambda d, req: self._invoke(req, d.method, d.timeout, d.metadata, d.wait_for_ready, compression,
                                        d.credentials))

    def _invoke(self, request, method, timeout, metadata, wait_for_ready, compression, credentials=None):
        if isinstance(method, bytes):
            path, method = method, method.decode()
        else:
            path = self._path if method == self._method else method.encode()
        plugins = self._channel._call_plugins
        if credentials is not None:
            plugins = plugins + _tls.call_plugins(credentials)
        call = self._call_class(request, self._channel, method, path, self._serialize, self._deserialize,
                                timeout, metadata, wait_for_ready, compression, plugins)
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
        self._interceptors_of = {kind: [] for kind in INTERCEPTOR_KINDS}
        for interceptor in interceptors or ():
            for kind, (interface, _) in INTERCEPTOR_KINDS.items():
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
        self._header_blocks = {}
        self._conn = None
        self._connecting = None
        self._closed = False
        self._calls = set()
        self._loop = None

    def _loop_now(self):
        loop = self._loop
        if loop is None or loop.is_closed():
            loop = self._loop = asyncio.get_running_loop()
        return loop

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
        transport, fabric_stream = await open_transport(self._target, timeout, self._fabric, self._tls)
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
