"""fabric-perf: latency and bandwidth of a fabric backend.

    fabric-perf                       # lat and bw, 1 B..64 MiB, default backend, own peer on loopback
    fabric-perf -t lat -s 8,4096      # chosen tests and sizes
    fabric-perf --server 0.0.0.0:7000 # serve; elsewhere: fabric-perf --connect HOST:7000

Tests: lat (ping-pong round trip: p50/p99/max), bw (one-way stream with a
window of messages in flight). Iterations scale with size; warm-up is excluded.
Options such as --eager-limit override the engine's knobs for both sides.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

KNOB_FLAGS = ("eager_limit", "chunk_size", "chunks_in_flight", "coalesce_limit", "credits", "spin_us",
              "native_min")
END_STREAM = b"\xac"


def parse_sizes(text: str) -> list[int]:
    """'1-64M' (powers of two), or a comma list with K/M/G suffixes."""
    from fabric.options import parse_value

    def one(t):
        return parse_value("max_message", t)

    if "-" in text and "," not in text:
        lo, hi = (one(t) for t in text.split("-", 1))
        if lo < 1 or hi < lo:
            raise ValueError(f"bad size range {text!r}")
        sizes, s = [], 1
        while s <= hi:
            if s >= lo:
                sizes.append(s)
            s *= 2
        return sizes
    return [one(t) for t in text.split(",") if t.strip()]


def iterations(size: int, scale: float = 1.0) -> int:
    return max(5, min(20000, int((64 << 20) * scale) // max(size, 64)))


def serve(fab, address: str, announce=print):
    """Echo for lat, sink with a 1-byte acknowledgement for bw, until killed."""
    import fabric
    lst = fab.listen(address)
    announce(lst.address)
    buf = bytearray(64 << 20)
    view = memoryview(buf)
    while True:
        ep = lst.accept()
        try:
            while True:
                n = ep.recv_into(buf)
                if n == 1 and buf[0] == END_STREAM[0]:
                    ep.send(b"k")
                elif n and buf[0] == 0x51:
                    continue
                else:
                    ep.send(view[:n])
        except fabric.FabricError:
            ep.close(linger=0)


def run_lat(ep, size: int, scale: float) -> dict:
    payload = bytes([0x4C]) * size
    buf = bytearray(max(size, 1))
    n = iterations(size, scale)
    for _ in range(max(3, n // 10)):
        ep.send(payload)
        ep.recv_into(buf)
    samples = []
    clock = time.perf_counter
    for _ in range(n):
        t0 = clock()
        ep.send(payload)
        ep.recv_into(buf)
        samples.append((clock() - t0) * 1e6)
    samples.sort()
    return {"size": size, "iterations": n, "p50_us": statistics.median(samples),
            "p99_us": samples[min(len(samples) - 1, int(len(samples) * 0.99))], "max_us": samples[-1]}


def run_bw(ep, size: int, scale: float, window: int) -> dict:
    payload = bytes([0x51]) * max(size, 1)
    n = max(8, iterations(size, scale * 4))
    ack = bytearray(1)

    def burst(count):
        reqs = []
        for _ in range(count):
            reqs.append(ep.isend(payload))
            if len(reqs) >= window:
                reqs.pop(0).wait()
        for r in reqs:
            r.wait()
        ep.send(END_STREAM)
        ep.recv_into(ack)

    burst(max(2, n // 10))
    t0 = time.perf_counter()
    burst(n)
    elapsed = time.perf_counter() - t0
    return {"size": len(payload), "iterations": n, "MBps": len(payload) * n / elapsed / 1e6,
            "msgs_per_s": n / elapsed}


def spawn_peer(backend: str, knobs: dict):
    cmd = [sys.executable, "-m", "fabric.perf", "--server", "127.0.0.1:0", "--backend", backend]
    for k, v in knobs.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    address = proc.stdout.readline().strip()
    if not address:
        proc.wait()
        raise SystemExit("fabric-perf: the loopback peer did not start")
    return proc, address


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="fabric-perf", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-t", "--tests", default="lat,bw", help="comma list of lat, bw")
    ap.add_argument("-s", "--sizes", default="1-64M", help="'1-64M' or '8,4K,1M' (default 1-64M)")
    ap.add_argument("-b", "--backend", default=None, help="backend (default: $FABRIC_BACKEND or auto)")
    ap.add_argument("--server", metavar="ADDR", help="serve on ADDR instead of measuring")
    ap.add_argument("--connect", metavar="ADDR", help="measure against a running --server")
    ap.add_argument("--window", type=int, default=8, help="bw: messages in flight")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply iteration counts")
    ap.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    for k in KNOB_FLAGS:
        ap.add_argument(f"--{k.replace('_', '-')}", dest=k, default=None)
    args = ap.parse_args(argv)

    import fabric
    knobs = {k: getattr(args, k) for k in KNOB_FLAGS if getattr(args, k) is not None}
    fab = fabric.Fabric(args.backend, **knobs)
    if args.server:
        serve(fab, args.server, announce=lambda a: print(a, flush=True))
        return 0
    tests = [t.strip() for t in args.tests.split(",") if t.strip()]
    for t in tests:
        if t not in ("lat", "bw"):
            ap.error(f"unknown test {t!r} (choose lat, bw)")
    sizes = parse_sizes(args.sizes)
    proc = None
    address = args.connect
    if address is None:
        proc, address = spawn_peer(fab.name, knobs)
    results = {"tool": "fabric-perf", "backend": fab.name, "options": fab.options,
               "machine": {"host": platform.node(), "cpus": os.cpu_count(),
                           "python": platform.python_version(), "platform": platform.platform()},
               "fabric_version": fabric.__version__, "peer": address, "lat": [], "bw": []}
    try:
        ep = fab.connect(address, timeout=30)
        print(f"fabric-perf: backend {fab.name}, peer {address}, eager_limit {fab.options['eager_limit']}, "
              f"chunk_size {fab.options['chunk_size']}", flush=True)
        if "lat" in tests:
            print(f"{'lat size':>12} {'p50 us':>10} {'p99 us':>10} {'max us':>10}", flush=True)
            for size in sizes:
                r = run_lat(ep, size, args.scale)
                results["lat"].append(r)
                print(f"{size:>12} {r['p50_us']:>10.1f} {r['p99_us']:>10.1f} {r['max_us']:>10.1f}", flush=True)
        if "bw" in tests:
            print(f"{'bw size':>12} {'MB/s':>10} {'msg/s':>12}", flush=True)
            for size in sizes:
                r = run_bw(ep, size, args.scale, args.window)
                results["bw"].append(r)
                print(f"{size:>12} {r['MBps']:>10.1f} {r['msgs_per_s']:>12.0f}", flush=True)
        ep.close()
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
