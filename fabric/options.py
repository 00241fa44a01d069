"""The engine's knobs: defaults per backend, a tuning profile, environment
variables and per-Fabric keyword arguments, in increasing order of precedence.

| option            | environment variable        | meaning |
|-------------------|-----------------------------|---------|
| eager_limit       | FABRIC_EAGER_LIMIT          | largest message sent eagerly (copied through pre-allocated buffers or sent straight from the caller's buffer); larger ones go by rendezvous |
| chunk_size        | FABRIC_CHUNK_SIZE           | rendezvous messages are registered and pulled in chunks of this size |
| chunks_in_flight  | FABRIC_CHUNKS_IN_FLIGHT     | chunks announced (sender) and read (receiver) ahead per message; a peer announcing more unanswered chunks of one message is cut off |
| adapt             | FABRIC_ADAPT                | 1: each connection measures its link (round trip at the handshake, bandwidth of its rendezvous transfers) and raises eager_limit, chunk_size and chunks_in_flight above their defaults to cover the link's bandwidth-delay product, up to adapt_max_chunk and adapt_max_window; a threshold given by argument, environment or profile stays fixed; 0: the values as configured |
| adapt_max_chunk   | FABRIC_ADAPT_MAX_CHUNK      | adapt: largest chunk_size a connection grows to |
| adapt_max_window  | FABRIC_ADAPT_MAX_WINDOW     | adapt: most chunks in flight a connection grows to (also what this end accepts from a peer that adapts) |
| max_rendezvous    | FABRIC_MAX_RENDEZVOUS       | rendezvous messages in flight per endpoint and direction (announced, not yet fully pulled): a sender keeps to its peer's, a peer announcing more is cut off (ProtocolError) |
| coalesce_limit    | FABRIC_COALESCE_LIMIT       | largest fabric message; small messages queued while the fabric is busy are packed up to this size |
| coalesce          | FABRIC_COALESCE             | 1: pack small messages queued while the fabric is busy into one send; 0: one send per message (for measuring what coalescing gains) |
| credits           | FABRIC_CREDITS              | receive buffers each endpoint offers its peer (flow control) |
| recv_budget       | FABRIC_RECV_BUDGET          | bytes of not-yet-received messages an endpoint buffers before it stops returning credits |
| total_recv_budget | FABRIC_TOTAL_RECV_BUDGET    | the same over every endpoint of a Fabric together: past it an endpoint holding unreceived messages returns no credits (its sender waits) and nothing is pulled ahead; one whose application took everything gets its credits back, so no endpoint starves behind another's backlog |
| send_buffers      | FABRIC_SEND_BUFFERS         | coalescing buffers per endpoint (bounds the sender's copies) |
| max_message       | FABRIC_MAX_MESSAGE          | largest message accepted from a peer |
| spin_us           | FABRIC_SPIN_US              | microseconds of busy polling before a wait blocks |
| spin_max_us       | FABRIC_SPIN_MAX_US          | adaptive polling: an endpoint whose recent waits ended within this many microseconds polls a little longer than they took before it blocks (waking a blocked thread costs tens of microseconds on a VM); 0: always spin_us |
| handshake_timeout | FABRIC_HANDSHAKE_TIMEOUT    | seconds a new connection has to complete its handshake |
| max_pending_handshakes | FABRIC_MAX_PENDING_HANDSHAKES | connections a listener authenticates and handshakes at once (at most a quarter of the descriptor limit); when full, the slowest pending one older than 0.5 s gives way to a new one |
| max_connections   | FABRIC_MAX_CONNECTIONS      | connections one listener keeps open at once (from the preamble until closed or dead); more are turned away at once, and their connect() fails with ConnectionLost naming the limit |
| close_linger      | FABRIC_CLOSE_LINGER         | seconds close() waits for queued sends to leave |
| posted_receives   | FABRIC_POSTED_RECEIVES      | 1: a recv_into() waiting for a large message offers its buffer to the peer, which writes the message straight into it (tcp, verbs; one round trip less than pulling); 0: every large message is pulled |
| native_min        | FABRIC_NATIVE_MIN           | messages of at least this size use the fabric's own rendezvous where it has one (ucx); 0: always the engine's |
| progress_thread   | FABRIC_PROGRESS_THREAD      | 1: a background thread progresses sends, rendezvous and TCP read service while the application is away from fabric (it polls only then); 0: progress happens only inside fabric calls |
| tcp_user_timeout_ms | FABRIC_TCP_USER_TIMEOUT_MS | tcp: unacknowledged data fails the connection after this long |
| tcp_keepalive_s   | FABRIC_TCP_KEEPALIVE_S      | tcp: keepalive idle/interval seconds (a silent dead host is detected) |

Sizes accept suffixes K, M, G (powers of 1024). The tuning profile is JSON,
read from $FABRIC_PROFILE, else $XDG_CONFIG_HOME/fabric/tuning.json (default
~/.config/fabric/tuning.json); FABRIC_PROFILE=none disables it. `fabric-perf
--tune` writes it. A missing profile is silent; a corrupt or foreign one gives
a warning and the defaults are used.
"""
from __future__ import annotations

import json
import os
import re
import warnings
from typing import Any

PROFILE_FORMAT = "fabric-tuning"
PROFILE_VERSION = 1

# name: (kind, minimum, maximum)
KNOBS = {
    "eager_limit": ("size", 0, 1 << 30),
    "chunk_size": ("size", 4096, 1 << 31),
    "chunks_in_flight": ("int", 1, 1024),
    "adapt": ("int", 0, 1),
    "adapt_max_chunk": ("size", 4096, 1 << 31),
    "adapt_max_window": ("int", 1, 1024),
    "max_rendezvous": ("int", 1, 1 << 20),
    "coalesce_limit": ("size", 1024, 1 << 30),
    "coalesce": ("int", 0, 1),
    "credits": ("int", 4, 65536),
    "recv_budget": ("size", 0, 1 << 62),
    "total_recv_budget": ("size", 0, 1 << 62),
    "send_buffers": ("int", 1, 1 << 20),
    "max_message": ("size", 1, 1 << 62),
    "spin_us": ("float", 0, 1e6),
    "spin_max_us": ("float", 0, 1e6),
    "handshake_timeout": ("float", 0.001, 1e6),
    "max_pending_handshakes": ("int", 1, 1 << 20),
    "max_connections": ("int", 1, 1 << 24),
    "close_linger": ("float", 0, 1e6),
    "progress_thread": ("int", 0, 1),
    "native_min": ("size", 0, 1 << 62),
    "posted_receives": ("int", 0, 1),
    "tcp_user_timeout_ms": ("int", 0, 1 << 31),
    "tcp_keepalive_s": ("int", 0, 1 << 15),
}

# One line per knob (the table above says more), for --help texts and
# `python -m fabric info`.
HELP = {
    "eager_limit": "largest message sent eagerly; larger ones go by rendezvous",
    "chunk_size": "rendezvous messages are registered and pulled in chunks of this size",
    "chunks_in_flight": "rendezvous chunks announced and read ahead per message",
    "adapt": "1: grow eager_limit, chunk_size, chunks_in_flight to the link's bandwidth-delay product (unless fixed)",
    "adapt_max_chunk": "adapt: largest chunk_size a connection grows to",
    "adapt_max_window": "adapt: most chunks in flight a connection grows to",
    "max_rendezvous": "rendezvous messages in flight per endpoint and direction (a peer announcing more is cut off)",
    "coalesce_limit": "largest fabric message: small queued messages are packed up to this size",
    "coalesce": "1: pack small messages queued while the fabric is busy into one send; 0: one send per message",
    "credits": "receive buffers each endpoint offers its peer (flow control)",
    "recv_budget": "bytes of unreceived messages buffered before credits stop being returned",
    "total_recv_budget": "the same over all endpoints of a Fabric together",
    "send_buffers": "coalescing buffers per endpoint",
    "max_message": "largest message accepted from a peer",
    "spin_us": "microseconds of busy polling before a wait blocks",
    "spin_max_us": "adaptive polling: longest spin for endpoints whose waits end quickly; 0: always spin_us",
    "handshake_timeout": "seconds a new connection has to complete its handshake",
    "max_pending_handshakes": "connections a listener handshakes at once; when full the slowest (> 0.5 s) gives way",
    "max_connections": "connections a listener keeps open at once; more are turned away with a clear error",
    "close_linger": "seconds close() waits for queued sends to leave",
    "progress_thread": "1: a background thread progresses while the application is away; 0: only in calls",
    "posted_receives": "1: recv_into() offers its buffer to the peer, which writes large messages into it; 0: always pull",
    "native_min": "messages of at least this size use the fabric's own rendezvous (ucx); 0: always the engine's",
    "tcp_user_timeout_ms": "tcp: unacknowledged data fails the connection after this many ms",
    "tcp_keepalive_s": "tcp: keepalive idle/interval seconds",
}

COMMON_DEFAULTS = {
    "eager_limit": 65536,
    "chunk_size": 4 << 20,
    "chunks_in_flight": 2,
    "adapt": 1,
    "adapt_max_chunk": 16 << 20,
    "adapt_max_window": 16,
    "max_rendezvous": 64,
    "coalesce_limit": 65536 + 4096,
    "coalesce": 1,
    "credits": 32,
    "recv_budget": 64 << 20,
    "total_recv_budget": 1 << 30,
    "send_buffers": 16,
    "max_message": 1 << 40,
    "spin_us": 50.0,
    "spin_max_us": 500.0,
    "handshake_timeout": 10.0,
    "max_pending_handshakes": 1024,
    "max_connections": 4096,
    "close_linger": 5.0,
    "progress_thread": 1,
    "native_min": 0,
    "posted_receives": 1,
    "tcp_user_timeout_ms": 30000,
    "tcp_keepalive_s": 10,
}

_SIZE = re.compile(r"^\s*(\d+)\s*([kmgKMG]?)i?[bB]?\s*$")


def env_name(option: str) -> str:
    return "FABRIC_" + option.upper()


def parse_value(name: str, value):
    """Validate one knob; raises ValueError naming the knob."""
    if name not in KNOBS:
        raise ValueError(f"unknown fabric option {name!r}; known: {', '.join(sorted(KNOBS))}")
    kind, lo, hi = KNOBS[name]
    parsed: int | float
    try:
        if kind == "size":
            if isinstance(value, str):
                m = _SIZE.match(value)
                if not m:
                    raise ValueError(value)
                value = int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]
            parsed = int(value)
        elif kind == "int":
            parsed = int(value)
        else:
            parsed = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"fabric option {name}={value!r} is not a valid {kind}") from None
    if not lo <= parsed <= hi:
        raise ValueError(f"fabric option {name}={parsed} is outside [{lo}, {hi}]")
    return parsed


def profile_path() -> str | None:
    path = os.environ.get("FABRIC_PROFILE")
    if path:
        return None if path.lower() == "none" else path
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "fabric", "tuning.json")


def read_profile(backend: str, path: str | None = None) -> dict:
    """Options tuned for `backend`, or {} (with a warning if the file is bad)."""
    path = path if path is not None else profile_path()
    if not path or not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        if not isinstance(doc, dict) or doc.get("format") != PROFILE_FORMAT:
            raise ValueError("not a fabric tuning profile")
        if doc.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {doc.get('version')!r} is not {PROFILE_VERSION}")
        entry = doc.get("backends", {}).get(backend)
        if entry is None:
            return {}
        opts = entry.get("options", {})
        return {k: parse_value(k, v) for k, v in opts.items()}
    except (OSError, ValueError, AttributeError, TypeError) as e:
        warnings.warn(f"ignoring fabric tuning profile {path}: {e}; using defaults",
                      RuntimeWarning, stacklevel=3)
        return {}


def write_profile(backend: str, options: dict, path: str | None = None, extra: dict | None = None) -> str:
    """Store tuned options for backend, keeping other backends' entries."""
    path = path if path is not None else profile_path()
    if not path:
        raise ValueError("FABRIC_PROFILE=none: no profile to write")
    doc: dict[str, Any] = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "backends": {}}
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                old = json.load(f)
            if isinstance(old, dict) and old.get("format") == PROFILE_FORMAT:
                doc["backends"] = dict(old.get("backends", {}))
        except (OSError, ValueError):
            pass
    entry = {"options": {k: parse_value(k, v) for k, v in options.items()}}
    entry.update(extra or {})
    doc["backends"][backend] = entry
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, sort_keys=True)
    os.replace(tmp, path)
    return path


# Where a resolved knob's value came from, lowest precedence first.
SOURCES = ("default", "backend", "profile", "env", "argument")


def _layered(backend_defaults: dict, profile: dict, overrides: dict) -> dict:
    """{name: (raw value, source)} in resolve()'s order of precedence."""
    opts: dict[str, Any] = {k: (v, "default") for k, v in COMMON_DEFAULTS.items()}
    opts.update((k, (v, "backend")) for k, v in backend_defaults.items())
    opts.update((k, (v, "profile")) for k, v in profile.items())
    for name in KNOBS:
        raw = os.environ.get(env_name(name))
        if raw not in (None, ""):
            opts[name] = (raw, "env")
    opts.update((k, (v, "argument")) for k, v in overrides.items())
    return opts


def resolve(backend_name: str, backend_defaults: dict, overrides: dict) -> dict:
    """Defaults < backend defaults < profile < environment < keyword arguments."""
    opts = _layered(backend_defaults, read_profile(backend_name), overrides)
    return {k: parse_value(k, v) for k, (v, _) in opts.items()}


def resolve_sources(backend_name: str, backend_defaults: dict, overrides: dict) -> dict:
    """{name: (value, source)}: what resolve() returns, and for each knob the
    layer its value came from, one of SOURCES ("backend" is the backend's own
    default, "env" the FABRIC_<NAME> variable, "argument" a keyword argument
    of Fabric). Raises like resolve() on an invalid value."""
    opts = _layered(backend_defaults, read_profile(backend_name), overrides)
    return {k: (parse_value(k, v), source) for k, (v, source) in opts.items()}


# The thresholds option adapt sizes per connection, and the engine's bit for
# each (fabric/protocol/core/adapt.pxi: ADAPT_EAGER, ADAPT_CHUNK, ADAPT_WINDOW).
ADAPTIVE = {"eager_limit": 1, "chunk_size": 2, "chunks_in_flight": 4}


def adapting(sources: dict) -> list[str]:
    """Of ADAPTIVE, those a connection may raise to its link: adapt is on and
    the value is a default (the backend's or the common one), not given by
    argument, environment or tuning profile."""
    if not sources["adapt"][0]:
        return []
    return [k for k in ADAPTIVE if sources[k][1] in ("default", "backend")]


def adapt_mask(names) -> int:
    mask = 0
    for name in names:
        mask |= ADAPTIVE[name]
    return mask
