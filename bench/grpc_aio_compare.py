"""fabric.grpc.aio against grpc.aio: same service, same payloads, one run.

    python bench/grpc_aio_compare.py [--contenders grpc.aio,aio-plain,aio+tcp,aio+ucx,aio-to-grpc.aio]
                                     [--rounds 3] [--json F]

Service /bench.Bench with async handlers: Echo (unary, the request comes
back) and Sink (client streaming; the server answers with the count). Each
contender is a server process and a client process of its own:
  grpc.aio         stock grpc.aio client and server over TCP
  aio-plain        fabric.grpc.aio client and server over a plain TCP socket
  aio+tcp          the same over a fabric stream, tcp backend
  aio+ucx          the same over ucx with UCX_TLS=sm (shared memory)
  aio-to-grpc.aio  a fabric.grpc.aio client calling a stock grpc.aio server
Measured in the client, the program a user writes: `await stub(...)` in a
loop for the 8 B round trip (median of 2000), 16 MiB messages streamed with
write() (MB/s over 32 of them), and 1000 unary calls started at once on one
channel with asyncio.gather (calls/s). Rounds interleave the contenders;
medians; ratios to grpc.aio.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

LIMIT = 256 << 20
OPTIONS = [("grpc.max_receive_message_length", LIMIT), ("grpc.max_send_message_length", LIMIT)]
ENV = {"aio+ucx": {"UCX_TLS": "sm"}}
CONTENDERS = ["grpc.aio", "aio-plain", "aio+tcp", "aio+ucx", "aio-to-grpc.aio"]


async def serve(kind):
    import grpc
    import grpc.aio

    async def echo(request, context):
        return request

    async def sink(request_iterator, context):
        n = 0
        async for _ in request_iterator:
            n += 1
        return str(n).encode()

    handler = grpc.method_handlers_generic_handler("bench.Bench", {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "Sink": grpc.stream_unary_rpc_method_handler(sink)})
    if kind in ("grpc.aio", "aio-to-grpc.aio"):
        server = grpc.aio.server(options=OPTIONS)
        address = "127.0.0.1:0"
    else:
        import fabric.grpc.aio
        server = fabric.grpc.aio.server(options=OPTIONS)
        address = "127.0.0.1:0" if kind == "aio-plain" else f"fabric{kind[3:]}://127.0.0.1:0"
    server.add_generic_rpc_handlers([handler])
    port = server.add_insecure_port(address)
    await server.start()
    import signal
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump_state, server)
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(0)


def dump_state(server):
    """SIGUSR1: the server's connections, calls and fabric engine state, to
    stderr (a stalled run is diagnosed from both sides)."""
    for conn in getattr(server, "_connections", ()):
        print("conn dead", conn.dead, "calls", {sid: (s.ended, len(s.messages), s.local_closed, s.reset_code)
                                                for sid, s in conn.calls.items()}, file=sys.stderr)
        stream = getattr(conn.transport, "stream", None)
        if stream is not None:
            ep = stream.endpoint
            print("endpoint", ep.stats(), file=sys.stderr)
            state = ep.worker._debug_state()
            print("worker", {k: v for k, v in state.items() if k != "endpoints"}, file=sys.stderr)
            print("endpoints", state["endpoints"], file=sys.stderr)
    print("calls in handlers", len(getattr(server, "_calls", ())), "connections ended:",
          list(getattr(server, "_closed_reasons", ())), file=sys.stderr, flush=True)


async def client(kind, port):
    import grpc.aio
    if kind == "grpc.aio":
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS)
    else:
        import fabric.grpc.aio
        target = f"127.0.0.1:{port}" if kind in ("aio-plain", "aio-to-grpc.aio") else f"fabric{kind[3:]}://127.0.0.1:{port}"
        channel = fabric.grpc.aio.insecure_channel(target, options=OPTIONS)
    echo = channel.unary_unary("/bench.Bench/Echo")
    sink = channel.stream_unary("/bench.Bench/Sink")
    small = b"x" * 8
    for _ in range(200):
        await echo(small)
    times = []
    for _ in range(2000):
        t = time.perf_counter()
        await echo(small)
        times.append(time.perf_counter() - t)
    rtt_us = statistics.median(times) * 1e6
    big = os.urandom(16 << 20)
    call = sink()
    for _ in range(2):
        await call.write(big)
    await call.done_writing()
    await call
    t = time.perf_counter()
    call = sink()
    for _ in range(32):
        await call.write(big)
    await call.done_writing()
    assert await call == b"32"
    stream_mbps = 32 * len(big) / (time.perf_counter() - t) / 1e6
    t = time.perf_counter()
    results = await asyncio.gather(*[echo(small) for _ in range(1000)])
    concurrent = 1000 / (time.perf_counter() - t)
    assert all(r == small for r in results)
    await channel.close()
    return {"rtt_8B_us": rtt_us, "stream_16MiB_MBps": stream_mbps, "concurrent_calls_per_s": concurrent}


def run_one(kind):
    env = dict(os.environ, **ENV.get(kind, {}), PYTHONPATH=ROOT)
    server = subprocess.Popen([sys.executable, __file__, "--serve", kind], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        port = int(server.stdout.readline())
        out = subprocess.run([sys.executable, __file__, "--client", kind, str(port)], capture_output=True,
                             text=True, env=env, timeout=600)
        if out.returncode != 0:
            raise RuntimeError(f"{kind} client failed: {out.stderr[-2000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        server.stdin.close()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--client", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve))
        return
    if args.client:
        print(json.dumps(asyncio.run(client(args.client[0], int(args.client[1])))))
        return
    kinds = args.contenders.split(",")
    runs = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for k in kinds:
            runs[k].append(run_one(k))
    summary = {}
    for k in kinds:
        summary[k] = {m: statistics.median(r[m] for r in runs[k]) for m in runs[k][0]}
    base = summary.get("grpc.aio")
    print(f"{'contender':18} {'8 B rtt us':>11} {'16 MiB stream MB/s':>19} {'1000 concurrent calls/s':>24}")
    for k in kinds:
        s = summary[k]
        ratio = ""
        if base and k != "grpc.aio":
            ratio = (f"   (rtt x{s['rtt_8B_us'] / base['rtt_8B_us']:.2f}, stream x"
                     f"{s['stream_16MiB_MBps'] / base['stream_16MiB_MBps']:.2f}, calls/s x"
                     f"{s['concurrent_calls_per_s'] / base['concurrent_calls_per_s']:.2f})")
        print(f"{k:18} {s['rtt_8B_us']:11.1f} {s['stream_16MiB_MBps']:19.0f} {s['concurrent_calls_per_s']:24.0f}{ratio}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "machine": platform.platform(), "rounds": args.rounds,
                       "runs": runs, "medians": summary}, f, indent=1)


if __name__ == "__main__":
    main()
