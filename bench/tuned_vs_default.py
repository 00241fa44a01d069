"""Is the tuned profile at least as fast as the defaults at every size?

    python bench/tuned_vs_default.py --backend tcp --profile ~/.config/fabric/tuning.json \
        [--sizes 1-64M] [--rounds 3] [--json out.json]

Three configurations run in the same process, each with its own loopback
peer, interleaved round by round: the defaults, the tuned profile, and the
defaults again (an A/A control: its ratio to the first shows how far two
identical configurations drift apart here, i.e. the noise). Per size the
median round trip (lat) and streaming bandwidth (bw), and the ratios to the
defaults (lat: < 1 is faster; bw: > 1 is faster).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="tcp")
    ap.add_argument("--profile", required=True)
    ap.add_argument("--sizes", default="1-64M")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    os.environ["FABRIC_PROFILE"] = "none"
    from fabric import options as fopts
    from fabric.perf import measure, tune
    from fabric.perf.cli import machine_info, parse_sizes, versions
    tuned = fopts.read_profile(args.backend, args.profile)
    if not tuned:
        raise SystemExit(f"{args.profile} has no profile for {args.backend}")
    sizes = parse_sizes(args.sizes)

    def probe(ep):
        out = {}
        for s in sizes:
            out[f"lat{s}"] = measure.run_lat(ep, s, args.scale)["p50_us"]
            out[f"bw{s}"] = measure.run_bw(ep, s, args.scale)["MBps"]
        return out

    res = tune.interleaved(args.backend, {"default": {}, "tuned": tuned, "default again": {}}, probe, rounds=args.rounds,
                           say=lambda m: print(m, file=sys.stderr, flush=True))
    d, t, a = res["default"], res["tuned"], res["default again"]
    rows = []
    print(f"tuned {tuned}")
    print(f"{'size':>10} {'lat def us':>11} {'lat tuned':>10} {'ratio':>6} {'A/A':>5}  "
          f"{'bw def MB/s':>12} {'bw tuned':>10} {'ratio':>6} {'A/A':>5}")
    for s in sizes:
        row = {"size": s, "lat_default_us": d[f"lat{s}"], "lat_tuned_us": t[f"lat{s}"],
               "lat_ratio": t[f"lat{s}"] / d[f"lat{s}"], "bw_default_MBps": d[f"bw{s}"],
               "bw_tuned_MBps": t[f"bw{s}"], "bw_ratio": t[f"bw{s}"] / d[f"bw{s}"],
               "lat_ratio_default_again": a[f"lat{s}"] / d[f"lat{s}"],
               "bw_ratio_default_again": a[f"bw{s}"] / d[f"bw{s}"]}
        rows.append(row)
        print(f"{s:>10} {row['lat_default_us']:>11.1f} {row['lat_tuned_us']:>10.1f} {row['lat_ratio']:>6.2f} "
              f"{row['lat_ratio_default_again']:>5.2f}  {row['bw_default_MBps']:>12.0f} {row['bw_tuned_MBps']:>10.0f} "
              f"{row['bw_ratio']:>6.2f} {row['bw_ratio_default_again']:>5.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "tuned": tuned, "rounds": args.rounds, "machine": machine_info(),
                       "versions": versions(), "command": " ".join(sys.argv), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
