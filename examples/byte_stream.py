"""A byte stream (fabric.stream), used like a socket.

The client writes a megabyte in writes of arbitrary sizes and half-closes;
the server (a thread here) reads to end of stream into its own buffer,
answers with a SHA-256 of what it read and half-closes too. Reads never
follow write boundaries: only the bytes and their order count.

    python examples/byte_stream.py [--backend tcp|ucx|verbs]
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import threading

import fabric
from fabric.stream import StreamListener

DATA = bytes(range(256)) * 4096          # 1 MiB
WRITES = [1, 1000, 70_000, 300_000]      # sizes of the client's writes, in turn


def server(lst: StreamListener) -> None:
    stream = lst.accept(timeout=30)
    digest = hashlib.sha256()
    buf = bytearray(64 * 1024)
    while n := stream.read_into(buf, timeout=30):         # 0 at end of stream
        digest.update(memoryview(buf)[:n])
    stream.write(digest.hexdigest().encode())
    stream.shutdown_write()                                # the client reads b"" after the digest
    # Endpoint.close() waits (up to close_linger) until what was written has left;
    # Stream.close() does not wait
    stream.endpoint.close()


def main() -> int:
    parser = argparse.ArgumentParser(description="a byte stream between two threads")
    parser.add_argument("--backend", help="tcp, ucx or verbs (default: $FABRIC_BACKEND, else auto)")
    args = parser.parse_args()

    with fabric.Fabric(args.backend) as fab, fab.listen_stream("127.0.0.1:0") as lst:
        thread = threading.Thread(target=server, args=(lst,))
        thread.start()
        with fab.connect_stream(lst.address, timeout=30) as stream:
            offset = writes = 0
            while offset < len(DATA):
                size = WRITES[writes % len(WRITES)]
                # returns once every byte was handed over; a large write (by rendezvous,
                # straight from DATA) completes when the server has read it
                stream.write(memoryview(DATA)[offset:offset + size])
                offset += size
                writes += 1
            stream.shutdown_write()                        # the server reads end of stream
            answer = b""
            while chunk := stream.read(timeout=30):        # b"" at end of stream
                answer += chunk
        thread.join(30)
    if answer.decode() != hashlib.sha256(DATA).hexdigest():
        print(f"the server read something else: {answer!r}", file=sys.stderr)
        return 1
    print(f"byte_stream: {len(DATA)} bytes in {writes} writes over {fab.name}, "
          "checked by the server's SHA-256: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
