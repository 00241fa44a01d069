"""A first connection: listen, connect, accept, send and receive.

Both ends are in this process here (connect() returns once the listener's
engine has completed the handshake, so one thread can do both); in real use
the two ends are different processes or hosts.

    python examples/hello.py [--backend tcp|ucx|verbs]
"""
from __future__ import annotations

import argparse
import sys

import fabric


def main() -> int:
    parser = argparse.ArgumentParser(description="a first fabric connection")
    parser.add_argument("--backend", help="tcp, ucx or verbs (default: $FABRIC_BACKEND, else auto)")
    args = parser.parse_args()

    with fabric.Fabric(args.backend) as fab:          # closes its listeners and endpoints at the end
        lst = fab.listen("127.0.0.1:0")               # port 0: a free one; lst.address is the real one
        ep = fab.connect(lst.address, timeout=10)     # the client's end
        peer = lst.accept(timeout=10)                 # the server's end of the same connection

        ep.send(b"hello")                             # any C-contiguous buffer
        msg = peer.recv(timeout=10)                   # a fabric.Message: a buffer, equal to bytes
        assert msg == b"hello"

        ep.send([b"head:", b"body"])                  # a list of buffers is one message
        buf = bytearray(64)
        n = peer.recv_into(buf, timeout=10)           # straight into your buffer
        assert buf[:n] == b"head:body"

        big = bytes(range(256)) * (32 << 10)          # 8 MiB: goes by rendezvous, zero copy
        req = ep.isend(big)                           # returns at once; keep `big` unchanged until done
        received = peer.recv(timeout=30)              # the receiver pulls it from the sender's memory
        req.wait(timeout=30)
        assert received == big
        protocol, _ = ep.protocol_for(len(big))       # which protocol a size takes on this endpoint

    print(f"hello: eager, gathered and {protocol} messages over {fab.name}: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
