"""fabric-perf: latency, bandwidth, message rate and RPC of fabric backends.

    fabric-perf                                # lat and bw, 1 B..64 MiB, default backend, own peer on loopback
    fabric-perf -t lat,rate -s 8,4K,1M         # chosen tests and sizes
    fabric-perf -b tcp,ucx --protocol eager,rendezvous --plot crossover.png
    fabric-perf -t rpc --rpc 64:1M,1M:64       # request:response sizes
    fabric-perf --server 0.0.0.0:7000          # serve; on another host: fabric-perf --connect HOST:7000
    fabric-perf --tune                         # measure this host, write the tuning profile
    fabric-perf --from a.json b.json --plot ab.png   # plot earlier results together
    fabric-perf --list-backends                # which backends work here, and which auto picks

Tests: lat (round-trip time: SIZE bytes sent, the peer echoes SIZE bytes back;
each sample runs from send() until the echo is received, not halved;
p50/p99/max in microseconds), bw (one-way stream, a window of messages in
flight, timed until the peer confirms it has them all; MB/s = 10^6 bytes/s),
rate (small messages per second from blocking sends, with and without
coalescing), rpc (request/response of different sizes). Sizes are bytes;
K, M, G are 2^10, 2^20, 2^30. Iterations scale with size; warm-up is
excluded. The first line names the backend and why it was chosen. --protocol
forces eager (eager_limit raised to 1 MiB; larger messages still go by rendezvous) or
rendezvous (eager_limit 0); the protocol each size actually took is recorded.
Knob flags (--eager-limit, --chunk-size, ...) apply to both sides; with
--connect they apply to this side only (the server keeps its own).
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
import time

from fabric.perf import measure, wire
from fabric.perf.common import EAGER_MAX, machine_info, pin_self, spawn_peer, versions  # noqa: F401 (bench/ uses cli.spawn_peer)

KNOB_FLAGS = ("eager_limit", "chunk_size", "chunks_in_flight", "coalesce_limit", "coalesce", "credits",
              "spin_us", "spin_max_us", "native_min")
TESTS = ("lat", "bw", "rate", "rpc")
PROTOCOLS = ("auto", "eager", "rendezvous")
SCHEMA = 1


def parse_sizes(text: str) -> list[int]:
    """'1-64M' (powers of two), or a comma list with K/M/G suffixes; 0 allowed in lists."""
    from fabric.options import parse_value

    def one(t):
        t = t.strip()
        return 0 if t == "0" else parse_value("max_message", t)

    if "-" in text and "," not in text:
        lo, hi = (one(t) for t in text.split("-", 1))
        if lo < 1 or hi < lo:
            raise ValueError(f"bad size range {text!r} (want LO-HI with 1 <= LO <= HI)")
        sizes, s = [], 1
        while s <= hi:
            if s >= lo:
                sizes.append(s)
            s *= 2
        return sizes
    sizes = [one(t) for t in text.split(",") if t.strip()]
    if not sizes:
        raise ValueError(f"no sizes in {text!r}")
    return sizes


def parse_rpc(text: str | None, sizes: list[int]) -> list[tuple[int, int]]:
    """'REQ:RESP,...'; default: a 64-byte request fetching each size, and each
    size pushed with a 64-byte answer."""
    if not text:
        return [(64, s) for s in sizes] + [(s, 64) for s in sizes]
    pairs = []
    for item in text.split(","):
        if ":" not in item:
            raise ValueError(f"rpc size {item!r} is not REQ:RESP")
        a, b = item.split(":", 1)
        pairs.append(tuple(parse_sizes(x)[0] for x in (a, b)))
    return pairs


def protocol_knobs(protocol: str, knobs: dict) -> dict:
    out = dict(knobs)
    if protocol == "eager":
        out.setdefault("eager_limit", EAGER_MAX)
    elif protocol == "rendezvous":
        out["eager_limit"] = 0
    return out


class Progress:
    """One self-rewriting status line on a terminal; silent otherwise."""

    def __init__(self, total: int, stream=None):
        self.total, self.done, self.stream = total, 0, stream or sys.stderr
        self.live = self.stream.isatty()
        self.started = time.monotonic()

    def show(self, what: str):
        if self.live:
            pct = 100.0 * self.done / max(self.total, 1)
            self.stream.write(f"\r\033[K[{pct:5.1f}% {time.monotonic() - self.started:6.1f}s] {what}")
            self.stream.flush()

    def step(self):
        self.done += 1

    def clear(self):
        if self.live:
            self.stream.write("\r\033[K")
            self.stream.flush()


THRESHOLDS = ("eager_limit", "chunk_size", "chunks_in_flight", "coalesce_limit", "coalesce", "credits",
              "native_min", "spin_us", "spin_max_us")


class Run:
    """One backend with one protocol setting: a Fabric, its peer, an endpoint."""

    def __init__(self, backend: str | None, protocol: str, knobs: dict, connect: str | None, pin: bool = False):
        import fabric
        self.protocol = protocol
        self.knobs = protocol_knobs(protocol, knobs)
        self.fab = fabric.Fabric(backend, **self.knobs)
        self.backend = self.fab.name
        self.label = f"{self.backend}/{protocol}"
        self.proc = None
        self.address = connect
        if connect is None:
            self.proc, self.address = spawn_peer(self.backend, self.knobs, pin=pin)
        self.ep = self.fab.connect(self.address, timeout=30)

    def reconnect(self, **overrides):
        """A fresh endpoint (to a new Fabric if knobs are overridden); the
        previous one is closed first because the peer serves one at a time."""
        import fabric
        self.ep.close(linger=1)
        if overrides:
            self.fab = fabric.Fabric(self.backend, **dict(self.knobs, **overrides))
        self.ep = self.fab.connect(self.address, timeout=30)

    def describe(self) -> dict:
        opts = self.fab.options
        thresholds = {k: opts[k] for k in THRESHOLDS if k in opts}
        thresholds["eager_limit_effective"] = self.ep.eager_limit
        return {"label": self.label, "backend": self.backend, "protocol": self.protocol,
                "peer": self.address, "spawned_peer": self.proc is not None,
                "options": dict(opts), "thresholds": thresholds,
                "lat": [], "bw": [], "rate": [], "rpc": []}

    def protocol_for(self, size: int) -> str:
        return self.ep.protocol_for(size)[0]

    def close(self):
        try:
            self.ep.close(linger=1)
        except Exception:
            pass
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


# What each table's figures are (fabric.perf.measure), printed above it.
TEST_NOTES = {
    "lat": "round-trip time in us: SIZE bytes out, the peer echoes them back (not halved)",
    "bw": "one-way, {window} messages in flight, until the peer confirms receipt; MB/s = 10^6 B/s",
    "rate": "messages/s from blocking send()s, until the peer confirms receipt; no-coal: coalesce=0",
    "rpc": "a REQ-byte request, a RESP-byte response; latency per call in us",
}
HEADERS = {
    "lat": f"{'size (B)':>10} {'proto':>10} {'p50 (us)':>10} {'p99 (us)':>10} {'max (us)':>10}",
    "bw": f"{'size (B)':>10} {'proto':>10} {'MB/s':>10} {'msg/s':>12}",
    "rate": f"{'size (B)':>10} {'msg/s':>12} {'no-coal':>12} {'gain':>6} {'MB/s':>9}",
    "rpc": f"{'req (B)':>10} {'resp (B)':>10} {'p50 (us)':>10} {'p99 (us)':>10} {'calls/s':>10}",
}


def human_size(n) -> str:
    from fabric.info import human_size as _human
    return _human(n)


def print_table(test: str, label: str, rows: list[dict], out=None):
    if not rows:
        return
    out = out or sys.stdout
    note = TEST_NOTES[test].format(window=rows[0].get("window", "?"))
    print(f"\n{label} {test}: {note}", file=out)
    print("  " + HEADERS[test], file=out)
    for r in rows:
        print(format_row(test, r), file=out)
    out.flush()


def format_row(test: str, r: dict) -> str:
    pad = "  "
    if test == "lat":
        return (f"{pad}{human_size(r['size']):>10} {r['protocol']:>10} {r['p50_us']:>10.1f} {r['p99_us']:>10.1f} "
                f"{r['max_us']:>10.1f}")
    if test == "bw":
        return f"{pad}{human_size(r['size']):>10} {r['protocol']:>10} {r['MBps']:>10.1f} {r['msgs_per_s']:>12.0f}"
    if test == "rate":
        nc = r.get("msgs_per_s_no_coalescing")
        nc_text = f"{nc:.0f}" if nc else "-"
        gain = f"{r['coalescing_gain']:.2f}x" if nc else "-"
        return f"{pad}{human_size(r['size']):>10} {r['msgs_per_s']:>12.0f} {nc_text:>12} {gain:>6} {r['MBps']:>9.1f}"
    return (f"{pad}{human_size(r['request']):>10} {human_size(r['response']):>10} {r['p50_us']:>10.1f} "
            f"{r['p99_us']:>10.1f} {r['calls_per_s']:>10.0f}")


def backend_reason(requested: str | None) -> str:
    """Why a Fabric(requested) got its backend, for the `backend:` line."""
    from fabric import backends
    if requested is None:
        env = os.environ.get("FABRIC_BACKEND")
        if env and env.strip().lower() != "auto":
            return f"FABRIC_BACKEND={env}"
    elif requested.strip().lower() != "auto":
        if requested.strip().lower() == "softroce":
            return "-b softroce: verbs on an rxe device"
        return f"-b {requested}"
    reasons = backends.auto_reasons()
    return "auto: " + ("; ".join(reasons) if reasons else "the first backend it tries")


def measure_runs(args, tests, sizes, rpc_pairs, knobs) -> dict:
    backends = [b for b in (args.backend or "").split(",") if b] or [None]
    protocols = [p for p in args.protocol.split(",") if p]
    rate_sizes = [s for s in sizes if s <= args.rate_max]
    per_run = sum(len(sizes) for t in tests if t in ("lat", "bw")) + \
        (len(rate_sizes) if "rate" in tests else 0) + (len(rpc_pairs) if "rpc" in tests else 0)
    progress = Progress(per_run * len(backends) * len(protocols))
    results = {"tool": "fabric-perf", "schema": SCHEMA,
               "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "command": ["fabric-perf"] + list(args.argv), "machine": machine_info(),
               "versions": versions(), "tests": tests, "runs": []}
    if args.pin:
        pin_self()
    for backend, protocol in itertools.product(backends, protocols):
        run = Run(backend, protocol, knobs, args.connect, pin=args.pin)
        rec = run.describe()
        rec["backend_reason"] = backend_reason(backend)
        results["runs"].append(rec)
        print(f"backend: {run.backend} ({rec['backend_reason']})", flush=True)
        th = rec["thresholds"]
        print(f"fabric-perf: {run.label}, peer {run.address}, eager_limit {human_size(th['eager_limit_effective'])}, "
              f"chunk_size {human_size(th['chunk_size'])} x {th['chunks_in_flight']} in flight"
              f" ({'adapting ' + ', '.join(run.fab.adapting) + ' to the link' if run.fab.adapting else 'fixed'})",
              flush=True)
        try:
            for test in tests:
                if test == "rpc":
                    items = rpc_pairs
                elif test == "rate":
                    items = rate_sizes
                else:
                    items = sizes
                for item in items:
                    progress.show(f"{run.label} {test} {item if test != 'rpc' else '%d:%d' % item}")
                    if test == "lat":
                        r = measure.run_lat(run.ep, item, args.scale)
                    elif test == "bw":
                        r = measure.run_bw(run.ep, item, args.scale, args.window)
                    elif test == "rate":
                        r = measure.run_rate(run.ep, item, args.scale)
                    else:
                        r = measure.run_rpc(run.ep, item[0], item[1], args.scale)
                    if test in ("lat", "bw", "rate"):
                        r["protocol"] = run.protocol_for(item)
                    rec[test].append(r)
                    progress.step()
                    progress.clear()
                    if args.stream_rows:
                        print(f"{run.label} {test}: {format_row(test, r).strip()}", flush=True)
                if test == "rate" and items and not args.no_baseline:
                    rate_without_coalescing(run, rec["rate"], args, progress)
                print_table(test, run.label, rec[test])
            rec["link"] = run.ep.link
            print(describe_link(rec["link"]), flush=True)
        finally:
            run.close()
    progress.clear()
    return results


def describe_link(link: dict) -> str:
    """One line: the link as the endpoint measured it and the thresholds it
    used at the end (Endpoint.link)."""
    rtt = f"{link['rtt_us']:.0f} us" if link["rtt_us"] is not None else "not measured"
    bw = f"{link['bandwidth_MBps']:.0f} MB/s" if link["bandwidth_MBps"] is not None else "no rendezvous sample"
    return (f"fabric-perf: link round trip {rtt}, bandwidth {bw}; thresholds at the end: eager_limit "
            f"{human_size(link['eager_limit'])}, chunk_size {human_size(link['chunk_size'])} x "
            f"{link['chunks_in_flight']} in flight ({link['why']})")


def rate_without_coalescing(run, rows: list[dict], args, progress):
    """The same rate sizes from a Fabric with coalesce=0, on a fresh endpoint."""
    run.reconnect(coalesce=0)
    try:
        for r in rows:
            progress.show(f"{run.label} rate {r['size']} without coalescing")
            base = measure.run_rate(run.ep, r["size"], args.scale)
            r["msgs_per_s_no_coalescing"] = base["msgs_per_s"]
            r["coalescing_gain"] = r["msgs_per_s"] / base["msgs_per_s"]
        progress.clear()
    finally:
        run.reconnect(coalesce=run.knobs.get("coalesce", 1))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fabric-perf", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-t", "--tests", default="lat,bw", help="comma list of " + ", ".join(TESTS))
    ap.add_argument("-s", "--sizes", default="1-64M", help="'1-64M' (powers of two) or '8,4K,1M' (default 1-64M)")
    ap.add_argument("-b", "--backend", default=None,
                    help="backend or comma list (default: $FABRIC_BACKEND or auto)")
    ap.add_argument("--protocol", default="auto", help="auto, eager, rendezvous, or a comma list")
    ap.add_argument("--rpc", metavar="REQ:RESP,...", default=None, help="rpc sizes (default 64:S and S:64 per size)")
    ap.add_argument("--rate-max", type=lambda t: parse_sizes(t)[0], default=65536,
                    help="rate: largest size measured (default 64K)")
    ap.add_argument("--no-baseline", action="store_true", help="rate: skip the run without coalescing")
    ap.add_argument("--server", metavar="ADDR", help="serve on ADDR instead of measuring")
    ap.add_argument("--connect", metavar="ADDR", help="measure against a running --server")
    ap.add_argument("--window", type=int, default=8, help="bw: messages in flight (default 8)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply iteration counts")
    ap.add_argument("--json", metavar="FILE", help="write every figure, the machine and versions as JSON")
    ap.add_argument("--plot", metavar="FILE", help="write a PNG: latency and bandwidth against size, log axes")
    ap.add_argument("--from", dest="from_files", nargs="+", metavar="JSON",
                    help="do not measure: load earlier --json results (for --plot)")
    ap.add_argument("--pin", action="store_true",
                    help="pin this process and its loopback peer to two different CPUs (steadier figures)")
    ap.add_argument("--stream-rows", action="store_true", help="also print each row as it is measured")
    ap.add_argument("--tune", action="store_true", help="measure this host and write the tuning profile")
    ap.add_argument("--profile", metavar="FILE", help="--tune: where to write (default: see fabric.options)")
    ap.add_argument("--dry-run", action="store_true", help="--tune: measure and print, write nothing")
    ap.add_argument("--list-backends", action="store_true",
                    help="print every backend, whether it is usable here and why, and which auto picks")
    import fabric
    ap.add_argument("--version", action="version", version=f"fabric-perf {fabric.__version__}",
                    help="print the version and exit")
    from fabric.options import HELP, KNOBS, env_name
    knobs = ap.add_argument_group(
        "engine knobs", "Applied to both sides (this side only with --connect). SIZE takes K, M, G.\n"
        "A knob not given keeps its value from the environment, the tuning profile or the\n"
        "backend's default (python -m fabric info shows each value and its source).")
    for k in KNOB_FLAGS:
        knobs.add_argument(f"--{k.replace('_', '-')}", dest=k, default=None,
                           metavar={"size": "SIZE", "int": "N", "float": "X"}[KNOBS[k][0]],
                           help=f"{HELP[k]} (env {env_name(k)})")
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    args.argv = argv
    from fabric.options import parse_value
    try:
        knobs = {k: parse_value(k, getattr(args, k)) for k in KNOB_FLAGS if getattr(args, k) is not None}
    except ValueError as e:
        ap.error(str(e))
    tests = [t.strip() for t in args.tests.split(",") if t.strip()]
    for t in tests:
        if t not in TESTS:
            ap.error(f"unknown test {t!r} (choose from {', '.join(TESTS)})")
    for p in args.protocol.split(","):
        if p and p not in PROTOCOLS:
            ap.error(f"unknown protocol {p!r} (choose from {', '.join(PROTOCOLS)})")
    try:
        sizes = parse_sizes(args.sizes)
        rpc_pairs = parse_rpc(args.rpc, sizes)
    except ValueError as e:
        ap.error(str(e))
    if args.window < 1:
        ap.error("--window must be at least 1")
    if args.scale <= 0:
        ap.error("--scale must be positive")
    if args.list_backends:
        from fabric import info
        data = info.gather_backends()
        print(f"backends (auto picks {data['auto']['picks'] or 'nothing usable'})")
        print(info.backend_table(data))
        return 0
    if args.plot and not args.server and not args.tune:
        from fabric.perf import plot
        plot.require()             # before measuring: minutes of figures would be lost at the end

    if args.server:
        import fabric
        if args.backend and "," in args.backend:
            ap.error("--server takes one backend")
        fab = fabric.Fabric(args.backend, **knobs)
        wire.serve(fab, args.server, announce=lambda a: print(a, flush=True))
        return 0
    if args.tune:
        from fabric.perf import tune
        if args.backend and "," in args.backend:
            ap.error("--tune takes one backend")
        return tune.main(args.backend, knobs, profile=args.profile, dry_run=args.dry_run,
                         scale=args.scale, json_path=args.json)
    if args.from_files:
        results = merge_results(args.from_files)
    else:
        results = measure_runs(args, tests, sizes, rpc_pairs, knobs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"fabric-perf: wrote {args.json}")
    if args.plot:
        from fabric.perf import plot
        plot.write(results, args.plot)
        print(f"fabric-perf: wrote {args.plot}")
    return 0


def merge_results(paths: list[str]) -> dict:
    merged = None
    for p in paths:
        with open(p) as f:
            doc = json.load(f)
        if not isinstance(doc, dict) or doc.get("tool") != "fabric-perf" or doc.get("schema") != SCHEMA:
            raise SystemExit(f"fabric-perf: {p} is not a fabric-perf result (schema {SCHEMA})")
        if merged is None:
            merged = doc
        else:
            merged["runs"].extend(doc["runs"])
    return merged
