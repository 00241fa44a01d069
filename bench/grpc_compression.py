"""What gzip costs a gRPC call: fabric.grpc against grpcio, side by side.

    python bench/grpc_compression.py [--size 1M] [--calls 200] [--json F]

A unary Echo of a compressible 1 MiB message (text-like: words drawn from a
small vocabulary, ~4:1 under gzip) over plain TCP, each stack as its own
client and server processes, with and without gzip on the channel and the
server. Beside them, zlib alone: compressing and inflating the message
twice (request and response), which is the least a gzip round trip costs.
Medians; the figure to read is (stack with gzip - stack without) against
zlib alone.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import zlib
from concurrent import futures

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


def message(size):
    rng = random.Random(1)
    words = [bytes(rng.choice(b"abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) + b" "
             for _ in range(2000)]
    out = bytearray()
    while len(out) < size:
        out += rng.choice(words)
    return bytes(out[:size])


def serve(stack, gzip):
    import grpc
    compression = grpc.Compression.Gzip if gzip else None
    handler = grpc.method_handlers_generic_handler("bench.Bench", {
        "Echo": grpc.unary_unary_rpc_method_handler(lambda r, c: r)})
    make = grpc.server if stack == "grpcio" else __import__("fabric.grpc", fromlist=["server"]).server
    server = make(futures.ThreadPoolExecutor(4), options=OPTIONS, compression=compression, handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    sys.stdin.read()
    server.stop(0)


def client(stack, gzip, port, size, calls):
    import grpc
    compression = grpc.Compression.Gzip if gzip else None
    make = grpc.insecure_channel if stack == "grpcio" else __import__("fabric.grpc", fromlist=["x"]).insecure_channel
    channel = make(f"127.0.0.1:{port}", options=OPTIONS, compression=compression)
    echo = channel.unary_unary("/bench.Bench/Echo")
    data = message(size)
    for _ in range(10):
        assert echo(data, timeout=30) == data
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        echo(data, timeout=30)
        times.append(time.perf_counter() - t)
    channel.close()
    return statistics.median(times) * 1e6


def zlib_alone(size, calls):
    data = message(size)
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        for _ in range(2):
            c = zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, 31)
            packed = c.compress(data) + c.flush()
            zlib.decompressobj(31).decompress(packed)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6, len(data) / len(packed)


def run_one(stack, gzip, size, calls):
    env = dict(os.environ, PYTHONPATH=ROOT)
    server = subprocess.Popen([sys.executable, __file__, "--serve", stack, str(int(gzip))], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        port = int(server.stdout.readline())
        out = subprocess.run([sys.executable, __file__, "--client", stack, str(int(gzip)), str(port), str(size),
                              str(calls)], capture_output=True, text=True, env=env, timeout=600)
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-2000:])
        return float(out.stdout.strip().splitlines()[-1])
    finally:
        server.stdin.close()
        server.wait(10)


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1M")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--client", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve[0], args.serve[1] == "1")
        return
    if args.client:
        stack, gz, port, size, calls = args.client
        print(client(stack, gz == "1", int(port), int(size), int(calls)))
        return
    size = parse_size(args.size)
    runs = {}
    for _ in range(args.rounds):
        for stack in ("grpcio", "fabric.grpc"):
            for gz in (False, True):
                runs.setdefault(f"{stack} {'gzip' if gz else 'identity'}", []).append(run_one(stack, gz, size, args.calls))
    med = {k: statistics.median(v) for k, v in runs.items()}
    z, ratio = zlib_alone(size, args.calls)
    print(f"{args.size} unary round trip, median us (compression ratio {ratio:.1f}:1); zlib alone {z:.0f} us")
    for stack in ("grpcio", "fabric.grpc"):
        plain, gz = med[f"{stack} identity"], med[f"{stack} gzip"]
        print(f"  {stack:12} identity {plain:8.0f}  gzip {gz:8.0f}  gzip costs {gz - plain:8.0f} us "
              f"({(gz - plain) / z:.2f}x zlib alone)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "runs": runs, "medians": med, "zlib_alone_us": z,
                       "ratio": ratio}, f, indent=1)


if __name__ == "__main__":
    main()
