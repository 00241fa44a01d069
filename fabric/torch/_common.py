"""What every part of the fabric process group shares: the wire header,
its limits, the error type and reading sizes from the environment."""
from __future__ import annotations

import logging
import os
import struct

logger = logging.getLogger("fabric.torch")

BACKEND_NAME = "fabric"
HEADER = struct.Struct("<BBHIqQQ")       # kind, flags, 0, 0, tag, sequence, bytes
COLL, P2P, ABORT = 1, 2, 3
INLINE_FLAG = 1
INLINE = 16 * 1024          # bytes sent inside the header's message
# Bytes one peer's transfers may occupy here before a receive is posted for
# them (FABRIC_TORCH_EARLY_MAX); past it the group gives up on that peer.
# The reader thread cannot leave them on the connection instead: the
# collectives' messages behind them would wait too.
EARLY_MAX = 1 << 30


class FabricPGError(RuntimeError):
    """A collective or p2p operation of a fabric process group failed."""


def _env_bytes(name: str, default: int) -> int:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected a number of bytes") from None
    if value < 0:
        raise ValueError(f"{name}={text!r}: expected a number of bytes >= 0")
    return value


def _root_cause(message: str) -> str:
    """'fabric process group: rank 3 gave up: fabric process group: rank 7 is
    gone (...)' -> 'rank 7 is gone (...)'."""
    prefix = "fabric process group: "
    while True:
        if message.startswith(prefix):
            message = message[len(prefix):]
        head, sep, rest = message.partition(" gave up: ")
        if sep and head.startswith("rank ") and head[5:].isdigit():
            message = rest
            continue
        return message

