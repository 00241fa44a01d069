"""Byte streams under fabric.grpc: the fabric engine's stream for
fabric+<backend>:// addresses, a plain TCP socket for host:port (what a stock
gRPC peer speaks). Both offer read_message / read_into / write / close as
used by fabric.grpc._http2."""
from __future__ import annotations

import select
import socket
import threading
import time

import fabric
from fabric import errors
from fabric.grpc import _tls, _wire

SCHEMES = ("fabric", "fabric+auto", "fabric+tcp", "fabric+ucx", "fabric+verbs", "fabric+softroce")
READ_SIZE = 256 * 1024


def parse_target(target: str) -> tuple[str | None, str, int]:
    """(backend or None for plain TCP, host, port). Accepted: host:port,
    [v6]:port, dns:host:port, ipv4:host:port, ipv6:[v6]:port, and
    fabric[+backend]://host:port."""
    backend = None
    rest = target
    if "://" in target:
        scheme, rest = target.split("://", 1)
        if scheme not in SCHEMES:
            raise ValueError(f"unsupported target scheme {scheme!r} in {target!r} "
                             f"(use host:port or one of {', '.join(s + '://' for s in SCHEMES)})")
        backend = scheme.partition("+")[2] or "auto"
        if backend == "auto":
            backend = ""                       # FABRIC_BACKEND or auto
        rest = rest.rstrip("/")
    else:
        for p in ("dns:///", "dns:", "ipv4:", "ipv6:"):
            if rest.startswith(p):
                rest = rest[len(p):]
                break
    if rest.startswith("["):
        host, _, port = rest[1:].partition("]")
        port = port.lstrip(":")
    else:
        host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"target {target!r} has no host:port")
    return backend, host, int(port)


class SocketStream:
    """A TCP socket with the byte-stream calls fabric.grpc uses."""

    def __init__(self, sock: socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._poll = select.poll()          # timed reads: the waiting caller reads for itself
        self._poll.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
        self._closed = False
        try:
            self.local_address = _wire.format_address(sock.getsockname())
            self.peer_address = _wire.format_address(sock.getpeername())
        except OSError:
            self.local_address = self.peer_address = "?"

    def read_message(self, timeout=None):
        """Some bytes, or None at end of stream; ConnectionLost on error;
        Timeout if nothing arrived within timeout seconds (None: wait)."""
        try:
            ready = timeout is None or self._poll.poll(max(0, int(timeout * 1000)))
            data = self.sock.recv(READ_SIZE) if ready else None
        except OSError as e:
            raise errors.ConnectionLost(f"socket read failed: {e}") from None
        if not ready:
            raise errors.Timeout("nothing to read yet")      # (a TimeoutError: raised outside)
        return data or None

    def read_into(self, buf) -> int:
        """Bytes received straight into buf (>= 1), or 0 at end of stream."""
        try:
            return self.sock.recv_into(buf)
        except OSError as e:
            raise errors.ConnectionLost(f"socket read failed: {e}") from None

    def write(self, buffers) -> None:
        if type(buffers) is bytes:
            try:
                self.sock.sendall(buffers)
            except OSError as e:
                raise errors.ConnectionLost(f"socket write failed: {e}") from None
            return
        views = [memoryview(b).cast("B") for b in (buffers if isinstance(buffers, (list, tuple)) else [buffers])]
        views = [v for v in views if v.nbytes]
        try:
            while views:
                sent = self.sock.sendmsg(views[:512])
                while sent:
                    if sent >= views[0].nbytes:
                        sent -= views[0].nbytes
                        views.pop(0)
                    else:
                        views[0] = views[0][sent:]
                        sent = 0
        except OSError as e:
            raise errors.ConnectionLost(f"socket write failed: {e}") from None

    def shutdown_write(self) -> None:
        """FIN: we send nothing more; reading goes on until the peer closes."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError as e:
            raise errors.ConnectionLost(f"socket shutdown failed: {e}") from None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()


class FabricStreamAdapter:
    """A fabric.stream.Stream as fabric.grpc sees it: whole writes, whole
    reads, on its endpoint directly (the connection already keeps to one
    reader and one writer at a time, so the stream's own gates and pending
    bytes are not needed; a read_into that a message does not fit keeps the
    rest here)."""

    def __init__(self, stream):
        self.stream = stream
        self.endpoint = stream.endpoint
        self.local_address = stream.local_address
        self.peer_address = stream.peer_address
        self._rest = None              # a message read_into could not hold whole

    def read_message(self, timeout=None):
        """The peer's next write as a buffer, None at its end; Timeout."""
        if self._rest is not None:
            rest, self._rest = self._rest, None
            return rest
        try:
            msg = self.endpoint.recv(timeout=timeout)
        except errors.ConnectionClosed:
            return None
        return msg if len(msg) else None          # an empty message is the writer's end

    def read_into(self, buf) -> int:
        """Bytes read into buf; the fabric pulls a write that fits straight in."""
        if self._rest is not None:
            n = min(len(buf), len(self._rest))
            buf[:n] = self._rest[:n]
            self._rest = self._rest[n:] if n < len(self._rest) else None
            return n
        try:
            return self.endpoint.recv_into(buf)
        except errors.MessageTooLarge:
            msg = memoryview(self.endpoint.recv()).cast("B")
            n = len(buf)
            buf[:n] = msg[:n]
            self._rest = msg[n:]
            return n
        except errors.ConnectionClosed:
            return 0

    def write(self, buffers) -> None:
        self.endpoint.send(buffers)

    def write_nowait(self, buffer):
        """Hand an immutable buffer to the fabric without waiting for the peer
        to take it; returns a request (wait() raises if the write failed).
        Writes stay in call order with write()."""
        return self.endpoint.isend(buffer)

    def close(self) -> None:
        try:
            self.stream.close()
        except errors.FabricError:
            pass


_fabrics: dict = {}
_fabrics_lock = threading.Lock()


def shared_fabric(backend: str) -> fabric.Fabric:
    """One Fabric per backend name per process (each owns a progress context)."""
    with _fabrics_lock:
        fab = _fabrics.get(backend)
        if fab is None:
            fab = _fabrics[backend] = fabric.Fabric(backend or None)
        return fab


def open_stream(target: str, timeout: float | None, fab: fabric.Fabric | None = None, tls=None):
    """A connected byte stream to target; tls: (ssl context, server name) for
    a TLS connection (plain TCP targets only)."""
    backend, host, port = parse_target(target)
    if backend is None:
        start = time.monotonic()
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            raise errors.ConnectionLost(f"connect to {host}:{port} failed: {e}") from None
        sock.settimeout(None)
        if tls is None:
            return SocketStream(sock)
        context, name = tls
        left = _tls.HANDSHAKE_TIMEOUT if timeout is None else max(timeout - (time.monotonic() - start), 0.001)
        try:
            return _tls.TlsSocketStream(sock, context, server_side=False, server_hostname=name, timeout=left)
        except BaseException:
            sock.close()
            raise
    if tls is not None:
        raise ValueError(f"TLS is for plain TCP targets (host:port), not {target!r}: fabric connections "
                         "are meant for a trusted cluster network")
    fab = fab or shared_fabric(backend)
    addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return FabricStreamAdapter(fab.connect_stream(addr, timeout=timeout))


class SocketListener:
    """A TCP listener; with a TLS context, accept_socket() gives the raw
    connection and handshake() makes it a TLS stream (in the caller's
    thread, so one slow handshake does not hold up the others)."""

    def __init__(self, host: str, port: int, tls_context=None):
        self.tls_context = tls_context
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and host in ("::", ""):
            self.sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        self.sock.bind((host, port))
        self.sock.listen(1024)
        self.port = self.sock.getsockname()[1]

    def accept_socket(self):
        conn, _ = self.sock.accept()
        return conn

    def accept(self):
        return SocketStream(self.accept_socket())

    def handshake(self, conn):
        try:
            return _tls.TlsSocketStream(conn, self.tls_context, server_side=True)
        except BaseException:
            conn.close()
            raise

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class FabricListener:
    def __init__(self, backend: str, host: str, port: int, fab=None):
        self.fab = fab or shared_fabric(backend)
        addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.listener = self.fab.listen_stream(addr)
        self.port = int(self.listener.address.rsplit(":", 1)[1])

    def accept(self):
        return FabricStreamAdapter(self.listener.accept())

    def close(self):
        self.listener.close()


def open_listener(address: str, fab=None, tls_context=None):
    backend, host, port = parse_target(address)
    if backend is None:
        return SocketListener(host, port, tls_context)
    if tls_context is not None:
        raise ValueError(f"TLS is for plain TCP addresses (host:port), not {address!r}: fabric connections "
                         "are meant for a trusted cluster network")
    return FabricListener(backend, host, port, fab)
