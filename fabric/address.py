"""Addresses: "host:port", "[ipv6]:port", optionally prefixed "backend://"."""
from __future__ import annotations


def parse(address: str, backend: str | None = None) -> tuple[str, int]:
    """Split an address into (host, port); a scheme must name `backend`."""
    if not isinstance(address, str):
        raise TypeError(f"address must be a str like 'host:port', not {type(address).__name__}")
    text = address.strip()
    if "://" in text:
        scheme, text = text.split("://", 1)
        scheme = scheme.lower()
        if backend is not None and scheme not in (backend, "fabric", f"fabric+{backend}"):
            raise ValueError(f"address {address!r} names backend {scheme!r}, but this Fabric uses {backend!r}")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"bad address {address!r}: expected '[ipv6]:port'")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ValueError(f"bad address {address!r}: expected 'host:port'")
        if ":" in host:
            raise ValueError(f"bad address {address!r}: put IPv6 hosts in brackets, '[::1]:port'")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"bad port in address {address!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"port out of range in address {address!r}")
    return host, port
