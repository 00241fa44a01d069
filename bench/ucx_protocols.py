"""The engine's rendezvous (ucp_get pulls) against UCX's own rendezvous
(UCP_AM_SEND_FLAG_RNDV, fetched with ucp_am_recv_data_nbx), same run,
interleaved, medians; for choosing `native_min` per size range.

    python bench/ucx_protocols.py [--tls sm] [--sizes ...] [--rounds 5]
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tls", default="sm")
    ap.add_argument("--sizes", default=",".join(str(1 << k) for k in range(14, 27)))
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    os.environ["UCX_TLS"] = args.tls
    import fabric
    from fabric.perf import cli, measure
    sizes = [int(s) for s in args.sizes.split(",")]
    runs = {}
    # UCX's own rendezvous gets each message whole (it pipelines internally);
    # the engine uses its default chunking.
    for name, knobs in (("engine", {"eager_limit": 8192, "native_min": 0}),
                        ("ucx-own", {"eager_limit": 8192, "native_min": 1})):
        fab = fabric.Fabric("ucx", **knobs)
        proc, address = cli.spawn_peer("ucx", knobs)
        runs[name] = (fab, proc, fab.connect(address, timeout=30))
    lat = {n: {s: [] for s in sizes} for n in runs}
    bw = {n: {s: [] for s in sizes} for n in runs}
    try:
        for _ in range(args.rounds):
            for s in sizes:
                for name, (fab, proc, ep) in runs.items():
                    lat[name][s].append(measure.run_lat(ep, s, 0.1)["p50_us"])
                    bw[name][s].append(measure.run_bw(ep, s, 0.1, 8)["MBps"])
        native_chunks = runs["ucx-own"][2].stats()["chunks_native"]
        engine_chunks = runs["engine"][2].stats()["chunks_native"]
    finally:
        for fab, proc, ep in runs.values():
            ep.close()
            proc.kill()
            proc.wait()
    assert native_chunks > 0 and engine_chunks == 0, "the two paths were not what they claim"
    print(f"UCX_TLS={args.tls}: medians of {args.rounds} interleaved rounds")
    print(f"{'size':>10} {'engine rtt':>11} {'ucx-own rtt':>12} {'engine MB/s':>12} {'ucx-own MB/s':>13} {'bw ratio':>9}")
    for s in sizes:
        le, lu = statistics.median(lat["engine"][s]), statistics.median(lat["ucx-own"][s])
        be, bu = statistics.median(bw["engine"][s]), statistics.median(bw["ucx-own"][s])
        print(f"{s:>10} {le:>11.1f} {lu:>12.1f} {be:>12.0f} {bu:>13.0f} {be / bu:>9.2f}")


if __name__ == "__main__":
    main()
