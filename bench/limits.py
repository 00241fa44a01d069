"""What a connected peer can make a Fabric hold, with each limit and without
it (issue 15).

    python bench/limits.py [--backends tcp,ucx] [--connections 32] [--json PATH]

Per backend, each scenario runs twice in one run: with the limit as shipped
and with it set out of reach, which is how the engine behaved before the
limit existed:
  * backlog: --connections peers each send 16 MiB in 64 KiB messages that the
    application never receives; the receiving Fabric's buffered bytes
    (Fabric.buffered_bytes) and the growth of its resident memory, with
    total_recv_budget=64 MiB against 1 TiB (per-endpoint recv_budget stays
    at its 64 MiB default);
  * announcements: a peer told to ignore the receiver's limits
    (FABRIC_FAULT_INJECT=flood) announces 5000 rendezvous messages of 1 MiB
    that are never pulled; max_rendezvous=64 (default) against 1M: how many
    the receiver held, the bytes of records it kept, and when it cut the
    peer off;
  * connections: 2 x N connects at once against max_connections=N: how many
    got in, how many were turned away, and how long a refusal took.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fabric  # noqa: E402


def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / (1 << 20)


def settle(read, period=0.1, rounds=5, limit=30.0):
    """read() once it stopped changing (or after `limit` seconds)."""
    last, same, end = None, 0, time.monotonic() + limit
    while same < rounds and time.monotonic() < end:
        time.sleep(period)
        now = read()
        same = same + 1 if now == last else 0
        last = now
    return last


def backlog(name, connections, total_budget):
    a = fabric.Fabric(name)
    b = fabric.Fabric(name, total_recv_budget=total_budget)
    lst = b.listen()
    try:
        clients = [a.connect(lst.address, timeout=30) for _ in range(connections)]
        servers = [lst.accept(timeout=30) for _ in range(connections)]
        chunk = bytes(64 << 10)
        before = rss_mib()
        sends = [c.isend(chunk) for c in clients for _ in range(256)]     # 16 MiB each
        held = settle(lambda: b.buffered_bytes)
        grown = rss_mib() - before
        for s in servers:                   # drain, so every send completes
            for _ in range(256):
                s.recv(timeout=60)
        for r in sends:
            r.wait(timeout=60)
        return {"sent_mib": connections * 16, "buffered_mib": held / (1 << 20), "rss_growth_mib": grown}
    finally:
        a.close(linger=0)
        b.close(linger=0)


def announcements(name, max_rendezvous):
    os.environ["FABRIC_FAULT_INJECT"] = "flood"
    try:
        hostile = fabric.Fabric(name, eager_limit=4096)
    finally:
        del os.environ["FABRIC_FAULT_INJECT"]
    victim = fabric.Fabric(name, recv_budget=0, max_rendezvous=max_rendezvous)
    lst = victim.listen()
    try:
        client = hostile.connect(lst.address, timeout=30)
        server = lst.accept(timeout=30)
        payload = bytes(1 << 20)
        t = time.perf_counter()
        sends = [client.isend(payload) for _ in range(5000)]
        state = {"max": 0}

        def probe():
            eps = victim._worker._debug_state().get("endpoints", [])
            state["alive"] = bool(eps) and eps[0]["state"] == 2
            now = eps[0]["buffered"] if eps else 0
            state["max"] = max(state["max"], now)
            return (now, state["alive"])
        settle(probe, period=0.02)
        took = time.perf_counter() - t
        cut_off = not state["alive"]
        try:
            server.recv(timeout=0.5)
            error = ""
        except fabric.FabricError as e:
            error = f"{type(e).__name__}: {e}"
        held = state["max"]
        # (without a limit the sends wait for pulls that never come: the
        # close below fails them)
        return {"announced": 5000, "record_bytes_held_max": held, "cut_off": cut_off,
                "seconds_to_settle": took, "error": error[:120]}
    finally:
        hostile.close(linger=0)
        victim.close(linger=0)


def connections(name, n):
    async def main():
        a = fabric.Fabric(name, credits=4, send_buffers=2)
        b = fabric.Fabric(name, credits=4, send_buffers=2, max_connections=n, max_pending_handshakes=4 * n)
        lst = b.listen()
        times = []

        async def one():
            t = time.perf_counter()
            try:
                ep = await a.aconnect(lst.address, timeout=60)
                return ep
            except fabric.ConnectionLost as e:
                times.append(time.perf_counter() - t)
                return e
        try:
            results = await asyncio.gather(*[one() for _ in range(2 * n)])
            got = sum(isinstance(r, fabric.Endpoint) for r in results)
            return {"tried": 2 * n, "admitted": got, "turned_away": 2 * n - got,
                    "listener_connections": lst.connections,
                    "refusal_median_ms": statistics.median(times) * 1e3 if times else None}
        finally:
            a.close(linger=0)
            b.close(linger=0)
    return asyncio.run(main())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", default="tcp,ucx")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--json")
    args = ap.parse_args()
    out = {}
    for name in args.backends.split(","):
        row = {"backlog": {"limit_64MiB": backlog(name, args.connections, 64 << 20),
                           "no_limit": backlog(name, args.connections, 1 << 40)},
               "announcements": {"max_rendezvous_64": announcements(name, 64),
                                 "no_limit": announcements(name, 1 << 20)},
               "connections": connections(name, 100)}
        out[name] = row
        print(f"{name}: {json.dumps(row)}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
