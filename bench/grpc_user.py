"""fabric.grpc as a user meets it, against grpcio: gRPC's test service with
protobuf messages, client and server in processes of their own, one run.

    python bench/grpc_user.py [--aio] [--busy] [--rounds 5] [--measures rtt,threads,mix,stream]
                              [--contenders grpcio,fabric+ucx,fabric+tcp,fabric>grpcio,grpcio>fabric,fabric-plain]
                              [--json F]

The service is TestService of tests/protos/interop.proto (shaped after gRPC's
src/proto/grpc/testing/test.proto): UnaryCall takes a SimpleRequest whose
payload and response_size give the request and response sizes, and
StreamingInputCall sums what is streamed to it. The servicer is what a user
writes (a generated-code servicer on a ThreadPoolExecutor(8), or async
handlers with --aio); the client calls the generated stub.

Contenders (client stack / server stack / transport):
  grpcio          grpcio / grpcio / plain TCP: the baseline every ratio is against
  fabric+ucx      fabric.grpc / fabric.grpc / a fabric stream over ucx (UCX_TLS as the user has it)
  fabric+tcp      fabric.grpc / fabric.grpc / a fabric stream over the tcp backend
  fabric>grpcio   fabric.grpc client / grpcio server / plain TCP
  grpcio>fabric   grpcio client / fabric.grpc server / plain TCP
  fabric-plain    fabric.grpc / fabric.grpc / plain TCP
With --aio the same with grpc.aio and fabric.grpc.aio on both sides.

Measures:
  rtt      unary round trips, request and response of the same size (8 B, 10 KiB, 1 MiB):
           a blocking loop of `stub.UnaryCall(req)`, time per call (lower is better)
  threads  32 threads (tasks with --aio) calling on one channel, 8 B: calls/s
  mix      a TF-gRPC-Bench-style parameter-server mix: 4 callers on one channel
           send requests of 10 B / 10 KB / 1 MB drawn 10/30/60 (its default skew)
           and 60/30/10, responses of 10 B: request bytes/s
  stream   16 MiB messages streamed to StreamingInputCall: MB/s
--busy runs a CPU-bound process beside every measurement (as on a loaded server).

A contender spelled KIND@DIR runs fabric from the checkout DIR (built in
place): an older commit measured beside this one, in the same run.
Rounds interleave the contenders; each figure is the median of its rounds,
with the spread (min-max) beside it; ratios are to grpcio's median of the
same measure in the same run.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PROTOS = os.path.join(ROOT, "tests", "protos")
# a contender spelled KIND@DIR runs fabric from the checkout DIR (an older commit: before and after in one run)
sys.path.insert(0, os.environ.get("FABRIC_BENCH_ROOT") or ROOT)

LIMIT = 64 << 20
OPTIONS = [("grpc.max_receive_message_length", LIMIT), ("grpc.max_send_message_length", LIMIT)]
CONTENDERS = ["grpcio", "fabric+ucx", "fabric+tcp", "fabric>grpcio", "grpcio>fabric", "fabric-plain"]
RTT_SIZES = (8, 10 << 10, 1 << 20)
MIX_SIZES = (10, 10_000, 1_000_000)
MIXES = {"ps-10/30/60": (10, 30, 60), "ps-60/30/10": (60, 30, 10)}
MIX_CALLERS = 4
THREADS = 32
STREAM_SIZE = 16 << 20


def generated():
    """(interop_pb2, interop_pb2_grpc), compiled with grpcio-tools into a temporary folder."""
    from grpc_tools import protoc
    out = tempfile.mkdtemp(prefix="fabric-bench-proto-")
    rc = protoc.main(["protoc", f"-I{PROTOS}", f"--python_out={out}", f"--grpc_python_out={out}",
                      os.path.join(PROTOS, "interop.proto")])
    if rc != 0:
        raise RuntimeError(f"protoc failed ({rc})")
    sys.path.insert(0, out)
    return importlib.import_module("interop_pb2"), importlib.import_module("interop_pb2_grpc")


def stacks(kind):
    """(client stack, server stack, transport) of a contender."""
    kind = kind.split("@", 1)[0]
    if kind == "grpcio":
        return "grpcio", "grpcio", "plain"
    if kind == "fabric>grpcio":
        return "fabric", "grpcio", "plain"
    if kind == "grpcio>fabric":
        return "grpcio", "fabric", "plain"
    if kind == "fabric-plain":
        return "fabric", "fabric", "plain"
    if kind.startswith("fabric+"):
        return "fabric", "fabric", kind
    raise ValueError(f"unknown contender {kind!r}")


# ---------------------------------------------------------------- servers
def _servicer(pb, pb_grpc, aio):
    zeros = {}

    def body(n):
        b = zeros.get(n)
        if b is None:
            b = zeros[n] = bytes(n)
        return b

    if aio:
        class Servicer(pb_grpc.TestServiceServicer):
            async def UnaryCall(self, request, context):
                return pb.SimpleResponse(payload=pb.Payload(body=body(request.response_size)))

            async def StreamingInputCall(self, request_iterator, context):
                n = 0
                async for r in request_iterator:
                    n += len(r.payload.body)
                return pb.StreamingInputCallResponse(aggregated_payload_size=n)
    else:
        class Servicer(pb_grpc.TestServiceServicer):
            def UnaryCall(self, request, context):
                return pb.SimpleResponse(payload=pb.Payload(body=body(request.response_size)))

            def StreamingInputCall(self, request_iterator, context):
                n = 0
                for r in request_iterator:
                    n += len(r.payload.body)
                return pb.StreamingInputCallResponse(aggregated_payload_size=n)
    return Servicer()


def _server_address(transport):
    return "127.0.0.1:0" if transport == "plain" else f"{transport}://127.0.0.1:0"


def serve(kind, aio):
    pb, pb_grpc = generated()
    _, server_stack, transport = stacks(kind)
    if aio:
        asyncio.run(_serve_aio(pb, pb_grpc, server_stack, transport))
        return
    pool = futures.ThreadPoolExecutor(max_workers=8)
    if server_stack == "grpcio":
        import grpc
        server = grpc.server(pool, options=OPTIONS)
    else:
        import fabric.grpc
        server = fabric.grpc.server(pool, options=OPTIONS)
    pb_grpc.add_TestServiceServicer_to_server(_servicer(pb, pb_grpc, False), server)
    port = server.add_insecure_port(_server_address(transport))
    server.start()
    print(port, flush=True)
    sys.stdin.read()                       # until the driver closes our stdin
    server.stop(0)


async def _serve_aio(pb, pb_grpc, server_stack, transport):
    if server_stack == "grpcio":
        import grpc.aio
        server = grpc.aio.server(options=OPTIONS)
    else:
        import fabric.grpc.aio
        server = fabric.grpc.aio.server(options=OPTIONS)
    pb_grpc.add_TestServiceServicer_to_server(_servicer(pb, pb_grpc, True), server)
    port = server.add_insecure_port(_server_address(transport))
    await server.start()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(0)


# ---------------------------------------------------------------- clients
def _target(transport, port):
    return f"127.0.0.1:{port}" if transport == "plain" else f"{transport}://127.0.0.1:{port}"


def _mix_requests(pb, weights, n, seed):
    rng = random.Random(seed)
    bodies = {s: bytes(s) for s in MIX_SIZES}
    sizes = rng.choices(MIX_SIZES, weights=weights, k=n)
    return [pb.SimpleRequest(response_size=10, payload=pb.Payload(body=bodies[s])) for s in sizes], sum(sizes)


class SyncClient:
    def __init__(self, pb, pb_grpc, kind, port):
        client_stack, _, transport = stacks(kind)
        if client_stack == "grpcio":
            import grpc
            self.channel = grpc.insecure_channel(_target(transport, port), options=OPTIONS)
        else:
            import fabric.grpc
            self.channel = fabric.grpc.insecure_channel(_target(transport, port), options=OPTIONS)
        self.pb = pb
        self.stub = pb_grpc.TestServiceStub(self.channel)
        self.stub.UnaryCall(pb.SimpleRequest(response_size=8, payload=pb.Payload(body=bytes(8))), timeout=60)

    def rtt(self, size, n):
        pb, call = self.pb, self.stub.UnaryCall
        request = pb.SimpleRequest(response_size=size, payload=pb.Payload(body=bytes(size)))
        t0 = time.perf_counter()
        for _ in range(n):
            call(request)
        return (time.perf_counter() - t0) / n

    def threads(self, size, seconds):
        """Calls per second of THREADS threads calling for `seconds`."""
        pb, call = self.pb, self.stub.UnaryCall
        request = pb.SimpleRequest(response_size=size, payload=pb.Payload(body=bytes(size)))
        counts = [0] * THREADS
        start = threading.Barrier(THREADS + 1)
        stop_at = [0.0]

        def caller(i):
            start.wait()
            n, end = 0, stop_at[0]
            while time.perf_counter() < end:
                call(request)
                n += 1
            counts[i] = n
        ts = [threading.Thread(target=caller, args=(i,)) for i in range(THREADS)]
        for t in ts:
            t.start()
        t0 = time.perf_counter()
        stop_at[0] = t0 + seconds
        start.wait()
        for t in ts:
            t.join()
        return sum(counts) / (time.perf_counter() - t0)

    def mix(self, mix, n):
        """Request bytes per second of MIX_CALLERS callers sending n requests in all."""
        requests, total = _mix_requests(self.pb, MIXES[mix], n, seed=n)
        call = self.stub.UnaryCall
        parts = [requests[i::MIX_CALLERS] for i in range(MIX_CALLERS)]

        def caller(reqs):
            for r in reqs:
                call(r)
        ts = [threading.Thread(target=caller, args=(p,)) for p in parts]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return total / (time.perf_counter() - t0)

    def stream(self, size, n):
        pb = self.pb
        request = pb.StreamingInputCallRequest(payload=pb.Payload(body=bytes(size)))
        t0 = time.perf_counter()
        reply = self.stub.StreamingInputCall(iter([request] * n))
        elapsed = time.perf_counter() - t0
        if reply.aggregated_payload_size != size * n:
            raise RuntimeError("StreamingInputCall lost bytes")
        return size * n / elapsed

    def close(self):
        self.channel.close()


class AioClient:
    """The same measures in an event loop of this process (a thread runs it)."""

    def __init__(self, pb, pb_grpc, kind, port):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.pb = pb
        self._run(self._open(pb_grpc, kind, port))

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _open(self, pb_grpc, kind, port):
        client_stack, _, transport = stacks(kind)
        if client_stack == "grpcio":
            import grpc.aio
            self.channel = grpc.aio.insecure_channel(_target(transport, port), options=OPTIONS)
        else:
            import fabric.grpc.aio
            self.channel = fabric.grpc.aio.insecure_channel(_target(transport, port), options=OPTIONS)
        self.stub = pb_grpc.TestServiceStub(self.channel)
        await self.stub.UnaryCall(self.pb.SimpleRequest(response_size=8, payload=self.pb.Payload(body=bytes(8))),
                                  timeout=60)

    def rtt(self, size, n):
        async def run():
            pb, call = self.pb, self.stub.UnaryCall
            request = pb.SimpleRequest(response_size=size, payload=pb.Payload(body=bytes(size)))
            t0 = time.perf_counter()
            for _ in range(n):
                await call(request)
            return (time.perf_counter() - t0) / n
        return self._run(run())

    def threads(self, size, seconds):
        async def run():
            pb, call = self.pb, self.stub.UnaryCall
            request = pb.SimpleRequest(response_size=size, payload=pb.Payload(body=bytes(size)))
            end = time.perf_counter() + seconds

            async def caller():
                n = 0
                while time.perf_counter() < end:
                    await call(request)
                    n += 1
                return n
            t0 = time.perf_counter()
            counts = await asyncio.gather(*(caller() for _ in range(THREADS)))
            return sum(counts) / (time.perf_counter() - t0)
        return self._run(run())

    def mix(self, mix, n):
        async def run():
            requests, total = _mix_requests(self.pb, MIXES[mix], n, seed=n)
            call = self.stub.UnaryCall

            async def caller(reqs):
                for r in reqs:
                    await call(r)
            t0 = time.perf_counter()
            await asyncio.gather(*(caller(requests[i::MIX_CALLERS]) for i in range(MIX_CALLERS)))
            return total / (time.perf_counter() - t0)
        return self._run(run())

    def stream(self, size, n):
        async def run():
            pb = self.pb
            request = pb.StreamingInputCallRequest(payload=pb.Payload(body=bytes(size)))
            t0 = time.perf_counter()
            call = self.stub.StreamingInputCall()
            for _ in range(n):
                await call.write(request)
            await call.done_writing()
            reply = await call
            elapsed = time.perf_counter() - t0
            if reply.aggregated_payload_size != size * n:
                raise RuntimeError("StreamingInputCall lost bytes")
            return size * n / elapsed
        return self._run(run())

    def close(self):
        self._run(self.channel.close())
        self.loop.call_soon_threadsafe(self.loop.stop)


def drive(kind, port, aio):
    """--client: commands on stdin ("rtt SIZE N", "threads SIZE SECONDS", "mix NAME N",
    "stream SIZE N"), one figure per line on stdout."""
    pb, pb_grpc = generated()
    client = (AioClient if aio else SyncClient)(pb, pb_grpc, kind, port)
    print("ready", flush=True)
    for line in sys.stdin:
        what, a, b = line.split()
        a = a if what == "mix" else int(a)
        print(repr(getattr(client, what)(a, float(b) if what == "threads" else int(b))), flush=True)
    client.close()


# ---------------------------------------------------------------- the run
class Contender:
    """A server process and a client process of one contender."""

    def __init__(self, kind, aio):
        self.kind = kind
        mode = ["--aio"] if aio else []
        root = kind.split("@", 1)[1] if "@" in kind else ROOT
        env = dict(os.environ, PYTHONPATH=root, FABRIC_BENCH_ROOT=root)
        self.server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", kind] + mode,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        port = self.server.stdout.readline().strip()
        if not port:
            raise RuntimeError(f"{kind}: the server did not start")
        self.client = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--client", kind, port] + mode,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        if self.client.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{kind}: the client did not start")

    def ask(self, what, a, b):
        self.client.stdin.write(f"{what} {a} {b}\n")
        self.client.stdin.flush()
        answer = self.client.stdout.readline().strip()
        if not answer:
            raise RuntimeError(f"{self.kind}: {what} {a} {b} failed in the client process")
        return float(answer)

    def close(self):
        for proc in (self.client, self.server):
            try:
                proc.stdin.close()
            except OSError:
                pass
        for proc in (self.client, self.server):
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _busy_loop():
    while True:
        pass


class Busy:
    """A CPU-bound process beside the benchmark while active."""

    def __init__(self, on):
        self.proc = None
        if on:
            self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])

    def close(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


def measures(selected, quick):
    """(name, what, a, b, unit, higher_is_better) of each measurement."""
    out = []
    if "rtt" in selected:
        for size in RTT_SIZES:
            n = {8: 2000, 10 << 10: 1000, 1 << 20: 60}[size]
            out.append((f"rtt {size} B", "rtt", size, max(10, n // (4 if quick else 1)), "us", False))
    if "threads" in selected:
        out.append((f"{THREADS} callers 8 B", "threads", 8, 1.0 if quick else 3.0, "calls/s", True))
    if "mix" in selected:
        for name in MIXES:
            out.append((f"mix {name}", "mix", name, 100 if quick else 300, "MB/s", True))
    if "stream" in selected:
        out.append((f"stream {STREAM_SIZE >> 20} MiB", "stream", STREAM_SIZE, 8 if quick else 32, "MB/s", True))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--measures", default="rtt,threads,mix,stream")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--aio", action="store_true", help="grpc.aio and fabric.grpc.aio on both sides")
    ap.add_argument("--busy", action="store_true", help="a CPU-bound process beside every measurement")
    ap.add_argument("--quick", action="store_true", help="fewer calls per round (a smoke run)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    kinds = args.contenders.split(",")
    if "grpcio" not in kinds:
        kinds.insert(0, "grpcio")
    import grpc
    import google.protobuf
    results = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
               "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                           "platform": platform.platform()},
               "versions": {"grpcio": grpc.__version__, "protobuf": google.protobuf.__version__},
               "aio": args.aio, "busy": args.busy, "rounds": args.rounds, "ucx_tls": os.environ.get("UCX_TLS"),
               "figures": {}}
    contenders = {}
    busy = None
    try:
        for k in kinds:
            contenders[k] = Contender(k, args.aio)
        busy = Busy(args.busy)
        for name, what, a, b, unit, higher in measures(args.measures.split(","), args.quick):
            for c in contenders.values():                     # warm-up
                c.ask(what, a, b if what != "threads" else 0.2)
            samples = {k: [] for k in contenders}
            for _ in range(args.rounds):
                for k, c in contenders.items():
                    v = c.ask(what, a, b)
                    samples[k].append(v * 1e6 if unit == "us" else v / 1e6 if unit == "MB/s" else v)
            row = {}
            base = statistics.median(samples["grpcio"])
            for k, v in samples.items():
                med = statistics.median(v)
                # ratio as the issue states it: time ratio for round trips, rate ratio otherwise
                row[k] = {"median": med, "min": min(v), "max": max(v), "ratio": med / base, "samples": v}
            results["figures"][name] = {"unit": unit, "higher_is_better": higher, "row": row}
            print(f"{name:<20} " + "  ".join(
                f"{k} {r['median']:.4g} [{r['min']:.4g}-{r['max']:.4g}] {unit} ({r['ratio']:.2f}x)"
                for k, r in row.items()), flush=True)
    finally:
        if busy is not None:
            busy.close()
        for c in contenders.values():
            c.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        serve(sys.argv[2], "--aio" in sys.argv)
    elif len(sys.argv) > 3 and sys.argv[1] == "--client":
        drive(sys.argv[2], sys.argv[3], "--aio" in sys.argv)
    else:
        main()
