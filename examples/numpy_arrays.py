"""NumPy arrays between two processes.

A sender process connects and sends arrays; this process receives each one
straight into an array it allocated once (recv_into: no copy, no new memory
per message) and checks the content.

    python examples/numpy_arrays.py [--backend tcp|ucx|verbs]
"""
from __future__ import annotations

import argparse
import multiprocessing
import sys

import numpy as np

import fabric

SHAPE = (512, 1024)      # 4 MiB of float64: large enough to go by rendezvous (zero copy)
COUNT = 5


def sender(address: str, backend: str | None) -> None:
    """The peer process: connects to `address` and sends COUNT arrays."""
    with fabric.Fabric(backend) as fab, fab.connect(address, timeout=30) as ep:
        for i in range(COUNT):
            array = np.full(SHAPE, i, dtype=np.float64)
            array[0, 0] = -i                 # something that differs from the rest
            ep.send(array)                   # any C-contiguous buffer; returns when it may be reused


def main() -> int:
    parser = argparse.ArgumentParser(description="numpy arrays between two processes")
    parser.add_argument("--backend", help="tcp, ucx or verbs (default: $FABRIC_BACKEND, else auto)")
    args = parser.parse_args()

    with fabric.Fabric(args.backend) as fab, fab.listen("127.0.0.1:0") as lst:
        # "spawn", not fork: a forked child cannot use its parent's Fabric (nor UCX at all)
        peer = multiprocessing.get_context("spawn").Process(target=sender, args=(lst.address, args.backend))
        peer.start()
        with lst.accept(timeout=30) as ep:
            out = np.empty(SHAPE, dtype=np.float64)  # allocated once, filled by every receive
            for i in range(COUNT):
                n = ep.recv_into(out, timeout=30)     # MessageTooLarge if it did not fit (nothing lost)
                expected = np.full(SHAPE, i, dtype=np.float64)
                expected[0, 0] = -i
                if n != out.nbytes or not np.array_equal(out, expected):
                    print(f"array {i} arrived wrong ({n} bytes)", file=sys.stderr)
                    return 1
        peer.join(30)
        if peer.exitcode != 0:
            print(f"the sender failed (exit code {peer.exitcode})", file=sys.stderr)
            return 1
        print(f"numpy_arrays: {COUNT} arrays of {SHAPE} float64 received over {fab.name} "
              "into one preallocated array: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
