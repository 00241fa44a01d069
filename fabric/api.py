"""fabric.Fabric: chooses a backend, resolves the knobs, owns the progress
context (Worker) that its listeners and endpoints share."""
from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from fabric import auth as _auth, backends, options as _options
from fabric.address import parse as _parse_address, scheme as _address_scheme
from fabric.protocol.engine import Worker

_log = logging.getLogger("fabric")

# UCX transports whose remote reads and writes the NIC or the kernel bounds by
# region and whose peers are on this host or on an RDMA fabric; tcp and ud
# (and "all", or UCX_TLS unset, which include them) also accept UCX peers of
# their own on sockets fabric's authentication never sees.
_UCX_GUARDED = {"rc", "rc_v", "rc_x", "rc_mlx5", "dc", "dc_x", "dc_mlx5", "sm", "shm", "posix", "sysv",
                "xpmem", "cma", "knem", "self", "ib", "cuda", "cuda_copy", "cuda_ipc", "rocm"}
_ucx_warned = False


def _warn_ucx_side_doors() -> None:
    """Once per process: a key guards fabric's connections, not UCX's own."""
    global _ucx_warned
    tls = {t.strip().lstrip("^").split(":")[0] for t in os.environ.get("UCX_TLS", "").split(",") if t.strip()}
    if _ucx_warned or (tls and tls <= _UCX_GUARDED and not os.environ.get("UCX_TLS", "").startswith("^")):
        return
    _ucx_warned = True
    import warnings
    warnings.warn("fabric: auth_key guards fabric's own connections; with UCX_TLS="
                  f"{os.environ.get('UCX_TLS', '(unset)')} UCX also accepts peers of its own on its tcp/ud "
                  "transports, which do not bound remote reads and writes by region. On a network you do not "
                  "trust use the verbs or tcp fabric, or UCX_TLS=rc,sm (docs: guides/security)",
                  RuntimeWarning, stacklevel=3)

if TYPE_CHECKING:
    from typing_extensions import Self

    from fabric.backends.interface import Backend
    from fabric.protocol.engine import Endpoint, Listener
    from fabric.stream import Stream, StreamListener


class Fabric:
    """A transport instance.

    Fabric(backend=None, *, auth_key=None, auth_key_file=None, **options):
    backend from the argument, else $FABRIC_BACKEND, else "auto" (the
    fastest usable here). Options are the engine's knobs (see
    fabric.options), overriding profile and environment. With a key (the
    arguments, $FABRIC_AUTH_KEY or $FABRIC_AUTH_KEY_FILE, see fabric.auth)
    every connection proves both ends hold it before anything else is sent;
    connections that fail raise AuthenticationError. ssl (tcp only): an
    ssl.SSLContext, or a pair (server, client): every connection of the
    listeners (a server context) and connects (a client context) runs TLS.
    """

    def __init__(self, backend: str | None = None, *, auth_key: bytes | str | bool | None = None,
                 auth_key_file: str | os.PathLike[str] | None = None, ssl: Any = None,
                 **options: Any) -> None:
        name = backend or os.environ.get("FABRIC_BACKEND") or "auto"
        key = _auth.key_from(auth_key, auth_key_file)
        self.backend: Backend
        self.backend, self.backend_reason = backends.choose(name)
        if not backend and os.environ.get("FABRIC_BACKEND"):
            self.backend_reason += " by FABRIC_BACKEND"
        sources = _options.resolve_sources(self.backend.name, self.backend.default_options(), options)
        self.options: dict[str, Any] = {k: v for k, (v, _) in sources.items()}
        # thresholds the user did not set adapt to each connection's link
        self.adapting: list[str] = _options.adapting(sources)
        # the key lives in the engine only (never in options, logs or repr)
        self._worker = Worker(self.backend, dict(self.options, _adapt_mask=_options.adapt_mask(self.adapting)),
                              key, ssl)
        del key
        self.authenticated: bool = self._worker.authenticates
        if self.authenticated and self.backend.name == "ucx":
            _warn_ucx_side_doors()
        if _log.isEnabledFor(logging.INFO):
            profile = _options.profile_path()
            _log.info("Fabric on %s (%s)%s", self.backend.name, self.backend_reason,
                      f"; tuning profile {profile}" if profile and os.path.exists(profile) else "")

    @property
    def name(self) -> str:
        return self.backend.name

    def listen(self, address: str = "127.0.0.1:0") -> Listener:
        """A Listener on address ("host:port"; port 0 picks a free one)."""
        host, port = _parse_address(address, self.backend.name)
        return self._worker.listen(host, port)

    def connect(self, address: str, timeout: float | None = None) -> Endpoint:
        """An Endpoint connected to a Listener's address."""
        host, port = _parse_address(address, self.backend.name)
        return self._worker.connect(host, port, timeout)

    def listen_stream(self, address: str = "127.0.0.1:0") -> StreamListener:
        """A StreamListener: accept() returns byte streams (fabric.stream)."""
        from fabric.stream import StreamListener
        return StreamListener(self.listen(address))

    def connect_stream(self, address: str, timeout: float | None = None) -> Stream:
        """A byte stream (fabric.stream.Stream) to a stream listener."""
        from fabric.stream import Stream
        return Stream(self.connect(address, timeout))

    async def aconnect_stream(self, address: str, timeout: float | None = None) -> Stream:
        from fabric.stream import Stream
        return Stream(await self.aconnect(address, timeout))

    async def aconnect(self, address: str, timeout: float | None = None) -> Endpoint:
        """connect() for asyncio: the loop connects and runs the handshake
        itself (no thread per pending connect)."""
        from fabric import aio
        host, port = _parse_address(address, self.backend.name)
        return await aio.connect(self._worker, host, port, timeout)

    def progress(self) -> None:
        """Progress every endpoint once without blocking."""
        self._worker.progress()

    def close(self, linger: float | None = None) -> None:
        """Close every listener and endpoint of this Fabric (endpoints first
        send what is queued, for at most `linger` seconds, default the
        close_linger option; pending operations then fail with
        ConnectionClosed), stop its progress thread and release the
        backend's context and descriptors. Idempotent; afterwards every use
        raises a FabricError."""
        self._worker.close(linger)

    async def aclose(self, linger: float | None = None) -> None:
        """close() for asyncio: the loop keeps running while endpoints drain."""
        from fabric import aio
        await aio.close_fabric(self._worker, linger)

    @property
    def closed(self) -> bool:
        return self._worker.closed

    @property
    def buffered_bytes(self) -> int:
        """Bytes of received messages not yet taken by the application, over
        every endpoint (kept within the total_recv_budget option, plus what
        each peer's credits carry)."""
        return self._worker.buffered_bytes

    @property
    def progress_stats(self) -> dict[str, int]:
        """What the background progress thread did: `background_rounds` of
        progress while the application was away from fabric, and
        `busy_loop_rounds` of them for an asyncio loop that polls this
        Fabric but was running other code when an event came while a large
        send was in flight on a fabric whose pulls this side's CPU serves
        (tcp): the peer's pull or room in a socket is then served within
        about 2.5 ms rather than when the loop next yields."""
        return self._worker.progress_stats

    @property
    def receive_memory(self) -> dict[str, Any]:
        """Counters of the memory large received messages land in (shared by
        every Fabric of the process): free blocks kept (`blocks`, `bytes`,
        within `limit`, FABRIC_RECV_CACHE), blocks `in_use` by messages,
        blocks `reused` rather than faulted in anew, huge-page blocks `mapped`
        and `unmapped`, and whether the kernel refused huge pages or
        populating (`huge_refused`, `populate_failed`)."""
        from fabric.protocol import engine
        return engine.recv_pool_stats()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        state = " closed" if self.closed else ""
        return f"<fabric.Fabric backend={self.backend.name}{state}>"


_defaults: dict[str | None, Fabric] = {}
_default_lock = threading.Lock()


def default_fabric(backend: str | None = None) -> Fabric:
    """The Fabric behind module-level fabric.listen / fabric.connect: one per
    backend name asked for (None: $FABRIC_BACKEND or auto), made on first use."""
    key = (backend or "").strip().lower() or None
    with _default_lock:
        fab = _defaults.get(key)
        if fab is None or fab.closed:
            fab = _defaults[key] = Fabric(key)
        return fab


def _fabric_for(address: str) -> Fabric:
    named = _address_scheme(address)
    return default_fabric(None if named in (None, "auto") else named)


def listen(address: str = "127.0.0.1:0") -> Listener:
    """A Listener of the default Fabric; a scheme ("ucx://127.0.0.1:0",
    "fabric+tcp://...") picks the default Fabric of that backend."""
    return _fabric_for(address).listen(address)


def connect(address: str, timeout: float | None = None) -> Endpoint:
    """An Endpoint from the default Fabric, or from the default Fabric of the
    backend the address's scheme names ("fabric+ucx://host:port")."""
    return _fabric_for(address).connect(address, timeout)


async def aconnect(address: str, timeout: float | None = None) -> Endpoint:
    """connect() for asyncio."""
    return await _fabric_for(address).aconnect(address, timeout)
