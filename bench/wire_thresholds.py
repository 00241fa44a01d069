"""Thresholds across the two-guest wire, with netem delay and without:
adaptive (today's defaults, free to adapt) against the same defaults fixed
(adapt=0) against fixed chunk settings (fabric-perf --tune's grid).

    python tools/softroce.py --guests 2 -- sh -c "FABRIC_WIRE_AGENT=\\$FABRIC_PEER_ADDR \\
        .venv/bin/python bench/wire_thresholds.py --backend tcp --delay-ms 0,1; \\
        .venv/bin/python tests/wire_agent.py quit" ::: .venv/bin/python tests/wire_agent.py serve

Runs in the first guest; the second runs tests/wire_agent.py, which starts
one fabric-perf server per configuration there (same knobs on both ends).
netem delays what leaves each guest by DELAY (a round trip gains 2 x DELAY);
every configuration is measured once per round, rounds interleaved, medians
and spread printed. Figures per size: bw (one-way MB/s, --window messages
in flight), bw1 (one message at a time: a blocking send loop) and lat (round
trip p50, us). --json keeps every round.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

DEV = os.environ.get("FABRIC_WIRE_DEV", "eth0")
GRID_CHUNKS = [1 << 20, 4 << 20, 16 << 20]
GRID_WINDOWS = [2, 4, 8, 16]


def netem(delay_ms: float) -> None:
    """Both guests' egress; the far one first (its agent is across the link)."""
    from wire_agent import run_remote
    if delay_ms > 0:
        argv = ["tc", "qdisc", "replace", "dev", DEV, "root", "netem", "delay", f"{delay_ms}ms", "limit", "100000"]
    else:
        argv = ["sh", "-c", f"tc qdisc del dev {DEV} root 2>/dev/null; true"]
    code, _, err = run_remote(argv, timeout=30)
    if code != 0:
        raise SystemExit(f"wire_thresholds: remote {' '.join(argv)}: {err.strip()}")
    subprocess.run(argv, check=True, timeout=30)


def start_server(backend: str, knobs: dict):
    from fabric.options import env_name
    from wire_agent import RemoteProcess
    env = {env_name(k): str(v) for k, v in knobs.items()}
    env["FABRIC_PROFILE"] = "none"
    host = os.environ["FABRIC_PEER_ADDR"]
    proc = RemoteProcess([sys.executable, "-m", "fabric.perf", "--server", f"{host}:0", "--backend", backend], env)
    address = proc.read_line(120).strip()
    if not address:
        raise SystemExit(f"wire_thresholds: the {backend} server across the wire did not start")
    return proc, address


def measure_round(eps: dict, sizes: list[int], window: int, scale: float) -> dict:
    from fabric.perf import measure
    out = {}
    for name, (fab, ep) in eps.items():
        figures = {}
        for s in sizes:
            figures[f"bw{s}"] = measure.run_bw(ep, s, scale, window=window)["MBps"]
            figures[f"bw1_{s}"] = measure.run_bw(ep, s, scale, window=1)["MBps"]
            figures[f"lat{s}"] = measure.run_lat(ep, s, scale)["p50_us"]
        out[name] = figures
    return out


def one_delay(args, delay_ms: float, configs: dict) -> dict:
    import fabric
    netem(delay_ms)
    servers, eps = [], {}
    try:
        for name, knobs in configs.items():
            proc, address = start_server(args.backend, knobs)
            servers.append(proc)
            fab = fabric.Fabric(args.backend, **knobs)
            eps[name] = (fab, fab.connect(address, timeout=60))
        rounds = []
        t0 = time.monotonic()
        for r in range(args.rounds):
            rounds.append(measure_round(eps, args.sizes, args.window, args.scale))
            print(f"  delay {delay_ms} ms: round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        links = {name: ep.link for name, (fab, ep) in eps.items()}
        return {"delay_ms": delay_ms, "rounds": rounds, "links": links, "seconds": time.monotonic() - t0}
    finally:
        for fab, ep in eps.values():
            try:
                ep.close(linger=1)
            except Exception:
                pass
        for proc in servers:
            proc.kill()
            proc.close()
        netem(0)


def report(res: dict, sizes: list[int], window: int) -> None:
    names = list(res["rounds"][0])
    print(f"\n{res['delay_ms']} ms netem delay each way; {len(res['rounds'])} rounds interleaved "
          f"({res['seconds']:.0f} s); median (min-max) over rounds")
    cols = [(f"bw{s}", f"bw {s >> 10}K w{window} MB/s") for s in sizes] + \
           [(f"bw1_{s}", f"bw {s >> 10}K w1 MB/s") for s in sizes] + [(f"lat{s}", f"lat {s >> 10}K us") for s in sizes]
    print(f"{'config':>16}" + "".join(f"{title:>22}" for _, title in cols))
    for name in names:
        cells = []
        for key, _ in cols:
            v = [r[name][key] for r in res["rounds"]]
            cells.append(f"{statistics.median(v):.0f} ({min(v):.0f}-{max(v):.0f})")
        print(f"{name:>16}" + "".join(f"{c:>22}" for c in cells))
    for name, link in res["links"].items():
        if name == "adaptive" or link["changes"]:
            rtt = f"{link['rtt_us']:.0f} us" if link["rtt_us"] else "-"
            print(f"  {name}: rtt {rtt}, eager {link['eager_limit']}, chunk {link['chunk_size'] >> 10} KiB x "
                  f"{link['chunks_in_flight']} ({link['why']})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="tcp")
    ap.add_argument("--delay-ms", default="0,1", help="comma list (default 0,1)")
    ap.add_argument("--sizes", default="64K,16M")
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scale", type=float, default=0.1)
    ap.add_argument("--grid", action="store_true", help="add the fixed chunk_size x chunks_in_flight grid")
    ap.add_argument("--config", action="append", default=[], metavar="NAME=k=v,k=v",
                    help="another configuration, fixed (adapt=0 unless given)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not os.environ.get("FABRIC_WIRE_AGENT"):
        raise SystemExit("wire_thresholds: run in the first guest of tools/softroce.py --guests 2, "
                         "with FABRIC_WIRE_AGENT set (see the docstring)")
    from fabric.perf.cli import parse_sizes
    args.sizes = parse_sizes(args.sizes)
    configs = {"adaptive": {}, "fixed defaults": {"adapt": 0}}
    if args.grid:
        for c in GRID_CHUNKS:
            for w in GRID_WINDOWS:
                configs[f"{c >> 20}M x {w}"] = {"adapt": 0, "chunk_size": c, "chunks_in_flight": w}
    for text in args.config:
        name, _, rest = text.partition("=")
        knobs = {"adapt": 0}
        for kv in filter(None, rest.split(",")):
            k, _, v = kv.partition("=")
            knobs[k] = v
        configs[name] = knobs
    results = []
    for d in (float(x) for x in args.delay_ms.split(",")):
        res = one_delay(args, d, configs)
        report(res, args.sizes, args.window)
        results.append(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "configs": configs, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
