"""One side of a two-guest check (tools/softroce.py --guests 2):
python wire_peer.py BACKEND server|client. The client sends messages of
every protocol's sizes across the wire, the server echoes them, and the
client checks each one; both print "BACKEND ROLE ok" at the end."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fabric  # noqa: E402

SIZES = [0, 8, 4096, 65536, 1 << 20, 16 << 20]
PORT = 7777


def main(backend, role):
    me, peer = os.environ["FABRIC_GUEST_ADDR"], os.environ["FABRIC_PEER_ADDR"]
    fab = fabric.Fabric(backend)
    if role == "server":
        ep = fab.listen(f"{me}:{PORT}").accept(timeout=120)
        for _ in SIZES:
            ep.send(ep.recv(timeout=120))
        ep.recv(timeout=120)                      # the client's goodbye
    else:
        deadline = time.monotonic() + 120         # the other guest may still be booting
        while True:
            try:
                ep = fab.connect(f"{peer}:{PORT}", timeout=10)
                break
            except fabric.FabricError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        for n in SIZES:
            data = os.urandom(n)
            ep.send(data)
            if bytes(ep.recv(timeout=120)) != data:
                print(f"{backend} {n} B came back different", flush=True)
                return 1
        ep.send(b"bye")
    print(f"{backend} {role} ok", flush=True)
    fab.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
