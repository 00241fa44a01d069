"""Backend registry. Each backend is its own extension module, imported only
when probed, so a missing UCX or libibverbs never breaks `import fabric`.

`available()` says, for every known backend, whether it can be used here and
why not; `get(name)` returns a Backend or raises BackendUnavailable with that
list.
"""
from __future__ import annotations

import importlib
import os

from fabric.errors import BackendUnavailable

# name -> (module, class); auto_order() says which "auto" tries first.
KNOWN = {
    "ucx": ("fabric.backends.ucx", "UcxBackend"),
    "verbs": ("fabric.backends.verbs", "VerbsBackend"),
    "tcp": ("fabric.backends.tcp", "TcpBackend"),
}
ALIASES = {"softroce": "verbs"}
NAMES = ("auto", "tcp", "ucx", "verbs", "softroce")


def auto_order():
    """Fastest first, as measured (bench/RESULTS.md): verbs on real RDMA ports;
    then ucx: between processes of one host it negotiates UCX's shared-memory
    transports (sysv/posix and cma, 6-7 GB/s at 1 MiB against the tcp
    backend's 3.7-3.9), with peers elsewhere it runs over whatever UCX finds
    (RDMA, else its TCP lanes: about 0.8x the tcp backend's bandwidth between
    two network namespaces); else fabric's own tcp. FABRIC_BACKEND=tcp is the
    better choice for hosts that talk only to other hosts over Ethernet."""
    return _auto_plan()[0]


def _auto_plan():
    """(auto_order(), {known backend that auto does not try: why})."""
    return ("verbs", "ucx", "tcp"), {}


def short_reason(reason: str) -> str:
    """The first clause of a reason, for one-line summaries."""
    return reason.split(" (", 1)[0].split("; ", 1)[0].strip()


def explain_auto() -> tuple:
    """(the backend 'auto' picks or None, [(name, status, reason), ...]):
    every known backend, in the order auto considers them, with status
    "picked", "unusable" (its probe's reason), "unneeded" (an earlier one
    was picked) or "skipped" (auto never tries it here, and the rule why)."""
    order, skipped = _auto_plan()
    steps, picked = [], None
    for name in order:
        if picked is not None:
            steps.append((name, "unneeded", f"{picked} comes first"))
            continue
        backend, reason = probe(name)
        if backend is not None:
            picked = name
            steps.append((name, "picked", reason))
        else:
            steps.append((name, "unusable", reason))
    steps.extend((name, "skipped", why) for name, why in skipped.items())
    return picked, steps


def auto_reasons() -> list:
    """Why auto passed over the backends it did not pick, one short clause
    each: ['verbs unusable: no RDMA device...']."""
    return [f"{name} {status}: {short_reason(why)}" for name, status, why in explain_auto()[1]
            if status in ("unusable", "skipped")]


def auto_summary() -> str:
    """One line on auto's choice: 'auto picks tcp; ' + auto_reasons()."""
    picked = explain_auto()[0]
    head = f"auto picks {picked}" if picked else "auto finds no usable backend"
    return "; ".join([head] + auto_reasons())


_cache: dict[str, tuple] = {}


def _build_config() -> dict:
    """What setup.py left out of this installation, and why (name -> reason)."""
    try:
        from fabric import _build_config
    except ImportError:            # a tree built before setup.py recorded it
        return {}
    return dict(_build_config.LEFT_OUT)


def _load_ucx_wheel():
    """A backend built against the libucx-cu12 wheel finds UCX's libraries
    because the wheel loads them first (as ucx-py and ucxx do): the extension
    records no path of the build machine."""
    try:
        from fabric import _build_config
    except ImportError:
        return
    if _build_config.UCX_ORIGIN != "wheel" or _ucp_already_loaded():
        return
    try:
        import libucx  # type: ignore[import-untyped]  # the wheel ships no stubs
    except ImportError as e:
        raise ImportError(f"libucx (the UCX wheel this build expects) is not installed: {e}") from None
    try:
        libucx.load_library()
    except OSError as e:
        raise ImportError(f"the libucx wheel cannot load its libraries: {e}") from None


def _ucp_already_loaded() -> bool:
    """A libucp.so.0 in the process already (LD_PRELOAD, another package):
    the extension binds to that one by soname, and its version check decides;
    loading the wheel's copy beside it would only add a second UCX."""
    try:
        with open("/proc/self/maps") as f:
            return any("/libucp.so" in line for line in f)
    except OSError:
        return False


def load_module(name: str):
    """The extension module of backend `name`, with what it needs loaded
    first (ImportError if it is not built or cannot load)."""
    if name == "ucx":
        _load_ucx_wheel()
    return importlib.import_module(KNOWN[name][0])


def probe(name: str):
    """(Backend or None, reason) for one backend name."""
    if name in _cache:
        return _cache[name]
    cls_name = KNOWN[name][1]
    if name == "ucx":
        # UCX logs to stdout unless told otherwise, and reads this when its
        # library loads (with the module below): nothing fabric loads may
        # write to the application's stdout. The user's own choice wins.
        os.environ.setdefault("UCX_LOG_FILE", "stderr")
    left_out = _build_config().get(name)
    try:
        module = load_module(name)
    except ImportError as e:
        if left_out:
            result = (None, f"not built into this installation: {left_out}")
        elif name == "ucx" and ("libucp" in str(e) or "libucs" in str(e) or "libucx" in str(e)):
            # built against the libucx wheel (an isolated pip build), which is not installed here
            result = (None, f"the UCX libraries it was built against are missing ({e}); "
                            "pip install 'fabric-transport[ucx]' (or libucx-cu12)")
        else:
            result = (None, f"not built into this installation ({e})")
    else:
        cls = getattr(module, cls_name)
        ok, reason = cls.available()
        result = (cls() if ok else None, reason)
    _cache[name] = result
    return result


def available() -> dict:
    """{name: (usable, reason)} for every known backend."""
    return {name: (probe(name)[0] is not None, probe(name)[1]) for name in KNOWN}


def _explain() -> str:
    lines = []
    for name, (ok, reason) in available().items():
        lines.append(f"  {name}: {'available' if ok else 'unavailable'} ({reason})")
    return "\n".join(lines)


def get(name: str | None):
    """The Backend for a name from NAMES; 'auto' picks the fastest usable one."""
    return choose(name)[0]


def choose(name: str | None):
    """(Backend, why it was chosen) for a name from NAMES."""
    key = (name or "auto").strip().lower()
    if key not in NAMES:
        raise BackendUnavailable(f"unknown fabric backend {name!r}; choose one of "
                                 f"{', '.join(NAMES)}. Backends here:\n{_explain()}")
    if key == "auto":
        passed: list[str] = []
        for candidate in auto_order():
            backend, reason = probe(candidate)
            if backend is not None:
                why = "auto: " + "; ".join(passed + [f"{candidate} is the fastest usable ({reason})"])
                return backend, why
            passed.append(f"{candidate} unavailable ({reason})")
        raise BackendUnavailable("no fabric backend is usable here:\n" + _explain())
    if key == "softroce":
        backend, reason = probe("verbs")
        if backend is None:
            raise BackendUnavailable(f"backend 'softroce' (verbs on an rxe device) is unavailable: "
                                     f"{reason}. Backends here:\n{_explain()}")
        return backend.for_softroce(), "asked for softroce"
    backend, reason = probe(key)
    if backend is None:
        raise BackendUnavailable(f"backend {key!r} is unavailable: {reason}. Backends here:\n{_explain()}")
    return backend, f"asked for {key} ({reason})"
