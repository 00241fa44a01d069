"""The connection preamble and MAC of fabric/protocol/core/auth.pxi, written
from its specification, for peers that play strangers, replays and dying
clients (tests/test_auth.py, tests/peers.py, bench/security.py)."""
from __future__ import annotations

import hashlib
import hmac
import os
import socket

MAGIC = b"FBAU"
LABEL = b"fabric-auth/1"
CONNECTOR, ACCEPTOR = 0, 1


def preamble(role, has_key, backend, nonce=None):
    """The 48-byte preamble."""
    nonce = os.urandom(32) if nonce is None else nonce
    return MAGIC + bytes([1, role, 1 if has_key else 0, 0]) + backend.encode().ljust(8, b"\0") + nonce


def mac(key, sender, p_connector, p_acceptor):
    return hmac.new(key, LABEL + bytes([sender]) + p_connector + p_acceptor, hashlib.sha256).digest()


def host_port(address):
    host, port = address.rsplit(":", 1)
    return host.strip("[]"), int(port)


def raw_connect(address, timeout=10.0):
    s = socket.create_connection(host_port(address), timeout=timeout)
    s.settimeout(timeout)
    return s


def read_exactly(s, n):
    """n bytes, or fewer if the peer closed (or reset, or fell silent) first."""
    out = b""
    while len(out) < n:
        try:
            got = s.recv(n - len(out))
        except OSError:
            break
        if not got:
            break
        out += got
    return out
