"""The program a user writes first, against the tuned one, side by side.

    python bench/blocking_loop.py [--backends tcp,ucx] [--sizes 64K,1M,16M,64M] [--rounds 3] [--json out.json]
                                  [--perftest]

Sender (this process): `for a in arrays: ep.send(a)` (blocking) against a
window of `isend`s (4 in flight). Receiver (its own process), one per
contender: `recv_into(buf)` into one preallocated buffer (into; into-pull:
the same with posted_receives=0, the buffer never offered to the sender), a fresh
`numpy.empty` per message then `recv_into` (the page-fault case), or
`recv()` taking a buffer the receiver returns to fabric when done
(fabric's recycled buffers), or `socket`: no fabric at all, a plain TCP
socket, `sendall` answered by a `recv_into` loop into one preallocated buffer
(the baseline a tcp fabric must beat). A receiver named MODE@DIR runs from the source
tree DIR (a worktree of another commit: before/after in one run). The sender
times from the first send to the receiver's acknowledgement of the last
message, which carries the receiver's minor page faults in that run (faults
per message are printed with the rates). Rounds interleave
the contenders; medians; ratios against the windowed loop of the same run.
--perftest adds UCX's own C benchmark to each ucx round: ucx_perftest tag_bw at
the same size and UCX_TLS (the variable as set here; unset: all transports).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# (a receiver started for another tree imports fabric from there)
sys.path.insert(0, os.environ.get("FABRIC_BENCH_TREE") or os.path.dirname(HERE))

RECEIVERS = ("into", "into-pull", "numpy", "recv", "socket")
BUDGET = 512 << 20          # bytes per measurement


class RawSocket:
    """The socket contender, shaped like an endpoint for one_run()."""

    def __init__(self, sock):
        self.sock = sock

    def send(self, data):
        self.sock.sendall(data)

    def recv(self, timeout=None):
        return recv_exactly(self.sock, 8)

    def close(self):
        self.sock.close()


def recv_exactly(sock, n, buf=None):
    view = memoryview(buf if buf is not None else bytearray(n))[:n]
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("peer closed")
        got += k
    return view


class SocketPeer(RawSocket):
    """The socket receiver's side, shaped like an endpoint for serve()."""

    def recv(self, timeout=None):
        try:
            return bytes(recv_exactly(self.sock, 16))
        except EOFError:
            return b""

    def recv_into(self, buf, timeout=None):
        return len(recv_exactly(self.sock, len(buf), buf))


def socket_receiver():
    import socket
    lst = socket.create_server(("127.0.0.1", 0))
    print(f"127.0.0.1:{lst.getsockname()[1]}", flush=True)
    sock, _ = lst.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    serve(SocketPeer(sock), "into")


def receiver(backend, mode):
    """Serve: for each (size, count) announced by an 8-byte header message,
    receive count messages the chosen way, then acknowledge."""
    if mode == "socket":
        return socket_receiver()
    import fabric
    # into-pull: recv_into that never offers its buffer (posted_receives=0)
    fab = fabric.Fabric(backend, posted_receives=0 if mode == "into-pull" else 1)
    lst = fab.listen()
    print(lst.address, flush=True)
    ep = lst.accept(timeout=60)
    serve(ep, mode)
    fab.close()


def serve(ep, mode):
    import resource
    import numpy as np
    buf = None
    while True:
        head = ep.recv(timeout=600)
        if len(head) == 0:
            break
        size, count = int.from_bytes(head[:8], "little"), int.from_bytes(head[8:16], "little")
        if buf is None or len(buf) < size:
            buf = np.empty(size, np.uint8)
        into = buf[:size]                 # (a view: the socket peer reads exactly its length)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(count):
            if mode in ("into", "into-pull"):
                ep.recv_into(into, timeout=600)
            elif mode == "numpy":
                fresh = np.empty(size, np.uint8)
                ep.recv_into(fresh, timeout=600)
            else:
                msg = ep.recv(timeout=600)
                np.frombuffer(msg, np.uint8)[:1].sum()     # touch it, as a user would
                del msg                                   # its memory goes back to fabric
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        ep.send(faults.to_bytes(8, "little"))
    ep.close()


def start_receiver(backend, spec):
    mode, _, tree = spec.partition("@")
    tree = os.path.abspath(tree) if tree else os.path.dirname(HERE)
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", backend, mode],
                            stdout=subprocess.PIPE, text=True, cwd=tree,
                            env=dict(os.environ, PYTHONPATH=tree, FABRIC_BENCH_TREE=tree))
    address = proc.stdout.readline().strip()
    if not address:
        raise RuntimeError(f"receiver {backend}/{mode} did not start")
    return proc, address


def perftest_bw(size, count):
    """ucx_perftest tag_bw of `count` messages of `size` bytes, MB/s (10^6),
    between two processes on loopback with this UCX_TLS."""
    sys.path.insert(0, HERE)
    from ucx_compare import ucx_perftest
    import random
    tls = os.environ.get("UCX_TLS") or "all"
    return ucx_perftest("tag_bw", size, count, tls, random.randint(20000, 60000))["MBps"]


def one_run(ep, payload, count, window):
    ep.send(len(payload).to_bytes(8, "little") + count.to_bytes(8, "little"))
    t0 = time.perf_counter()
    if window <= 1 or isinstance(ep, RawSocket):
        for _ in range(count):
            ep.send(payload)
    else:
        pending = []
        for _ in range(count):
            pending.append(ep.isend(payload))
            if len(pending) >= window:
                pending.pop(0).wait(timeout=600)
        for r in pending:
            r.wait(timeout=600)
    faults = int.from_bytes(ep.recv(timeout=600)[:8], "little")
    return len(payload) * count / (time.perf_counter() - t0) / 1e6, faults / count


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="tcp,ucx")
    ap.add_argument("--sizes", default="64K,256K,1M,4M,16M,64M")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--receivers", default=",".join(RECEIVERS))
    ap.add_argument("--json")
    ap.add_argument("--perftest", action="store_true",
                    help="each ucx round also runs ucx_perftest tag_bw (same size, same UCX_TLS)")
    ap.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        receiver(*args.serve)
        return 0
    import numpy as np
    import fabric
    from fabric.info import human_size as human
    from fabric.perf.cli import parse_sizes
    sizes = parse_sizes(args.sizes)
    modes = args.receivers.split(",")
    results = {}
    for backend in args.backends.split(","):
        fab = fabric.Fabric(backend)
        peers = {}
        for mode in modes:
            if mode == "socket" and backend != "tcp":
                continue
            proc, address = start_receiver(backend, mode)
            if mode == "socket":
                import socket
                host, port = address.rsplit(":", 1)
                sock = socket.create_connection((host, int(port)))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                peers[mode] = (proc, RawSocket(sock))
            else:
                peers[mode] = (proc, fab.connect(address, timeout=60))
        try:
            for size in sizes:
                payload = np.random.default_rng(1).integers(0, 255, size, dtype=np.uint8)
                count = max(4, min(2000, BUDGET // size))
                samples, faults = {}, {}
                for _ in range(args.rounds):
                    for mode in peers:
                        ep = peers[mode][1]
                        one_run(ep, payload, min(count, 8), 1)            # warm-up
                        for name, window in (("windowed", 4), ("blocking", 1)):
                            rate, per_message = one_run(ep, payload, count, window)
                            samples.setdefault((mode, name), []).append(rate)
                            faults.setdefault(mode, []).append(per_message)
                    if args.perftest and backend == "ucx":
                        samples.setdefault(("ucx_perftest", "tag_bw"), []).append(perftest_bw(size, count))
                row = {f"{mode}/{name}": statistics.median(v) for (mode, name), v in samples.items()}
                row.update({f"{mode} faults/msg": statistics.median(v) for mode, v in faults.items()})
                results[f"{backend} {human(size)}"] = row
                base = row["into/windowed"] if "into/windowed" in row else next(iter(row.values()))
                cells = "  ".join(f"{k} {v:8.0f} ({v / base:.2f}x)" for k, v in row.items() if "faults" not in k)
                print(f"{backend:4} {human(size):>4}  {cells}", flush=True)
                if "ucx_perftest/tag_bw" in row:
                    print("          against ucx_perftest tag_bw: " + "  ".join(
                        f"{k} {v / row['ucx_perftest/tag_bw']:.2f}x" for k, v in row.items()
                        if k.startswith("into/")), flush=True)
                if "socket/blocking" in row:
                    print("          against the raw socket loop: " + "  ".join(
                        f"{k} {v / row['socket/blocking']:.2f}x" for k, v in row.items()
                        if k.endswith("/blocking") and not k.startswith("socket")), flush=True)
                print("          faults per message: " + "  ".join(
                    f"{mode} {statistics.median(v):.0f}" for mode, v in faults.items()), flush=True)
        finally:
            for mode, (proc, ep) in peers.items():
                try:
                    if not isinstance(ep, RawSocket):
                        ep.send(b"")
                    ep.close()
                except fabric.FabricError:
                    pass
                proc.wait(timeout=30)
            fab.close()
    print("MB/s; ratios against into/windowed (a preallocated recv_into, 4 isends in flight)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
