"""fabric/ucx beside ucx_perftest (C, same UCX, same UCX_TLS) and grpcio, one run.

    python bench/ucx_compare.py [--tls sm] [--sizes 8,...,64M] [--json FILE]

ucx_perftest reports one-way latency (round trip / 2): it is doubled here so
every latency column is a round trip. fabric runs through fabric-perf's own
functions (two processes, loopback). grpcio: unary round trip and client
streaming, bytes payloads, message limits raised.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def perftest_paths():
    import libucx
    base = os.path.dirname(libucx.__file__)
    return os.path.join(base, "bin", "ucx_perftest"), os.path.join(base, "lib")


def ucx_perftest(test, size, iters, tls, port):
    """One ucx_perftest client/server pair; returns the final row as floats:
    (p50 latency us, avg latency us, avg bandwidth MB/s of 10^6 bytes, msg rate)."""
    exe, lib = perftest_paths()
    env = dict(os.environ, LD_LIBRARY_PATH=lib, UCX_TLS=tls)
    server = subprocess.Popen([exe, "-p", str(port)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):
            time.sleep(0.05)
            out = subprocess.run([exe, "127.0.0.1", "-p", str(port), "-t", test, "-s", str(size),
                                  "-n", str(iters), "-f"], env=env, capture_output=True, text=True,
                                 timeout=300)
            if out.returncode == 0:
                break
        rows = [l for l in out.stdout.splitlines() if re.match(r"^\s+\d+\s+[\d.]+", l)]
        if not rows:
            raise RuntimeError(f"ucx_perftest {test} failed: {out.stdout[-500:]} {out.stderr[-500:]}")
        nums = [float(x) for x in rows[-1].split()]
        # ucx_perftest's MB is 2^20 bytes; every MB/s here is 10^6 bytes/s
        return {"p50_us": nums[1], "avg_us": nums[2], "MBps": nums[4] * (1 << 20) / 1e6, "msgs": nums[6]}
    finally:
        server.kill()
        server.wait()


def fabric_runs(sizes, tls, rounds, stream_size, stream_count):
    os.environ["UCX_TLS"] = tls
    import fabric
    from fabric.perf import cli, measure
    fab = fabric.Fabric("ucx")
    proc, address = cli.spawn_peer("ucx", {})
    ep = fab.connect(address, timeout=30)
    lat = {}
    for size in sizes:
        lat[size] = statistics.median(measure.run_lat(ep, size, 0.3)["p50_us"] for _ in range(rounds))
    bw = statistics.median(measure.run_bw(ep, stream_size, 0.3, 8)["MBps"] for _ in range(rounds))
    ep.close()
    proc.kill()
    proc.wait()
    return lat, bw


def grpc_runs(sizes, rounds, stream_size, stream_count):
    from bench.p2p import GrpcClient, start_server, iterations
    proc, addr = start_server("grpc")
    c = GrpcClient(addr)
    lat = {}
    for size in sizes:
        payload = os.urandom(size)
        n = max(5, iterations(size) // 4)
        c.rtt(payload, max(2, n // 10))
        lat[size] = statistics.median(c.rtt(payload, n) * 1e6 for _ in range(rounds))
    payload = os.urandom(stream_size)
    c.stream(payload, 2)
    bw = statistics.median(stream_size * stream_count / c.stream(payload, stream_count) / 1e6
                           for _ in range(rounds))
    c.close()
    proc.kill()
    proc.wait()
    return lat, bw


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tls", default="sm")
    ap.add_argument("--sizes", default=",".join(str(1 << k) for k in range(3, 27)))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stream-size", type=int, default=16 << 20)
    ap.add_argument("--stream-count", type=int, default=16)
    ap.add_argument("--no-grpc", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    port = 13500 + os.getpid() % 1000
    perf_lat, perf_bw = {}, {}
    for size in sizes:
        iters = max(20, min(20000, (512 << 20) // max(size, 64)))
        perf_lat[size] = 2 * statistics.median(
            ucx_perftest("tag_lat", size, iters, args.tls, port)["p50_us"] for _ in range(args.rounds))
        perf_bw[size] = statistics.median(
            ucx_perftest("tag_bw", size, iters, args.tls, port)["MBps"] for _ in range(args.rounds))
    stream_perftest = statistics.median(
        ucx_perftest("tag_bw", args.stream_size, 200, args.tls, port)["MBps"] for _ in range(args.rounds))
    fab_lat, fab_bw = fabric_runs(sizes, args.tls, args.rounds, args.stream_size, args.stream_count)
    if not args.no_grpc:
        g_lat, g_bw = grpc_runs(sizes, args.rounds, args.stream_size, args.stream_count)
    else:
        g_lat, g_bw = {}, None
    print(f"UCX_TLS={args.tls}; round trips in us (ucx_perftest tag_lat x2); tag_bw in MB/s")
    print(f"{'size':>10} {'fabric rtt':>11} {'perftest rtt':>13} {'grpc rtt':>10} {'fab/grpc':>9} {'perftest bw':>12}")
    for s in sizes:
        g = g_lat.get(s)
        print(f"{s:>10} {fab_lat[s]:>11.1f} {perf_lat[s]:>13.2f} {g if g else float('nan'):>10.1f} "
              f"{(fab_lat[s] / g) if g else float('nan'):>9.3f} {perf_bw[s]:>12.0f}")
    print(f"one-way {args.stream_size} B: fabric {fab_bw:.0f} MB/s, ucx_perftest tag_bw {stream_perftest:.0f} MB/s "
          f"(ratio {fab_bw / stream_perftest:.2f})" + (f", grpcio {g_bw:.0f} MB/s (ratio {fab_bw / g_bw:.2f})" if g_bw else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tls": args.tls, "fabric_rtt_us": fab_lat, "perftest_rtt_us": perf_lat,
                       "perftest_bw_MBps": perf_bw, "grpc_rtt_us": g_lat, "fabric_stream_MBps": fab_bw,
                       "perftest_stream_MBps": stream_perftest, "grpc_stream_MBps": g_bw,
                       "command": " ".join(sys.argv)}, f, indent=2)


if __name__ == "__main__":
    main()
