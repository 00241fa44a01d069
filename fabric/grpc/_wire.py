"""gRPC's wire rules on top of HTTP/2 (gRPC's PROTOCOL-HTTP2.md): the
length-prefixed message framing, metadata (including -bin keys), grpc-timeout,
grpc-status / grpc-message, and the mapping of HTTP status to gRPC codes."""
from __future__ import annotations

import base64
import struct
import zlib
from urllib.parse import quote, unquote

import grpc


PREFIX = struct.Struct(">BI")          # compressed flag, message length
PREFIX_SIZE = PREFIX.size
DEFAULT_MAX_RECEIVE = 4 * 1024 * 1024  # grpcio's default
CONTENT_TYPE = b"application/grpc"

CODE_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}

# Message compression (gRPC's compression.md): gzip is RFC 1952, deflate the
# zlib format (RFC 1950), both at zlib's default level as grpc core uses.
ENCODINGS = ("identity", "deflate", "gzip")
ACCEPT_ENCODING = b"identity,deflate,gzip"
_WBITS = {"deflate": 15, "gzip": 31}
_BY_COMPRESSION = {grpc.Compression.NoCompression: "identity", grpc.Compression.Deflate: "deflate",
                   grpc.Compression.Gzip: "gzip"}

# Metadata keys an application may not set (HTTP/2 pseudo-headers, gRPC's own).
RESERVED = frozenset([b"content-type", b"te", b"grpc-status", b"grpc-message", b"grpc-timeout",
                      b"grpc-encoding", b"grpc-accept-encoding", b"grpc-status-details-bin",
                      b"user-agent", b"host", b"connection", b"transfer-encoding", b"upgrade"])


try:            # grpcio's own (key, value) pair type, so metadata compares and prints as grpcio's
    from grpc._cython.cygrpc import _Metadatum as Metadatum
except ImportError:                                   # pragma: no cover
    import collections
    Metadatum = collections.namedtuple("_Metadatum", ("key", "value"))


class WireError(Exception):
    """A gRPC protocol violation; carries the status the call ends with."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code
        self.details = details


def prefix(length: int, compressed: bool = False) -> bytes:
    return PREFIX.pack(1 if compressed else 0, length)


def encoding_of(compression) -> str | None:
    """grpc.Compression (or its int value, as channel options carry it) to
    an encoding name; None stays None (not chosen)."""
    if compression is None:
        return None
    if not isinstance(compression, grpc.Compression):
        try:
            compression = grpc.Compression(int(compression))
        except (TypeError, ValueError):
            raise ValueError(f"unknown compression {compression!r} (use grpc.Compression)") from None
    return _BY_COMPRESSION[compression]


def compress(data, encoding: str) -> bytes:
    c = zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, _WBITS[encoding])
    return c.compress(data) + c.flush()


def maybe_compress(payload, encoding: str | None):
    """(payload, compressed): the message compressed with encoding when
    that makes it smaller, else as it is."""
    if encoding is None or encoding == "identity":
        return payload, False
    view = memoryview(payload)
    if not view.nbytes:
        return payload, False
    packed = compress(view.cast("B") if view.ndim != 1 or view.format != "B" else view, encoding)
    if len(packed) < view.nbytes:
        return packed, True
    return payload, False


def decompress(data, encoding: str | None, limit: int) -> bytes:
    """Inflate one message, never past limit bytes (a compression bomb is
    refused after limit + 1 bytes, not inflated)."""
    wbits = _WBITS.get(encoding or "")
    if wbits is None:
        if encoding in (None, "identity"):
            raise WireError(grpc.StatusCode.INTERNAL,
                            "compressed message received without a grpc-encoding")
        raise WireError(grpc.StatusCode.UNIMPLEMENTED, f"compression {encoding!r} is not supported")
    d = zlib.decompressobj(wbits)
    try:
        out = d.decompress(data, limit + 1) if limit >= 0 else d.decompress(data)
    except zlib.error as e:
        raise WireError(grpc.StatusCode.INTERNAL, f"cannot decompress a {encoding} message: {e}") from None
    if limit >= 0 and len(out) > limit:
        raise WireError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"Received message larger than max (over {limit} bytes once decompressed "
                        f"vs. {limit})")
    if not d.eof:
        raise WireError(grpc.StatusCode.INTERNAL, f"truncated {encoding} message")
    return out


# ---------------------------------------------------------------- timeouts

_UNITS = ((b"H", 3600.0), (b"M", 60.0), (b"S", 1.0), (b"m", 1e-3), (b"u", 1e-6), (b"n", 1e-9))


def encode_timeout(seconds: float) -> bytes:
    """The shortest grpc-timeout value (at most 8 digits) not below seconds."""
    seconds = max(seconds, 0.0)
    for unit, scale in reversed(_UNITS):
        value = int(-(-seconds // scale))           # ceiling
        if value < 100_000_000:
            return str(max(value, 1 if seconds > 0 else 0)).encode() + unit
    return b"99999999H"


def decode_timeout(value: bytes) -> float:
    if not 2 <= len(value) <= 9 or not value[:-1].isdigit():
        raise WireError(grpc.StatusCode.INTERNAL, f"malformed grpc-timeout {value!r}")
    unit = value[-1:]
    for u, scale in _UNITS:
        if u == unit:
            return int(value[:-1]) * scale
    raise WireError(grpc.StatusCode.INTERNAL, f"malformed grpc-timeout {value!r}")


# ---------------------------------------------------------------- metadata

def _key_bytes(key) -> bytes:
    return key.encode("ascii") if isinstance(key, str) else bytes(key)


def metadata_to_headers(metadata) -> list:
    """Application metadata as HTTP/2 header pairs (bytes); -bin values are
    base64-encoded. Keys must be lowercase ASCII and not reserved."""
    headers = []
    for key, value in metadata or ():
        k = _key_bytes(key)
        if not k or k.startswith(b":") or k in RESERVED:
            raise ValueError(f"metadata key {key!r} is reserved")
        if not all(c in b"abcdefghijklmnopqrstuvwxyz0123456789-_." for c in k):
            raise ValueError(f"metadata key {key!r} has characters gRPC does not allow")
        if k.endswith(b"-bin"):
            raw = value if isinstance(value, (bytes, bytearray, memoryview)) else str(value).encode()
            v = base64.b64encode(bytes(raw)).rstrip(b"=")
        else:
            if isinstance(value, (bytes, bytearray)):
                v = bytes(value)
            else:
                v = str(value).encode("ascii")
            if any(c < 0x20 or c > 0x7E for c in v):
                raise ValueError(f"metadata value of {key!r} must be printable ASCII (use a -bin key)")
        headers.append((k, v))
    return headers


def headers_to_metadata(headers) -> tuple:
    """HTTP/2 headers to grpc metadata: (key str, value str|bytes) pairs, the
    reserved and pseudo headers left out."""
    out = []
    for k, v in headers:
        k = _key_bytes(k)
        if k.startswith(b":") or k in RESERVED:
            continue
        key = k.decode("ascii", "replace")
        if k.endswith(b"-bin"):
            vb = bytes(v) if not isinstance(v, str) else v.encode()
            out.append(Metadatum(key, base64.b64decode(vb + b"=" * (-len(vb) % 4))))
        else:
            out.append(Metadatum(key, v.decode("ascii", "replace") if isinstance(v, (bytes, bytearray)) else v))
    return tuple(out)


def encode_message_text(details: str | None) -> bytes:
    return quote(details or "", safe=" !\"#$&'()*+,-./0123456789:;<=>?@ABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                   "[\\]^_`abcdefghijklmnopqrstuvwxyz{|}~").encode("ascii")


def decode_message_text(value: bytes) -> str:
    return unquote(value.decode("ascii", "replace"), errors="replace")


def status_from_http(status: int) -> grpc.StatusCode:
    return {400: grpc.StatusCode.INTERNAL, 401: grpc.StatusCode.UNAUTHENTICATED,
            403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.UNIMPLEMENTED,
            429: grpc.StatusCode.UNAVAILABLE, 502: grpc.StatusCode.UNAVAILABLE,
            503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.UNAVAILABLE}.get(status,
                                                                                 grpc.StatusCode.UNKNOWN)


def status_code(code) -> grpc.StatusCode:
    """What a handler set, as a StatusCode: anything else (an int, as gRPC's
    own interop service sets) is UNKNOWN, as grpcio maps it."""
    return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN


def trailers(code: grpc.StatusCode, details: str | None, metadata=()) -> list:
    out = [(b"grpc-status", str(status_code(code).value[0]).encode())]
    if details:
        out.append((b"grpc-message", encode_message_text(details if isinstance(details, str) else str(details))))
    out.extend(metadata_to_headers(metadata))
    return out


def status_of_headers(headers) -> tuple[grpc.StatusCode, str]:
    """The status in a list of header pairs (trailers)."""
    raw = message = None
    for k, v in headers:
        if k == b"grpc-status":
            raw = v
        elif k == b"grpc-message":
            message = v
    if raw == b"0" and message is None:
        return grpc.StatusCode.OK, ""
    return status_of({b"grpc-status": raw, b"grpc-message": message or b""} if raw is not None else {})


def status_of(headers: dict) -> tuple[grpc.StatusCode, str]:
    raw = headers.get(b"grpc-status")
    if raw is None:
        return grpc.StatusCode.UNKNOWN, "missing grpc-status in trailers"
    try:
        code = CODE_BY_NUMBER.get(int(raw), grpc.StatusCode.UNKNOWN)
    except ValueError:
        return grpc.StatusCode.UNKNOWN, f"malformed grpc-status {raw!r}"
    return code, decode_message_text(headers.get(b"grpc-message", b""))


def format_address(addr) -> str:
    """host:port or [v6]:port of a socket address, the form peer() prefixes
    with ipv4: / ipv6: as grpcio does."""
    host, port = addr[0], addr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def peer_string(address: str) -> str:
    """grpcio's context.peer(): ipv4:host:port or ipv6:[host]:port."""
    return f"ipv6:{address}" if address.startswith("[") else f"ipv4:{address}"
