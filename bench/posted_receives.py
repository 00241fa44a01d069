"""Receiver-posted buffers against the pull, in the request/response loop a
user writes, side by side.

    python bench/posted_receives.py [--backend tcp] [--sizes 64K,256K,1M,4M,16M] [--request SIZE]
                                    [--rounds 5] [--json out.json]

Each side, blocking: the client `send(request)` then `recv_into(reply)`; the
server `recv_into(request)` then `send(reply)`, the reply SIZE bytes, the
request as large (default) or --request bytes (an RPC fetching a tensor). A receive
that waits before its message is sent offers its buffer (POST) and the
sender writes into it (tcp WRITE, verbs RDMA WRITE); with posted_receives=0
the same loop goes by announcement and pull. Both contenders run in one
process pair per round, rounds interleave them; medians of the round-trip
time, the ratio pull / posted (above 1: posting is faster), and how many
messages each way were written into posts (a post arriving after the
sender framed its message is not used).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import fabric  # noqa: E402

BUDGET = 256 << 20       # bytes each way per measurement


def parse_size(text):
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def human(n):
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def iterations(size):
    return max(20, min(2000, BUDGET // size))


def serve(backend, posted, sizes, request, queue):
    fab = fabric.Fabric(backend, posted_receives=posted)
    lst = fab.listen("127.0.0.1:0" if backend != "verbs" else os.environ.get("FABRIC_BENCH_ADDR", "192.0.2.1:0"))
    queue.put(lst.address)
    ep = lst.accept(timeout=60)
    for size in sizes:
        buf = bytearray(size)
        reply = memoryview(bytearray(os.urandom(size)))
        for _ in range(iterations(size) + 5):
            n = ep.recv_into(buf, timeout=120)
            ep.send(memoryview(buf)[:n] if request is None else reply)
    queue.put(ep.stats()["puts_received"])
    ep.recv(timeout=60)
    fab.close()


def one_round(backend, posted, sizes, request):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    server = ctx.Process(target=serve, args=(backend, posted, sizes, request, queue))
    server.start()
    fab = fabric.Fabric(backend, posted_receives=posted)
    ep = fab.connect(queue.get(timeout=60), timeout=60)
    out = {}
    for size in sizes:
        data = os.urandom(size if request is None else request)
        buf = bytearray(size)
        n = iterations(size)
        for _ in range(5):                  # warm-up
            ep.send(data)
            ep.recv_into(buf, timeout=120)
        puts_before = ep.stats()["puts_received"]
        started = time.perf_counter()
        for _ in range(n):
            ep.send(data)
            ep.recv_into(buf, timeout=120)
        elapsed = time.perf_counter() - started
        assert request is not None or bytes(buf) == data
        out[size] = {"rtt_us": elapsed / n * 1e6, "replies_put": (ep.stats()["puts_received"] - puts_before) / n}
    requests_put = queue.get(timeout=60)
    ep.send(b"bye")
    server.join(60)
    fab.close()
    out["requests_put"] = requests_put
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="tcp")
    ap.add_argument("--sizes", default="64K,256K,1M,4M,16M")
    ap.add_argument("--request", help="request size (default: as large as the reply)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    request = parse_size(args.request) if args.request else None
    runs = {1: [], 0: []}
    for r in range(args.rounds):
        for posted in ((1, 0) if r % 2 == 0 else (0, 1)):
            runs[posted].append(one_round(args.backend, posted, sizes, request))
    shape = "SIZE each way" if request is None else f"a {human(request)} request, a SIZE reply"
    print(f"{args.backend}: blocking request/response, {shape}; round trip, median of "
          f"{args.rounds} rounds (min-max); pull/posted > 1: posted is faster")
    print(f"{'size':>6} {'posted us':>18} {'pull us':>18} {'pull/posted':>12} {'replies put':>12}")
    report = {"backend": args.backend, "rounds": args.rounds, "request": request, "sizes": {}}
    for size in sizes:
        p = [run[size]["rtt_us"] for run in runs[1]]
        q = [run[size]["rtt_us"] for run in runs[0]]
        ratios = [b / a for a, b in zip(p, q)]
        put = statistics.median(run[size]["replies_put"] for run in runs[1])
        print(f"{human(size):>6} {statistics.median(p):>9.1f} ({min(p):.0f}-{max(p):.0f}) "
              f"{statistics.median(q):>8.1f} ({min(q):.0f}-{max(q):.0f}) "
              f"{statistics.median(ratios):>7.2f} ({min(ratios):.2f}-{max(ratios):.2f}) {put:>8.0%}")
        report["sizes"][human(size)] = {"posted_us": p, "pull_us": q, "ratio": ratios, "replies_put": put}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
