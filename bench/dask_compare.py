"""fabric's Dask comms against Dask's own tcp comm, side by side in one run.

    python bench/dask_compare.py [--protocols tcp,fabric+tcp,fabric+ucx] [--rounds 3]
                                 [--sizes 1M,16M,64M,256M] [--json out.json]

Each protocol gets a LocalCluster of 2 worker processes (1 thread each, as
a user starts it); rounds interleave the protocols. Per round:
- worker-to-worker transfers of a numpy array of each size (--repeats
  times, a new array each time; the median, and the first one apart: it
  pays for memory the VM touches for the first time): the array is made
  on worker A, then a task on worker B that needs it; wall time from
  submitting B's task to its result (GB/s = size / time), and the time
  B's own transfer log gives for the bytes it fetched;
- 5000 no-op tasks submitted at once, tasks/s (control messages only);
- (x + x.T).sum() on an 8000x8000 float64 array in 1000x1000 chunks;
- a P2P rechunk of that array to 8000x125 chunks, summed.
Medians over rounds; ratios against Dask's tcp comm of the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def parse_size(text):
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def human(n):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def make_array(n):
    import numpy as np
    return np.ones(n // 8, dtype=np.float64)


def nbytes_of(x):
    return int(x.nbytes)


def noop(i):
    return i


def incoming_log(dask_worker):
    return [dict(entry) for entry in dask_worker.transfer_incoming_log]


def measure(protocol, sizes, tasks, array_side, chunk, repeats):
    import dask
    import dask.array as da
    from distributed import Client, LocalCluster, wait

    out = {}
    with LocalCluster(protocol=f"{protocol}://", n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=None, silence_logs=40) as cluster, Client(cluster) as client:
        a, b = sorted(client.scheduler_info()["workers"])
        # warm both directions (connections, imports) before anything is timed
        client.submit(nbytes_of, client.submit(make_array, 1 << 20, workers=[a], pure=False),
                      workers=[b], pure=False).result()
        for size in sizes:
            walls, logs = [], []
            for _ in range(repeats):
                data = client.submit(make_array, size, workers=[a], pure=False)
                wait(data)
                before = len(client.run(incoming_log, workers=[b])[b])
                started = time.perf_counter()
                assert client.submit(nbytes_of, data, workers=[b], pure=False).result() == size // 8 * 8
                walls.append(time.perf_counter() - started)
                log = client.run(incoming_log, workers=[b])[b][before:]
                logs.append(sum(e["duration"] for e in log) or float("nan"))
                client.cancel(data)
                del data
            out[f"transfer {human(size)} wall s"] = statistics.median(walls)
            out[f"transfer {human(size)} log s"] = statistics.median(logs)
            out[f"transfer {human(size)} first wall s"] = walls[0]
        started = time.perf_counter()
        client.gather(client.map(noop, range(tasks), pure=False))
        out["no-op tasks/s"] = tasks / (time.perf_counter() - started)
        x = da.ones((array_side, array_side), chunks=(chunk, chunk))
        started = time.perf_counter()
        (x + x.T).sum().compute()
        out["(x + x.T).sum() s"] = time.perf_counter() - started
        started = time.perf_counter()
        with dask.config.set({"array.rechunk.method": "p2p"}):
            x.rechunk((array_side, chunk // 8)).sum().compute()
        out["P2P rechunk s"] = time.perf_counter() - started
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--protocols", default="tcp,fabric+tcp,fabric+ucx")
    ap.add_argument("--sizes", default="1M,16M,64M,256M")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5, help="transfers per size per round (median)")
    ap.add_argument("--tasks", type=int, default=5000)
    ap.add_argument("--array", type=int, default=8000, help="side of the square array")
    ap.add_argument("--chunk", type=int, default=1000)
    ap.add_argument("--json")
    args = ap.parse_args()
    protocols = [p.strip() for p in args.protocols.split(",") if p.strip()]
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    runs: dict[str, list[dict]] = {p: [] for p in protocols}
    for r in range(args.rounds):
        for p in protocols:
            result = measure(p, sizes, args.tasks, args.array, args.chunk, args.repeats)
            runs[p].append(result)
            print(f"round {r + 1} {p}: " + ", ".join(f"{k} {v:.4g}" for k, v in result.items()),
                  file=sys.stderr, flush=True)
    import dask
    import distributed
    import fabric
    medians = {p: {k: statistics.median(run[k] for run in rs) for k in rs[0]} for p, rs in runs.items()}
    base = protocols[0]
    lines = [f"dask {dask.__version__}, distributed {distributed.__version__}, fabric {fabric.__version__}; "
             f"2 worker processes x 1 thread; medians of {args.rounds} rounds; ratio = faster than {base} "
             "(time: theirs / ours; rates: ours / theirs)", "",
             "| measure | " + " | ".join(protocols) + " | " + " | ".join(f"{p} vs {base}" for p in protocols[1:]) + " |",
             "|---|" + "---:|" * (2 * len(protocols) - 1)]
    for key in medians[base]:
        row = [medians[p][key] for p in protocols]
        if "tasks/s" in key:
            ratios = [row[i] / row[0] for i in range(1, len(row))]
        else:
            ratios = [row[0] / row[i] for i in range(1, len(row))]
        cells = []
        for key_value in row:
            cells.append(f"{key_value:.0f}" if "tasks/s" in key else f"{key_value:.3f}")
        if key.startswith("transfer") and key.endswith(" wall s") and "first" not in key:
            size = parse_size(key.split()[1] + key.split()[2][0])
            cells = [f"{v:.3f} ({size / v / 1e9:.2f} GB/s)" for v in row]
        lines.append(f"| {key} | " + " | ".join(cells) + " | " + " | ".join(f"{q:.2f}x" for q in ratios)
                     + " |")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs, "medians": medians}, f, indent=1)


if __name__ == "__main__":
    main()
