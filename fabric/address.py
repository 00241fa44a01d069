"""Addresses: "host:port", "[ipv6]:port", optionally prefixed with a scheme
naming the backend: "tcp://", "ucx://", "verbs://", "softroce://", or the
same with "fabric+" in front ("fabric+ucx://host:port", as fabric.grpc
targets spell them); "fabric://" names no backend."""
from __future__ import annotations

from fabric.errors import AddressError

_BACKEND_NAMES = ("auto", "tcp", "ucx", "verbs", "softroce")


def scheme(address: str) -> str | None:
    """The backend an address names ("ucx" for "fabric+ucx://h:p"), "auto"
    for "fabric://", None without a scheme."""
    if not isinstance(address, str) or "://" not in address:
        return None
    name = address.strip().split("://", 1)[0].lower()
    if name == "fabric":
        return "auto"
    if name.startswith("fabric+"):
        name = name[len("fabric+"):]
    if name not in _BACKEND_NAMES:
        raise AddressError(f"address {address!r}: unknown scheme {name!r}; use host:port, or prefix it "
                           f"with one of {', '.join(n + '://' for n in _BACKEND_NAMES[1:])} "
                           "(optionally as fabric+<backend>://)")
    return name


def parse(address: str, backend: str | None = None) -> tuple[str, int]:
    """Split an address into (host, port); a scheme must name `backend`."""
    if not isinstance(address, str):
        raise TypeError(f"address must be a str like 'host:port', not {type(address).__name__}")
    named = scheme(address)
    text = address.strip()
    if named is not None:
        text = text.split("://", 1)[1]
        same = named in ("auto", backend) or (named == "softroce" and backend == "verbs")
        if backend is not None and not same:
            raise AddressError(f"address {address!r} names backend {named!r}, but this Fabric uses "
                               f"{backend!r}: connect with a Fabric({named!r}), or with the module-level "
                               "fabric.connect(), which picks the Fabric the scheme names")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise AddressError(f"bad address {address!r}: expected '[ipv6]:port'")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise AddressError(f"bad address {address!r}: expected 'host:port'")
        if ":" in host:
            raise AddressError(f"bad address {address!r}: put IPv6 hosts in brackets, '[::1]:port'")
    try:
        port = int(port_text)
    except ValueError:
        raise AddressError(f"bad port in address {address!r}") from None
    if not 0 <= port <= 65535:
        raise AddressError(f"port out of range in address {address!r}")
    return host, port
