"""fabric's torch.distributed backend against gloo, side by side in one run.

    python bench/torch_compare.py [--world 2] [--configs gloo,tcp,ucx-sm,ucx,tcp@ring,...]
                                  [--sizes 4K,64K,1M,16M,64M,256M] [--rounds 3]
                                  [--models mlp,mlp-b8,resnet50] [--json out.json]

Starts --world rank processes (env:// on loopback). Each makes one process
group per config over the same ranks: gloo, and fabric on each named fabric
(tcp; ucx-sm = ucx with UCX_TLS=sm; ucx-tcp = UCX_TLS=tcp; ucx = ucx with
no UCX_* set, fabric's default on one host; verbs; a suffix @ring or
@doubling forces all_reduce's algorithm, @chunk=256K the ring's chunk), and
runs, round after
round with the configs interleaved:
- all_reduce (SUM, float32) of each size, as a user writes it: a blocking
  loop of dist.all_reduce calls; time per call on rank 0, algbw = bytes /
  time, busbw = algbw * 2(n-1)/n (nccl-tests' definition);
- a DDP training step (forward, backward with DDP's bucketed gradient
  all_reduce, SGD step) of a ResNet-50-shaped CNN written in plain torch
  (25.6M parameters, 2 images of 3x64x64 per rank) and of a 25M-parameter
  MLP (batch 64; mlp-b8: 8 samples, where the gradient all_reduce of 100 MB
  outweighs the compute), median step time.
Medians over rounds; ratios against gloo of the same run. With more ranks
than cores (--world 4 on this 2-core VM) every rank shares CPU with the
others: the figures are oversubscribed and reported as such.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from fabric.info import human_size  # noqa: E402
from fabric.perf.cli import parse_sizes  # noqa: E402

CONFIGS = {                      # name -> (backend, environment for the fabric)
    "gloo": ("gloo", {}),
    "tcp": ("fabric", {"FABRIC_BACKEND": "tcp"}),
    "ucx": ("fabric", {"FABRIC_BACKEND": "ucx", "UCX_TLS": None}),
    "ucx-sm": ("fabric", {"FABRIC_BACKEND": "ucx", "UCX_TLS": "sm"}),
    "ucx-tcp": ("fabric", {"FABRIC_BACKEND": "ucx", "UCX_TLS": "tcp"}),
    "verbs": ("fabric", {"FABRIC_BACKEND": "verbs"}),
}


def config_env(name):
    """A config: a CONFIGS name, then optional @-settings of fabric.torch:
    @ring (all_reduce always by ring), @doubling (never), @chunk=SIZE."""
    base, *settings = name.split("@")
    backend, env = CONFIGS[base]
    env = dict(env, FABRIC_TORCH_RING_MIN=None, FABRIC_TORCH_CHUNK=None)
    for s in settings:
        if s == "ring":
            env["FABRIC_TORCH_RING_MIN"] = "0"
        elif s == "doubling":
            env["FABRIC_TORCH_RING_MIN"] = str(1 << 62)
        elif s.startswith("chunk="):
            env["FABRIC_TORCH_CHUNK"] = str(parse_sizes(s[6:])[0])
        else:
            raise ValueError(f"unknown setting @{s} in config {name}")
    return backend, env


# ------------------------------------------------------------------ models

def resnet50_shaped():
    """ResNet-50's layout (bottleneck blocks 3-4-6-3, widths 64-2048,
    25.6M parameters) in plain torch: no torchvision here."""
    import torch.nn as nn

    class Bottleneck(nn.Module):
        def __init__(self, cin, width, stride):
            super().__init__()
            cout = width * 4
            self.body = nn.Sequential(
                nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(width),
                nn.ReLU(inplace=True),
                nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
            self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x):
            return self.relu(self.body(x) + self.skip(x))

    layers = [nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
              nn.MaxPool2d(3, stride=2, padding=1)]
    cin = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            layers.append(Bottleneck(cin, width, stride if b == 0 else 1))
            cin = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000)]
    return nn.Sequential(*layers), (2, 3, 64, 64), 1000


def mlp25m(batch=64):
    import torch.nn as nn
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                          nn.Linear(4096, 1024), nn.ReLU(), nn.Linear(1024, 10))
    return model, (batch, 1024), 10


def mlp25m_small_batch():
    """The same MLP at 8 samples per rank: the gradient all_reduce (100 MB)
    outweighs the compute, as with large models on few samples per GPU."""
    return mlp25m(8)


MODELS = {"resnet50": resnet50_shaped, "mlp": mlp25m, "mlp-b8": mlp25m_small_batch}


# -------------------------------------------------------------- one rank

def rank_main(args):
    import torch
    import torch.distributed as dist

    import fabric.torch  # noqa: F401 - registers "fabric"

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    groups = {}
    for name in args.configs:
        backend, env = config_env(name)
        for k, v in env.items():                 # read when the group's Fabric starts
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        groups[name] = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=600))
    results = {"allreduce": {}, "ddp": {}}

    def timed_allreduce(group, t, budget):
        dist.all_reduce(t, group=group)          # warm: buffers, connections, pages
        dist.all_reduce(t, group=group)
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(t, group=group)
        one = time.perf_counter() - started
        iters = max(3, min(200, int(budget / max(one, 1e-6))))
        iters = torch.tensor([iters])
        dist.broadcast(iters, 0)                 # every rank runs as many
        dist.barrier()
        started = time.perf_counter()
        for _ in range(int(iters)):
            dist.all_reduce(t, group=group)
        return (time.perf_counter() - started) / int(iters)

    for _round in range(args.rounds):
        for size in args.sizes:
            t = torch.ones(size // 4, dtype=torch.float32)
            for name in args.configs:
                seconds = timed_allreduce(groups[name], t, args.budget)
                results["allreduce"].setdefault(str(size), {}).setdefault(name, []).append(seconds)
        for model_name in args.models:
            for name in args.configs:
                results["ddp"].setdefault(model_name, {}).setdefault(name, []).append(
                    ddp_step(model_name, groups[name], args.steps, rank))
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    for g in groups.values():
        dist.destroy_process_group(g)
    dist.destroy_process_group()


def ddp_step(model_name, group, steps, rank):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model, shape, classes = MODELS[model_name]()
    ddp = DDP(model, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(*shape, generator=g)
    y = torch.randint(0, classes, (shape[0],), generator=g)
    times = []
    for i in range(steps + 2):
        dist.barrier()
        started = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        if i >= 2:                               # two warm-up steps
            times.append(time.perf_counter() - started)
    return statistics.median(times)


# ------------------------------------------------------------------ driver

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args):
    out = os.path.join("/tmp", f"torch-compare-{os.getpid()}.json")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(args.world),
               OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = [sys.executable, os.path.abspath(__file__), "--rank-process", "--out", out,
            "--configs", ",".join(args.configs), "--sizes", ",".join(map(str, args.sizes)),
            "--rounds", str(args.rounds), "--models", ",".join(args.models), "--steps", str(args.steps),
            "--budget", str(args.budget)]
    procs = [subprocess.Popen(argv, env=dict(env, RANK=str(r))) for r in range(args.world)]
    codes = [p.wait() for p in procs]
    if any(codes):
        sys.exit(f"a rank failed: exit codes {codes}")
    with open(out) as f:
        raw = json.load(f)
    os.unlink(out)
    return raw


def report(raw, args):
    import torch
    n = args.world
    base = args.configs[0]
    lines = [f"world size {n} on {os.cpu_count()} cores{' (oversubscribed)' if n > (os.cpu_count() or 1) else ''}; "
             f"torch {torch.__version__}; medians of {args.rounds} rounds; ratios against {base}", ""]
    head = "| size | " + " | ".join(f"{c} busbw" for c in args.configs) + " | " + \
        " | ".join(f"{c}/{base}" for c in args.configs[1:]) + " | " + " | ".join(f"{c} time" for c in args.configs) + " |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    summary = {"allreduce": {}, "ddp": {}}
    for size in args.sizes:
        med = {c: statistics.median(raw["allreduce"][str(size)][c]) for c in args.configs}
        busbw = {c: size / med[c] * 2 * (n - 1) / n / 1e9 for c in args.configs}
        summary["allreduce"][size] = {c: {"seconds": med[c], "busbw_GBps": busbw[c]} for c in args.configs}
        lines.append(f"| {human_size(size)} | " + " | ".join(f"{busbw[c]:.3f} GB/s" for c in args.configs) + " | "
                     + " | ".join(f"{busbw[c] / busbw[base]:.2f}x" for c in args.configs[1:]) + " | "
                     + " | ".join(f"{med[c] * 1e6:.0f} us" for c in args.configs) + " |")
    if args.models:
        lines += ["", "| DDP step | " + " | ".join(args.configs) + " | "
                  + " | ".join(f"{c}/{base}" for c in args.configs[1:]) + " |",
                  "|" + "---|" * (1 + 2 * len(args.configs) - 1)]
        for m in args.models:
            med = {c: statistics.median(raw["ddp"][m][c]) for c in args.configs}
            summary["ddp"][m] = {c: {"seconds": med[c]} for c in args.configs}
            lines.append(f"| {m} | " + " | ".join(f"{med[c] * 1e3:.0f} ms" for c in args.configs) + " | "
                         + " | ".join(f"{med[c] / med[base]:.2f}x" for c in args.configs[1:]) + " |")
    return "\n".join(lines), summary


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--configs", default="gloo,tcp,ucx-sm,ucx")
    ap.add_argument("--sizes", default="4K,64K,1M,16M,64M,256M")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", default="mlp,mlp-b8,resnet50")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--budget", type=float, default=0.5, help="seconds of all_reduce per size and config")
    ap.add_argument("--json")
    ap.add_argument("--rank-process", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in args.configs if c.split("@")[0] not in CONFIGS]
    if unknown:
        ap.error(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}")
    args.sizes = parse_sizes(str(args.sizes))
    args.models = [m for m in args.models.split(",") if m]
    if args.rank_process:
        rank_main(args)
        return
    raw = run(args)
    text, summary = report(raw, args)
    print(text)
    if args.json:
        import torch
        with open(args.json, "w") as f:
            json.dump({"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                       "machine": platform.platform(), "cores": os.cpu_count(), "torch": torch.__version__,
                       "world": args.world, "rounds": args.rounds, "summary": summary, "raw": raw}, f, indent=1)


if __name__ == "__main__":
    main()
