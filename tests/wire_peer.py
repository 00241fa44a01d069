"""One side of a two-guest check (tools/softroce.py --guests 2).

python wire_peer.py BACKEND server|client: the client sends messages of
every protocol's sizes across the wire, the server echoes them, and the
client checks each one; both print "BACKEND ROLE ok" at the end.

python wire_peer.py BACKENDS holder|watcher: the host that vanishes. The
holder (first guest) accepts one connection per backend (comma-separated)
and takes nothing; the watcher (second guest) leaves operations pending on
each (a receive, sends queued behind credits, a large send), has the
holder's whole guest killed ($FABRIC_WIRE_KILL_PEER), and prints how long
each operation took to fail: "vanished BACKEND OP failed after S s (ERROR)".
Both use VANISH_OPTIONS unless FABRIC_TEST_OPTIONS replaces them."""
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fabric  # noqa: E402

SIZES = [0, 8, 4096, 65536, 1 << 20, 16 << 20]
PORT = 7777
# a silent host is found by keepalive and TCP_USER_TIMEOUT on the socket each
# connection keeps (the data socket on tcp, the bootstrap socket on ucx and
# verbs); the holder returns no credits (recv_budget 0) so sends stay queued
VANISH_OPTIONS = json.loads(os.environ.get("FABRIC_TEST_OPTIONS", "null") or "null") or {
    "tcp_user_timeout_ms": 3000, "tcp_keepalive_s": 1, "recv_budget": 0, "credits": 4}


def connect_retrying(fab, address):
    deadline = time.monotonic() + 120         # the other guest may still be booting
    while True:
        try:
            return fab.connect(address, timeout=10)
        except fabric.FabricError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def holder(backends):
    fabs = [fabric.Fabric(b, **VANISH_OPTIONS) for b in backends.split(",")]
    lsts = [f.listen(f"{os.environ['FABRIC_GUEST_ADDR']}:{PORT + i}") for i, f in enumerate(fabs)]
    eps = [lst.accept(timeout=120) for lst in lsts]
    print(f"holder has {len(eps)} connections", flush=True)
    time.sleep(600)                           # until its guest is killed
    return 1


def watcher(backends):
    results, threads = [], []
    fabs = []
    for i, backend in enumerate(backends.split(",")):
        fab = fabric.Fabric(backend, **VANISH_OPTIONS)
        fabs.append(fab)
        ep = connect_retrying(fab, f"{os.environ['FABRIC_PEER_ADDR']}:{PORT + i}")
        ops = [("recv", lambda ep=ep: ep.recv(timeout=300))]
        ops += [(f"send {k}", ep.isend(b"x" * 64).wait) for k in range(16)]
        ops.append(("send 32 MiB", ep.isend(bytearray(32 << 20)).wait))
        for name, op in ops:
            def wait(backend=backend, name=name, op=op):
                try:
                    op(timeout=300) if name != "recv" else op()
                    results.append((backend, name, None, "completed"))
                except fabric.FabricError as e:
                    results.append((backend, name, time.monotonic(), f"{type(e).__name__}: {e}"))
            threads.append(threading.Thread(target=wait, daemon=True))
    time.sleep(2.0)                           # everything that can leave has left
    for t in threads:
        t.start()
    pending = len(threads)
    killed = time.monotonic()
    open(os.environ["FABRIC_WIRE_KILL_PEER"], "w").close()
    for t in threads:
        t.join(300)
    worst = 0.0
    for backend, name, at, what in results:
        if at is None:
            print(f"vanished {backend} {name} {what}", flush=True)
            continue
        worst = max(worst, at - killed)
        print(f"vanished {backend} {name} failed after {at - killed:.2f} s ({what})", flush=True)
    print(f"vanished: {len([r for r in results if r[2]])} of {pending} pending operations failed, "
          f"the last {worst:.2f} s after the kill", flush=True)
    return 0


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
    if sys.argv[2] in ("holder", "watcher"):
        sys.exit(globals()[sys.argv[2]](sys.argv[1]))
    sys.exit(main(*sys.argv[1:]))
