"""PyTorch CPU tensors between two processes.

The sender announces each tensor with a small header (dtype and shape), then
sends the tensor itself; this process allocates a tensor of that shape and
receives straight into it. Tensors travel through DLPack, without a copy.

    python examples/torch_tensors.py [--backend tcp|ucx|verbs]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import sys

import fabric

SHAPES = [(16,), (256, 1024), (3, 224, 224)]


def sender(address: str, backend: str | None) -> None:
    """The peer process: a header and a tensor for every shape."""
    import torch
    with fabric.Fabric(backend) as fab, fab.connect(address, timeout=30) as ep:
        for i, shape in enumerate(SHAPES):
            tensor = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + i
            ep.send(json.dumps({"dtype": "float32", "shape": shape}).encode())
            ep.send(tensor)              # must be contiguous (else BufferError: call .contiguous())


def main() -> int:
    parser = argparse.ArgumentParser(description="torch tensors between two processes")
    parser.add_argument("--backend", help="tcp, ucx or verbs (default: $FABRIC_BACKEND, else auto)")
    args = parser.parse_args()
    try:
        import torch
    except ImportError as e:
        print(f"torch_tensors: skipped, torch is not importable ({e})")
        return 0

    with fabric.Fabric(args.backend) as fab, fab.listen("127.0.0.1:0") as lst:
        # "spawn", not fork: a forked child cannot use its parent's Fabric (nor UCX at all)
        peer = multiprocessing.get_context("spawn").Process(target=sender, args=(lst.address, args.backend))
        peer.start()
        with lst.accept(timeout=60) as ep:
            for i in range(len(SHAPES)):
                header = json.loads(bytes(ep.recv(timeout=60)))       # a Message is a buffer
                tensor = torch.empty(header["shape"], dtype=getattr(torch, header["dtype"]))
                n = ep.recv_into(tensor, timeout=60)                  # lands in the tensor's memory
                expected = torch.arange(tensor.numel(), dtype=torch.float32).reshape(tensor.shape) + i
                if n != tensor.numel() * tensor.element_size() or not torch.equal(tensor, expected):
                    print(f"tensor {i} arrived wrong ({n} bytes)", file=sys.stderr)
                    return 1
        peer.join(60)
        if peer.exitcode != 0:
            print(f"the sender failed (exit code {peer.exitcode})", file=sys.stderr)
            return 1
        print(f"torch_tensors: {len(SHAPES)} tensors received over {fab.name} into tensors allocated "
              "from their headers: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
