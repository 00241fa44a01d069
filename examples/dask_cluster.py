"""A Dask cluster whose scheduler, workers and client talk over fabric.

Installing fabric-transport registers the comm schemes fabric+tcp://,
fabric+ucx://, fabric+verbs:// and fabric:// with Dask; nothing to import.
Two worker processes on this host move a numpy array between them.

    python examples/dask_cluster.py [--backend tcp|ucx|verbs]
"""
from __future__ import annotations

import argparse
import logging
import sys

import numpy as np
from distributed import Client, LocalCluster


def main() -> int:
    parser = argparse.ArgumentParser(description="a Dask cluster over fabric")
    parser.add_argument("--backend", default="tcp", help="tcp, ucx or verbs (default: tcp)")
    args = parser.parse_args()
    protocol = f"fabric+{args.backend}://"

    with LocalCluster(protocol=protocol, n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=None, host="127.0.0.1",
                      silence_logs=logging.ERROR) as cluster, Client(cluster) as client:
        first, second = list(client.scheduler_info()["workers"])
        data = client.submit(np.arange, 4 << 20, dtype=np.float64, workers=[first])   # 32 MiB on one worker
        total = client.submit(np.sum, data, workers=[second])                          # summed on the other
        result = total.result(timeout=60)
    if result != (4 << 20) * ((4 << 20) - 1) // 2:
        print(f"wrong sum: {result}", file=sys.stderr)
        return 1
    print(f"dask_cluster: a 32 MiB array moved between 2 workers over {protocol}: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
