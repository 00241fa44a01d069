"""Deep-learning replay: parameter-server training rounds of ResNet-50, VGG-16
and Inception-v3 (fp32 tensors from bench/models.py), fabric against grpcio.

    python bench/dl_replay.py [--models resnet50,vgg16,inception_v3] [--workers 1,2]
                              [--contenders fabric:tcp,fabric:ucx,grpc] [--rounds 5] [--json out.json]

One round, per worker: push every gradient tensor to the server, then pull
every parameter tensor back, one message per tensor (TensorFlow's PS mode).
Both sides issue their messages asynchronously, as TensorFlow does: fabric
with isend for the pushes and one small request message per pull; grpcio with
one unary RPC per tensor (Push: index + tensor bytes; Pull: index -> tensor
bytes), all started as futures. The server keeps one parameter copy and one
gradient buffer per worker; no optimizer arithmetic runs (it would cost both
sides alike).

Reported per contender, model and worker count: rounds per second (per
worker and aggregate), and the time of one round split by tensor-size class
(each class replayed on its own: the tensors of that class pushed and pulled).
Contenders are measured in the same run, interleaved repetition by repetition;
medians. ucx runs with UCX_TLS from --ucx-tls (default sm: same host).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import struct
import subprocess
import sys
import time
from concurrent import futures

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from bench import models  # noqa: E402

INDEX = struct.Struct("<I")
MAX_GRPC = (1 << 31) - 1
GRPC_WINDOW = 64


def tensor_sizes(model: str) -> list[int]:
    return [models.nbytes(shape) for _, shape in models.tensors(model)]


# ------------------------------------------------------------------ fabric side

def fabric_server(backend: str, model: str):
    import threading
    import fabric
    sizes = tensor_sizes(model)
    params = [bytearray(n) for n in sizes]
    fab = fabric.Fabric(backend)
    lst = fab.listen("127.0.0.1:0")
    print(lst.address, flush=True)

    def serve(ep):
        grads = [bytearray(n) for n in sizes]        # this worker's gradient buffers
        req = bytearray(16)
        step = bytearray(4 * len(sizes))
        try:
            while True:
                n = ep.recv_into(step)             # the round's tensor indexes
                indexes = struct.unpack_from(f"<{n // 4}I", step)
                for i in indexes:                  # pushes, in order
                    ep.recv_into(grads[i])
                for i in indexes:                  # pulls: one request each
                    ep.recv_into(req)
                    ep.send(params[INDEX.unpack_from(req)[0]])
        except fabric.FabricError:
            ep.close(linger=0)

    while True:
        ep = lst.accept()
        threading.Thread(target=serve, args=(ep,), daemon=True).start()


class FabricWorker:
    def __init__(self, backend, address, sizes):
        import fabric
        self.fab = fabric.Fabric(backend)
        self.ep = self.fab.connect(address, timeout=60)
        self.grads = [bytearray(n) for n in sizes]
        self.params = [bytearray(n) for n in sizes]
        self.index = [INDEX.pack(i) for i in range(len(sizes))]

    def round(self, indexes):
        ep = self.ep
        ep.send(struct.pack(f"<{len(indexes)}I", *indexes))
        pushes = [ep.isend(self.grads[i]) for i in indexes]
        for i in indexes:
            ep.send(self.index[i])
        for i in indexes:
            ep.recv_into(self.params[i])
        for r in pushes:
            r.wait()

    def close(self):
        self.ep.close()


# ------------------------------------------------------------------ grpc side

def grpc_options():
    return [("grpc.max_receive_message_length", MAX_GRPC), ("grpc.max_send_message_length", MAX_GRPC)]


def grpc_server(model: str):
    import grpc
    sizes = tensor_sizes(model)
    params = [bytes(n) for n in sizes]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=grpc_options())

    def push(request, context):
        # the gradient arrives as bytes (index + tensor); a PS would apply it here
        INDEX.unpack_from(request)
        return b""

    def pull(request, context):
        return params[INDEX.unpack_from(request)[0]]

    handler = grpc.method_handlers_generic_handler("replay.ParameterServer", {
        "Push": grpc.unary_unary_rpc_method_handler(push),
        "Pull": grpc.unary_unary_rpc_method_handler(pull)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"127.0.0.1:{port}", flush=True)
    server.wait_for_termination()


class GrpcWorker:
    def __init__(self, address, sizes):
        import grpc
        self.channel = grpc.insecure_channel(address, options=grpc_options())
        grpc.channel_ready_future(self.channel).result(timeout=60)
        self.push = self.channel.unary_unary("/replay.ParameterServer/Push")
        self.pull = self.channel.unary_unary("/replay.ParameterServer/Pull")
        # a serialized gradient message: index + tensor bytes (made once; a real
        # client serializes every round, which would only slow grpc further)
        self.grads = [INDEX.pack(i) + bytes(n) for i, n in enumerate(sizes)]
        self.index = [INDEX.pack(i) for i in range(len(sizes))]

    def round(self, indexes):
        # every push, then every pull, as futures; at most WINDOW unanswered
        # (thousands of simultaneous calls made grpcio cancel some)
        pending = collections.deque()
        for f, arg in [(self.push, self.grads[i]) for i in indexes] + [(self.pull, self.index[i]) for i in indexes]:
            pending.append(f.future(arg))
            if len(pending) >= GRPC_WINDOW:
                pending.popleft().result()
        while pending:
            pending.popleft().result()

    def close(self):
        self.channel.close()


# ------------------------------------------------------------------ worker process

def worker_main(kind: str, model: str, address: str, rounds: int, start_at: float):
    sizes = tensor_sizes(model)
    if kind == "grpc":
        w = GrpcWorker(address, sizes)
    else:
        w = FabricWorker(kind.split(":", 1)[1], address, sizes)
    everything = list(range(len(sizes)))
    classes = {}
    for i, n in enumerate(sizes):
        classes.setdefault(models.size_class(n), []).append(i)
    w.round(everything)                              # warm-up, excluded
    delay = start_at - time.time()                   # workers start together
    if delay > 0:
        time.sleep(delay)
    t0 = time.perf_counter()
    for _ in range(rounds):
        w.round(everything)
    elapsed = time.perf_counter() - t0
    split = {}
    for name, idx in classes.items():
        t1 = time.perf_counter()
        for _ in range(rounds):
            w.round(idx)
        split[name] = {"seconds_per_round": (time.perf_counter() - t1) / rounds, "tensors": len(idx),
                       "bytes": sum(sizes[i] for i in idx)}
    w.close()
    print(json.dumps({"rounds": rounds, "seconds": elapsed, "rounds_per_s": rounds / elapsed,
                      "split": split}), flush=True)


# ------------------------------------------------------------------ orchestration

def contender_env(kind: str, ucx_tls: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT)
    if kind == "fabric:ucx" and ucx_tls:
        env["UCX_TLS"] = ucx_tls
    return env


def start_server(kind: str, model: str, env: dict):
    args = ["grpc-server", model] if kind == "grpc" else ["fabric-server", kind.split(":", 1)[1], model]
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)] + args, stdout=subprocess.PIPE,
                            text=True, env=env)
    address = proc.stdout.readline().strip()
    if not address:
        proc.wait()
        raise RuntimeError(f"{kind} server did not start")
    return proc, address


def one_measurement(kind, model, workers, rounds, env) -> dict:
    server, address = start_server(kind, model, env)
    try:
        start_at = time.time() + 3.0 + 0.5 * workers      # after every worker's connect and warm-up
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "worker", kind, model, address,
                                   str(rounds), repr(start_at)], stdout=subprocess.PIPE, text=True, env=env)
                 for _ in range(workers)]
        outs = []
        for p in procs:
            out, _ = p.communicate(timeout=1800)
            if p.returncode != 0:
                raise RuntimeError(f"{kind} worker failed ({p.returncode})")
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        server.kill()
        server.wait()
    per_worker = [o["rounds_per_s"] for o in outs]
    split = {}
    for name in outs[0]["split"]:
        split[name] = dict(outs[0]["split"][name],
                           seconds_per_round=statistics.mean(o["split"][name]["seconds_per_round"] for o in outs))
    return {"rounds_per_s_per_worker": statistics.mean(per_worker),
            "rounds_per_s_aggregate": sum(per_worker), "split": split}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet50,vgg16,inception_v3")
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--contenders", default=None,
                    help="comma list of fabric:<backend> and grpc (default: every available backend, and grpc)")
    ap.add_argument("--ucx-tls", default="sm")
    ap.add_argument("--rounds", type=int, default=5, help="training rounds per measurement")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved repetitions; medians")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.contenders:
        contenders = [c for c in args.contenders.split(",") if c]
    else:
        import fabric
        contenders = [f"fabric:{b}" for b, (ok, _) in fabric.available_backends().items()
                      if ok and b in ("tcp", "ucx", "verbs")] + ["grpc"]
    results = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
               "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                           "platform": platform.platform()},
               "ucx_tls": args.ucx_tls, "rounds": args.rounds, "repeat": args.repeat, "models": {}}
    try:
        import grpc
        results["grpcio"] = grpc.__version__
    except ImportError:
        pass
    for model in [m for m in args.models.split(",") if m]:
        sizes = tensor_sizes(model)
        mres = results["models"][model] = {"tensors": len(sizes), "parameters": models.parameter_count(model),
                                           "bytes_per_direction": sum(sizes), "runs": {}}
        for workers in [int(w) for w in args.workers.split(",") if w]:
            samples = {c: [] for c in contenders}
            for rep in range(args.repeat):
                for c in contenders:
                    r = one_measurement(c, model, workers, args.rounds, contender_env(c, args.ucx_tls))
                    samples[c].append(r)
                    print(f"{model} workers={workers} rep {rep + 1}: {c} {r['rounds_per_s_aggregate']:.2f} rounds/s",
                          file=sys.stderr, flush=True)
            row = {}
            for c, runs in samples.items():
                best = sorted(runs, key=lambda r: r["rounds_per_s_aggregate"])[len(runs) // 2]   # median run
                row[c] = {"rounds_per_s_aggregate": statistics.median(r["rounds_per_s_aggregate"] for r in runs),
                          "rounds_per_s_per_worker": statistics.median(r["rounds_per_s_per_worker"] for r in runs),
                          "split": best["split"]}
            if "grpc" in row:
                for c in row:
                    row[c]["vs_grpc"] = row[c]["rounds_per_s_aggregate"] / row["grpc"]["rounds_per_s_aggregate"]
            mres["runs"][str(workers)] = row
            print(f"\n{model} ({len(sizes)} tensors, {sum(sizes) / 1e6:.1f} MB each way), {workers} worker(s):")
            for c, v in row.items():
                split = "  ".join(f"{k} {s['seconds_per_round'] * 1e3:.1f}ms" for k, s in v["split"].items())
                print(f"  {c:<12} {v['rounds_per_s_aggregate']:7.2f} rounds/s  "
                      f"({v.get('vs_grpc', float('nan')):.2f}x grpc)  split: {split}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "fabric-server":
        fabric_server(sys.argv[2], sys.argv[3])
    elif len(sys.argv) > 1 and sys.argv[1] == "grpc-server":
        grpc_server(sys.argv[2])
    elif len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker_main(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), float(sys.argv[6]))
    else:
        main()
