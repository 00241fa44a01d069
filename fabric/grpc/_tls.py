"""TLS for fabric.grpc on plain TCP, the path stock gRPC peers use: channel
and server credentials (grpcio's signatures), the ssl contexts they make
(TLS 1.2+, ALPN h2, client-certificate verification), a blocking TLS byte
stream for the threaded channel and server, and the peer's identity as
grpcio's auth_context() reports it.

The blocking stream drives an ssl.SSLObject over memory BIOs rather than an
ssl.SSLSocket: one TLS connection is read by the reader thread while other
threads write, and OpenSSL does not allow one SSL object to be used by two
threads at once. Here a lock covers only the SSL object (encrypting or
decrypting, never socket I/O), and ciphertext leaves in the order it was
made: whoever holds the send lock writes it, and a reader that produced
some (a TLS 1.3 post-handshake message) never waits for that lock.
"""
from __future__ import annotations

import os
import select
import socket
import ssl
import tempfile
import threading
import time

import grpc

from fabric import errors
from fabric.grpc import _wire

HANDSHAKE_TIMEOUT = 20.0         # seconds a peer gets to finish the TLS handshake
READ_SIZE = 256 * 1024
ALPN = "h2"


def _pem(value, what: str):
    if value is None:
        return None
    if isinstance(value, str):
        value = value.encode("ascii")
    if not isinstance(value, (bytes, bytearray)):
        raise TypeError(f"{what} must be PEM-encoded bytes, not {type(value).__name__}")
    return bytes(value)


def _load_cert_chain(ctx: ssl.SSLContext, certificate_chain: bytes, private_key: bytes) -> None:
    """ssl loads keys only from files: hand it a memory file (Linux), else a
    file in a private temporary directory removed at once."""
    if hasattr(os, "memfd_create"):
        fds = []
        try:
            for data in (certificate_chain, private_key):
                fd = os.memfd_create("fabric-grpc-tls", getattr(os, "MFD_CLOEXEC", 0))
                fds.append(fd)
                os.write(fd, data)
            ctx.load_cert_chain(f"/proc/self/fd/{fds[0]}", f"/proc/self/fd/{fds[1]}")
            return
        except ssl.SSLError as e:
            raise ValueError(f"the certificate chain or private key is not valid PEM: {e}") from None
        except OSError:
            pass                                  # no /proc: fall through to files
        finally:
            for fd in fds:
                os.close(fd)
    with tempfile.TemporaryDirectory(prefix="fabric-grpc-tls-") as d:
        paths = []
        for name, data in (("chain.pem", certificate_chain), ("key.pem", private_key)):
            path = os.path.join(d, name)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            paths.append(path)
        try:
            ctx.load_cert_chain(*paths)
        except ssl.SSLError as e:
            raise ValueError(f"the certificate chain or private key is not valid PEM: {e}") from None


def _load_roots(ctx: ssl.SSLContext, root_certificates: bytes | None) -> None:
    if root_certificates is not None:
        try:
            ctx.load_verify_locations(cadata=root_certificates.decode("ascii"))
        except (ssl.SSLError, UnicodeDecodeError) as e:
            raise ValueError(f"root_certificates are not valid PEM: {e}") from None
        return
    # as grpcio: $GRPC_DEFAULT_SSL_ROOTS_FILE_PATH, else the system's roots
    path = os.environ.get("GRPC_DEFAULT_SSL_ROOTS_FILE_PATH")
    if path:
        ctx.load_verify_locations(cafile=path)
    else:
        ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)


def _base_context(protocol) -> ssl.SSLContext:
    ctx = ssl.SSLContext(protocol)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2       # HTTP/2 requires 1.2 or later (RFC 9113 9.2)
    ctx.set_alpn_protocols([ALPN])
    ctx.options |= ssl.OP_NO_COMPRESSION
    return ctx


class ChannelCredentials(grpc.ChannelCredentials):
    """fabric.grpc.ssl_channel_credentials(): what a secure channel trusts and,
    for mutual TLS, the client's own certificate."""

    def __init__(self, root_certificates=None, private_key=None, certificate_chain=None):
        super().__init__(None)
        self.root_certificates = _pem(root_certificates, "root_certificates")
        self.private_key = _pem(private_key, "private_key")
        self.certificate_chain = _pem(certificate_chain, "certificate_chain")
        if (self.private_key is None) != (self.certificate_chain is None):
            raise ValueError("a client certificate needs both private_key and certificate_chain")
        self._context = None

    def context(self) -> ssl.SSLContext:
        if self._context is None:
            ctx = _base_context(ssl.PROTOCOL_TLS_CLIENT)         # verifies the server and its name
            _load_roots(ctx, self.root_certificates)
            if self.certificate_chain is not None:
                _load_cert_chain(ctx, self.certificate_chain, self.private_key)
            self._context = ctx
        return self._context


class ServerCredentials(grpc.ServerCredentials):
    """fabric.grpc.ssl_server_credentials(): the server's key and certificate
    pairs and, to verify clients, the roots their certificates chain to."""

    def __init__(self, private_key_certificate_chain_pairs, root_certificates=None, require_client_auth=False):
        super().__init__(None)
        pairs = [(_pem(k, "private key"), _pem(c, "certificate chain"))
                 for k, c in (private_key_certificate_chain_pairs or ())]
        if not pairs:
            raise ValueError("At least one private key-certificate chain pair is required!")
        if require_client_auth and root_certificates is None:
            raise ValueError("Illegal to require client auth without providing root certificates!")
        self.pairs = pairs
        self.root_certificates = _pem(root_certificates, "root_certificates")
        self.require_client_auth = bool(require_client_auth)
        self._context = None

    def context(self) -> ssl.SSLContext:
        if self._context is None:
            ctx = _base_context(ssl.PROTOCOL_TLS_SERVER)
            # OpenSSL keeps one certificate per key type (an RSA and an EC pair
            # can both be served); a later pair of the same type replaces one
            for key, chain in self.pairs:
                _load_cert_chain(ctx, chain, key)
            if self.root_certificates is not None:
                _load_roots(ctx, self.root_certificates)
                ctx.verify_mode = ssl.CERT_REQUIRED if self.require_client_auth else ssl.CERT_OPTIONAL
            self._context = ctx
        return self._context


def channel_credentials(credentials) -> ChannelCredentials:
    """Ours, or what grpc.ssl_channel_credentials() made (its PEM inputs are
    readable); anything else is refused with the reason."""
    if isinstance(credentials, ChannelCredentials):
        return credentials
    inner = getattr(credentials, "_credentials", None)
    if isinstance(credentials, grpc.ChannelCredentials) and hasattr(inner, "_pem_root_certificates"):
        if getattr(inner, "_private_key_signer", None) is not None:
            raise ValueError("fabric.grpc cannot use a private key signer; pass the private key itself")
        return ChannelCredentials(inner._pem_root_certificates, inner._private_key, inner._certificate_chain)
    raise TypeError(f"fabric.grpc secure channels take SSL channel credentials "
                    f"(grpc.ssl_channel_credentials or fabric.grpc.ssl_channel_credentials), not {credentials!r}")


def server_credentials(credentials) -> ServerCredentials:
    if isinstance(credentials, ServerCredentials):
        return credentials
    raise TypeError("fabric.grpc servers take fabric.grpc.ssl_server_credentials(...) (grpcio's signature): "
                    "grpcio's own server credentials do not reveal their keys to Python")


def target_name(options: dict, host: str) -> str:
    """The name the server's certificate must carry."""
    return str(options.get("grpc.ssl_target_name_override") or host)


def channel_security(credentials, options: dict, backend, target: str, host: str, port: int):
    """For a channel: (TLS as (ssl context, server name) or None, the call
    credentials' plugins composed into credentials, the default authority)."""
    if credentials is None:
        return None, (), _wire.format_address((host, port))
    if backend is not None:
        raise ValueError(f"secure channels are for plain TCP targets (host:port), not {target!r}: "
                         "fabric connections are meant for a trusted cluster network")
    name = target_name(options, host)
    tls, plugins = split_channel_credentials(credentials)
    if "grpc.ssl_target_name_override" in options:
        host = name                        # as grpcio: the override is the authority too
    return (tls.context(), name), plugins, _wire.format_address((host, port))


def auth_context(tls) -> dict:
    """grpcio's auth_context() keys for a TLS connection (an ssl.SSLObject or
    SSLSocket); the peer's certificate ones only if it sent one we verified."""
    ctx = {"transport_security_type": [b"ssl"],
           "security_level": [b"TSI_PRIVACY_AND_INTEGRITY"],
           "ssl_session_reused": [b"true" if tls.session_reused else b"false"]}
    try:
        cert = tls.getpeercert()
        der = tls.getpeercert(binary_form=True)
    except (ValueError, ssl.SSLError):
        cert, der = None, None
    if not cert:
        return ctx
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                ctx.setdefault("x509_common_name", []).append(value.encode())
    sans = [value.encode() for kind, value in cert.get("subjectAltName", ()) if kind in ("DNS", "IP Address", "URI", "email")]
    if sans:
        ctx["x509_subject_alternative_name"] = sans
    dns = [value.encode() for kind, value in cert.get("subjectAltName", ()) if kind == "DNS"]
    if dns:
        ctx["peer_dns"] = dns
    if der:
        ctx["x509_pem_cert"] = [ssl.DER_cert_to_PEM_cert(der).encode()]
    return ctx


def peer_identity_key(ctx: dict):
    if "x509_subject_alternative_name" in ctx:
        return "x509_subject_alternative_name"
    if "x509_common_name" in ctx:
        return "x509_common_name"
    return None


def check_alpn(tls) -> None:
    chosen = tls.selected_alpn_protocol()
    if chosen not in (None, ALPN):         # None: a peer without ALPN; gRPC peers all offer h2
        raise errors.ConnectionLost(f"TLS peer chose application protocol {chosen!r}, not {ALPN!r}")


class TlsSocketStream:
    """A TLS connection over a blocking TCP socket with the byte-stream calls
    of fabric.grpc._transport.SocketStream (read_message, read_into, write,
    close). Writes come from one thread at a time (the HTTP/2 driver's send
    lock), reads from one reader at a time; the two may overlap."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, server_side: bool,
                 server_hostname: str | None = None, timeout: float | None = HANDSHAKE_TIMEOUT):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        self.sock = sock
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._tls_lock = threading.Lock()          # the SSL object, one thread at a time
        self._send_lock = threading.Lock()         # ciphertext to the socket, in order
        self._closed = False
        try:
            self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=server_side,
                                         server_hostname=None if server_side else server_hostname)
        except (ValueError, ssl.SSLError) as e:
            raise errors.ConnectionLost(f"TLS set-up failed: {e}") from None
        try:
            peer = sock.getpeername()
            local = sock.getsockname()
            self.peer_address = _wire.format_address(peer)
            self.local_address = _wire.format_address(local)
        except OSError:
            self.local_address = self.peer_address = "?"
        self._handshake(timeout)

    # -- handshake
    def _handshake(self, timeout):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._send_out()
                raw = self._recv_by(deadline, "TLS handshake timed out")
                if not raw:
                    raise errors.ConnectionLost("the peer closed the connection during the TLS handshake")
                self._incoming.write(raw)
            except ssl.SSLCertVerificationError as e:
                self._send_out(best_effort=True)
                raise errors.ConnectionLost(f"TLS certificate verification failed: {e.verify_message}") from None
            except ssl.SSLError as e:
                self._send_out(best_effort=True)
                raise errors.ConnectionLost(f"TLS handshake failed: {e}") from None
        self._send_out()
        check_alpn(self._tls)

    def auth_context(self) -> dict:
        return auth_context(self._tls)

    # -- raw socket
    def _recv_raw(self, timeout):
        """Ciphertext from the socket: bytes, b"" at end of stream, None on timeout."""
        try:
            if timeout is not None and not self._poll.poll(max(0, int(timeout * 1000))):
                return None
            return self.sock.recv(READ_SIZE)
        except OSError as e:
            raise errors.ConnectionLost(f"socket read failed: {e}") from None

    def _recv_by(self, deadline, why: str) -> bytes:
        """Ciphertext arriving before deadline (None: wait), b"" at end of
        stream; Timeout(why) if none came in time."""
        remaining = None if deadline is None else deadline - time.monotonic()
        raw = None if remaining is not None and remaining <= 0 else self._recv_raw(remaining)
        if raw is None:
            raise errors.Timeout(why)
        return raw

    def _send_out(self, best_effort=False):
        """Write what the SSL object produced. Blocking callers (writers, the
        handshake) take the send lock; a reader only tries it, and whoever
        holds it sends what was made meanwhile before letting go."""
        blocking = not best_effort
        while True:
            if not self._send_lock.acquire(blocking):
                return
            try:
                while True:
                    with self._tls_lock:
                        data = self._outgoing.read()
                    if not data:
                        break
                    try:
                        if best_effort:
                            self.sock.send(data, socket.MSG_DONTWAIT)
                        else:
                            self.sock.sendall(data)
                    except OSError as e:
                        if best_effort:
                            return
                        raise errors.ConnectionLost(f"socket write failed: {e}") from None
            finally:
                self._send_lock.release()
            if not self._outgoing.pending:
                return
            blocking = False          # made while we let go: whoever holds the lock now sends it

    # -- the byte-stream calls
    def _read_plain(self, size, buf, timeout):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            produced = False
            with self._tls_lock:
                try:
                    got = self._tls.read(size, buf) if buf is not None else self._tls.read(size)
                except ssl.SSLWantReadError:
                    got = None
                except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                    got = 0 if buf is not None else b""
                except ssl.SSLError as e:
                    raise errors.ConnectionLost(f"TLS read failed: {e}") from None
                produced = self._outgoing.pending > 0
            if produced:
                self._send_out(best_effort=True)
            if got is not None:
                return got
            raw = self._recv_by(deadline, "nothing to read yet")
            with self._tls_lock:
                if raw:
                    self._incoming.write(raw)
                else:
                    self._incoming.write_eof()

    def read_message(self, timeout=None):
        """Some bytes, or None at end of stream; Timeout if nothing arrived in time."""
        data = self._read_plain(READ_SIZE, None, timeout)
        return data or None

    def read_into(self, buf) -> int:
        view = memoryview(buf).cast("B")
        return self._read_plain(view.nbytes, view, None) if view.nbytes else 0

    def write(self, buffers) -> None:
        items = buffers if isinstance(buffers, (list, tuple)) else [buffers]
        with self._tls_lock:
            try:
                for b in items:
                    view = memoryview(b).cast("B")
                    if view.nbytes:
                        self._tls.write(view)
            except ssl.SSLError as e:
                raise errors.ConnectionLost(f"TLS write failed: {e}") from None
        self._send_out()

    def shutdown_write(self) -> None:
        """close_notify and FIN: we send nothing more; reading goes on."""
        with self._tls_lock:
            try:
                self._tls.unwrap()
            except (ssl.SSLError, ValueError):
                pass
        self._send_out()
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError as e:
            raise errors.ConnectionLost(f"socket shutdown failed: {e}") from None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._tls_lock:
            try:
                self._tls.unwrap()                 # close_notify; the peer's reply is not awaited
            except (ssl.SSLError, ValueError):
                pass
        self._send_out(best_effort=True)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


# ------------------------------------------------------------------ call credentials

PLUGIN_TIMEOUT = 30.0            # seconds a metadata plugin gets to answer


class CallCredentialsError(Exception):
    """A call's credentials gave no metadata: the call ends with code, details."""

    def __init__(self, code, details):
        super().__init__(details)
        self.code, self.details = code, details


def call_plugins(credentials) -> tuple:
    """The metadata plugins of grpc.CallCredentials (metadata_call_credentials,
    access_token_call_credentials, composite_call_credentials), in order; grpc
    wraps each user plugin in an object it calls as plugin(service_url,
    method_name, callback)."""
    if credentials is None:
        return ()
    inner = getattr(credentials, "_credentials", credentials)
    if hasattr(inner, "_metadata_plugin"):
        return (inner._metadata_plugin,)
    if hasattr(inner, "_call_credentialses"):
        return tuple(p for c in inner._call_credentialses for p in call_plugins(c))
    raise TypeError(f"call credentials must come from grpc.metadata_call_credentials, "
                    f"grpc.access_token_call_credentials or grpc.composite_call_credentials, not {credentials!r}")


def split_channel_credentials(credentials):
    """(TLS credentials, plugins of the call credentials composed into them
    by grpc.composite_channel_credentials)."""
    inner = getattr(credentials, "_credentials", None)
    if inner is not None and hasattr(inner, "_channel_credentials") and hasattr(inner, "_call_credentialses"):
        tls = grpc.ChannelCredentials(inner._channel_credentials)
        return channel_credentials(tls), tuple(p for c in inner._call_credentialses for p in call_plugins(c))
    return channel_credentials(credentials), ()


def service_url(authority: bytes, method: str) -> str:
    """What grpc hands a plugin: https://authority/package.Service (no :443)."""
    host = authority.decode("ascii", "replace")
    if host.endswith(":443"):
        host = host[:-4]
    service = method.rsplit("/", 1)[0] if method.count("/") >= 2 else method
    return f"https://{host}{service}"


def plugin_metadata(plugins, url: str, method: str, timeout: float | None = None) -> list:
    """(key, value) pairs from each plugin, in order (blocking: a plugin may
    answer from another thread, as google-auth's do after a token refresh).
    Raises CallCredentialsError as grpcio reports a plugin's failure."""
    out = []
    name = method.rsplit("/", 1)[-1]
    for plugin in plugins:
        done = threading.Event()
        result = {}

        def callback(metadata, status, details, result=result, done=done):
            result.update(metadata=metadata, status=status, details=details)
            done.set()
        try:
            plugin(url, name, callback)
        except Exception as e:                # noqa: BLE001 - reported as the call's status
            raise CallCredentialsError(grpc.StatusCode.UNAVAILABLE,
                                       f"Getting metadata from plugin failed with error: {e}") from None
        if not done.wait(PLUGIN_TIMEOUT if timeout is None else max(timeout, 0.001)):
            raise CallCredentialsError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        status = result.get("status")
        if status is not None and int(status) != 0:
            details = result.get("details")
            if isinstance(details, bytes):
                details = details.decode("utf-8", "replace")
            raise CallCredentialsError(grpc.StatusCode.UNAVAILABLE,
                                       f"Getting metadata from plugin failed with error: {details}")
        out.extend(tuple(m) for m in (result.get("metadata") or ()))
    return out
