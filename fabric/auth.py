"""Where a Fabric's authentication key comes from.

A Fabric with a key authenticates every connection, both ways, before the
backend builds anything on it (see fabric/protocol/core/auth.pxi for the
handshake and docs/guides/security.rst for what it protects). In order:

1. ``Fabric(auth_key=...)``: bytes, or a str (its UTF-8 bytes);
   ``auth_key=False`` turns authentication off whatever the environment says.
2. ``Fabric(auth_key_file=path)``.
3. ``$FABRIC_AUTH_KEY``: the key itself (the environment is visible to the
   same user through /proc; prefer a key file on shared machines).
4. ``$FABRIC_AUTH_KEY_FILE``: a path.

A key holds at least 16 bytes (``python -c "import secrets;
print(secrets.token_hex(32))"`` makes a good one). A key file must be a
regular file (not a symbolic link) owned by this user and readable by nobody
else (mode 0600 or stricter); a trailing newline is not part of the key.
"""
from __future__ import annotations

import os
import stat

from fabric.errors import FabricError

MIN_KEY_BYTES = 16
MAX_KEY_BYTES = 4096


def key_from(auth_key: bytes | str | bool | None = None, auth_key_file: str | os.PathLike[str] | None = None,
             environ: dict[str, str] | None = None) -> bytes | None:
    """The key a Fabric uses (None: no authentication); ValueError or
    FabricError with the reason if the key or its file is unfit."""
    env = os.environ if environ is None else environ
    if auth_key is False:
        return None
    if auth_key is not None and auth_key is not True:
        return _checked(_as_bytes(auth_key), "auth_key")
    if auth_key is True and auth_key_file is None and not env.get("FABRIC_AUTH_KEY") \
            and not env.get("FABRIC_AUTH_KEY_FILE"):
        raise ValueError("auth_key=True, but no key is given (auth_key_file, FABRIC_AUTH_KEY "
                         "or FABRIC_AUTH_KEY_FILE)")
    if auth_key_file is not None:
        return read_key_file(auth_key_file)
    if env.get("FABRIC_AUTH_KEY"):
        return _checked(env["FABRIC_AUTH_KEY"].encode(), "FABRIC_AUTH_KEY")
    if env.get("FABRIC_AUTH_KEY_FILE"):
        return read_key_file(env["FABRIC_AUTH_KEY_FILE"])
    return None


def read_key_file(path: str | os.PathLike[str]) -> bytes:
    """The key in a file that only this user can read."""
    name = os.fspath(path)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as e:
        if os.path.islink(name):
            raise FabricError(f"auth key file {name} is a symbolic link; name the file itself") from None
        raise FabricError(f"cannot open the auth key file {name}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FabricError(f"auth key file {name} is not a regular file")
        if st.st_uid != os.geteuid():
            raise FabricError(f"auth key file {name} belongs to uid {st.st_uid}, not to this user "
                              f"({os.geteuid()})")
        if st.st_mode & 0o077:
            raise FabricError(f"auth key file {name} can be read or written by others (mode "
                              f"{stat.S_IMODE(st.st_mode):04o}); chmod 600 {name}")
        data = os.read(fd, MAX_KEY_BYTES + 2)
    finally:
        os.close(fd)
    if data.endswith(b"\r\n"):
        data = data[:-2]
    elif data.endswith(b"\n"):
        data = data[:-1]
    return _checked(data, f"auth key file {name}")


def _as_bytes(key: bytes | str) -> bytes:
    if isinstance(key, str):
        return key.encode()
    try:
        return bytes(memoryview(key))
    except TypeError:
        raise TypeError(f"auth_key must be bytes or str, not {type(key).__name__}") from None


def _checked(key: bytes, where: str) -> bytes:
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"{where}: an authentication key needs at least {MIN_KEY_BYTES} bytes "
                         f"(got {len(key)}); make one with secrets.token_hex(32)")
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"{where}: an authentication key holds at most {MAX_KEY_BYTES} bytes")
    return key
