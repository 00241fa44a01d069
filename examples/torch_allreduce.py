"""torch.distributed over fabric: two ranks all-reduce a tensor.

``import fabric.torch`` registers the process-group backend "fabric"; after
that, init_process_group("fabric") works with any init method (env://,
tcp://, file://). Each rank is a process started here.

    python examples/torch_allreduce.py [--backend tcp|ucx|verbs]
"""
from __future__ import annotations

import argparse
import os
import socket
import sys

WORLD = 2


def rank_main(rank: int, init_method: str, backend: str | None) -> None:
    """One rank of the group (a spawned process)."""
    if backend:
        os.environ["FABRIC_BACKEND"] = backend    # the fabric the group uses (else fabric's automatic choice)
    import importlib

    import torch
    import torch.distributed as dist

    importlib.import_module("fabric.torch")   # `import fabric.torch`: registers the backend "fabric"

    dist.init_process_group("fabric", init_method=init_method, rank=rank, world_size=WORLD)
    try:
        t = torch.full((1024,), float(rank + 1))
        dist.all_reduce(t)                               # sum over the ranks, in place
        assert torch.equal(t, torch.full((1024,), float(sum(range(1, WORLD + 1)))))
        if rank == 0:
            dist.send(torch.arange(8), dst=1, tag=7)     # point to point
        else:
            got = torch.empty(8, dtype=torch.int64)
            dist.recv(got, src=0, tag=7)
            assert torch.equal(got, torch.arange(8))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description="torch.distributed over fabric")
    parser.add_argument("--backend", help="tcp, ucx or verbs (default: $FABRIC_BACKEND, else auto)")
    args = parser.parse_args()
    try:
        import torch.multiprocessing as mp
    except ImportError as e:
        print(f"torch_allreduce: skipped, torch is not importable ({e})")
        return 0
    with socket.socket() as s:                           # a free port for the c10d store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(f"tcp://127.0.0.1:{port}", args.backend), nprocs=WORLD, join=True)
    print(f"torch_allreduce: all_reduce, send/recv and barrier on {WORLD} ranks over "
          f"{args.backend or os.environ.get('FABRIC_BACKEND') or 'auto'}: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
