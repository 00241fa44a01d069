"""What the perf client and its peer say to each other.

Test payloads travel as plain fabric messages. Control messages are exactly
CONTROL.size bytes and start with MAGIC (test payloads are filled with other
bytes, so they never look like one); the peer answers each with b"k", which
also proves everything sent before it arrived.
"""
from __future__ import annotations

import struct

MAGIC = b"fabperf\x01"
CONTROL = struct.Struct("<8sBQ")       # magic, mode, argument

ECHO = 1        # reply with the message (lat)
SINK = 2        # no reply (bw, rate)
RPC = 3         # reply with `argument` bytes (rpc)
SYNC = 4        # reply only: everything before has arrived

PAYLOAD_BYTE = 0x4C


def control(mode: int, argument: int = 0) -> bytes:
    return CONTROL.pack(MAGIC, mode, argument)


def parse_control(view) -> tuple[int, int] | None:
    if len(view) != CONTROL.size or bytes(view[:8]) != MAGIC:
        return None
    _, mode, argument = CONTROL.unpack(view)
    return mode, argument


def set_mode(ep, mode: int, argument: int = 0, timeout: float = 60.0):
    ep.send(control(mode, argument))
    ack = bytearray(8)
    n = ep.recv_into(ack, timeout=timeout)
    if bytes(ack[:n]) != b"k":
        raise RuntimeError(f"fabric-perf: peer answered {bytes(ack[:n])!r} to a control message")


def serve_endpoint(ep, buffer_size: int = 64 << 20):
    """One connection: messages are handled by the mode the client last set."""
    import fabric
    buf = bytearray(buffer_size)
    view = memoryview(buf)
    reply = memoryview(bytearray([PAYLOAD_BYTE]) * buffer_size)
    mode, argument = ECHO, 0
    try:
        while True:
            try:
                n = ep.recv_into(buf)
                msg = view[:n]
            except fabric.MessageTooLarge:
                msg = memoryview(ep.recv())      # larger than our buffer: take it whole
                n = len(msg)
            ctl = parse_control(msg) if n == CONTROL.size else None
            if ctl is not None:
                if ctl[0] != SYNC:
                    mode, argument = ctl
                    if mode == RPC and argument > len(reply):
                        reply = memoryview(bytearray([PAYLOAD_BYTE]) * argument)
                ep.send(b"k")
            elif mode == ECHO:
                ep.send(msg)
            elif mode == RPC:
                ep.send(reply[:argument])
    except fabric.FabricError:
        pass
    finally:
        ep.close(linger=0)


def serve(fab, address: str, announce=print, buffer_size: int = 64 << 20):
    """Accept connections until killed, serving one at a time on this thread:
    a second waiting thread would turn every message into a hand-off between
    threads and measure that instead of the fabric. Clients therefore keep at
    most one connection open at a time."""
    import fabric
    lst = fab.listen(address)
    announce(lst.address)
    while True:
        try:
            ep = lst.accept()
        except fabric.FabricError:
            continue
        serve_endpoint(ep, buffer_size)
