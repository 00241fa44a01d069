"""gRPC over fabric against grpcio: same service, same payloads, one run.

    python bench/grpc_compare.py [--rtt-sizes 8,64K,4M,16M] [--stream-sizes 1M,16M]
                                 [--contenders grpcio,fabric+tcp,fabric+ucx,h2-plain,fabric-to-grpcio] [--rounds 5] [--json F]

Service /bench.Bench: Echo (unary, the request comes back) and Sink (client
streaming; the server answers with the message count). Payloads are bytes
(no protobuf), message limits raised to 256 MiB on both sides. Each contender
is a client process and a server process of its own:
  grpcio      stock grpcio client and server over TCP
  fabric+tcp  fabric.grpc client and server over the fabric engine, tcp backend
  fabric+ucx  the same over ucx with UCX_TLS=sm (shared memory)
  h2-plain    fabric.grpc client and server over a plain TCP socket (the HTTP/2
              layer without the fabric engine)
  fabric-to-grpcio  a fabric.grpc client calling a stock grpcio server over TCP
              (the interop path)
Rounds are interleaved across contenders; medians; ratios fabric / grpcio.
The asyncio stacks (grpc.aio against fabric.grpc.aio, the same payloads plus 1000
concurrent calls on one channel) are bench/grpc_aio_compare.py.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent import futures

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

LIMIT = 256 << 20
OPTIONS = [("grpc.max_receive_message_length", LIMIT), ("grpc.max_send_message_length", LIMIT)]
ENV = {"fabric+ucx": {"UCX_TLS": "sm"}}


def serve(kind):
    import grpc

    def echo(request, context):
        return request

    def sink(request_iterator, context):
        n = sum(1 for _ in request_iterator)
        return str(n).encode()

    handler = grpc.method_handlers_generic_handler("bench.Bench", {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "Sink": grpc.stream_unary_rpc_method_handler(sink)})
    pool = futures.ThreadPoolExecutor(max_workers=8)
    if kind in ("grpcio", "fabric-to-grpcio"):
        server = grpc.server(pool, options=OPTIONS)
        address = "127.0.0.1:0"
    else:
        import fabric.grpc
        server = fabric.grpc.server(pool, options=OPTIONS)
        address = "127.0.0.1:0" if kind == "h2-plain" else f"{kind}://127.0.0.1:0"
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port(address)
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


class _Driver:
    """The client side of one contender, in this process (run by --client)."""

    def __init__(self, kind, port):
        if kind == "grpcio":
            import grpc
            self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS)
        else:
            import fabric.grpc
            plain = kind in ("h2-plain", "fabric-to-grpcio")
            target = f"127.0.0.1:{port}" if plain else f"{kind}://127.0.0.1:{port}"
            self.channel = fabric.grpc.insecure_channel(target, options=OPTIONS)
        self.echo = self.channel.unary_unary("/bench.Bench/Echo")
        self.sink = self.channel.stream_unary("/bench.Bench/Sink")
        self.echo(b"warm", timeout=30)
        self.payloads = {}

    def payload(self, size):
        if size not in self.payloads:
            self.payloads = {size: os.urandom(size)}
        return self.payloads[size]

    def rtt(self, size, n):
        payload, echo = self.payload(size), self.echo
        t0 = time.perf_counter()
        for _ in range(n):
            echo(payload)
        return (time.perf_counter() - t0) / n

    def stream(self, size, n):
        payload = self.payload(size)
        t0 = time.perf_counter()
        reply = self.sink(iter([payload] * n))
        elapsed = time.perf_counter() - t0
        assert int(reply) == n
        return elapsed


def drive(kind, port):
    """--client: commands on stdin ("rtt SIZE N", "stream SIZE N"), seconds on stdout."""
    driver = _Driver(kind, port)
    print("ready", flush=True)
    for line in sys.stdin:
        what, size, n = line.split()
        print(repr(getattr(driver, what)(int(size), int(n))), flush=True)
    driver.channel.close()


class Client:
    """One contender: its server and its client each in a process of their
    own, so that no contender runs in an allocator or interpreter state left
    by another (measured: grpcio's 16 MiB round trips took 15.5 ms or 26 ms
    depending on which contenders had run before it in a shared client)."""

    def __init__(self, kind):
        env = dict(os.environ, PYTHONPATH=ROOT, **ENV.get(kind, {}))
        self.server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", kind],
                                       stdout=subprocess.PIPE, text=True, env=env)
        port = self.server.stdout.readline().strip()
        if not port:
            raise RuntimeError(f"{kind} server did not start")
        self.client = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--client", kind, port],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        if self.client.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{kind} client did not start")

    def _ask(self, what, size, n):
        self.client.stdin.write(f"{what} {size} {n}\n")
        self.client.stdin.flush()
        answer = self.client.stdout.readline().strip()
        if not answer:
            raise RuntimeError(f"{what} {size} x{n} failed in the client process")
        return float(answer)

    def rtt(self, size, n):
        return self._ask("rtt", size, n)

    def stream(self, size, n):
        return self._ask("stream", size, n)

    def close(self):
        for proc in (self.client, self.server):
            proc.kill()
            proc.wait()


def main(argv=None):
    from fabric.perf.cli import parse_sizes
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rtt-sizes", default="8,64K,4M,16M")
    ap.add_argument("--stream-sizes", default="1M,16M")
    ap.add_argument("--contenders", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.contenders:
        kinds = args.contenders.split(",")
    else:
        import fabric
        kinds = ["grpcio", "fabric+tcp"] + (["fabric+ucx"] if fabric.available_backends()["ucx"][0] else []) \
            + ["h2-plain", "fabric-to-grpcio"]
    clients = {}
    results = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
               "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                           "platform": platform.platform()}, "rounds": args.rounds, "rtt_us": {}, "stream_MBps": {}}
    try:
        import grpc
        import h2
        results["versions"] = {"grpcio": grpc.__version__, "h2": h2.__version__}
        for k in kinds:
            clients[k] = Client(k)
        for size in parse_sizes(args.rtt_sizes):
            n = max(5, min(2000, (64 << 20) // max(size, 1)))
            samples = {k: [] for k in clients}
            for c in clients.values():
                c.rtt(size, max(2, n // 10))
            for _ in range(args.rounds):
                for k, c in clients.items():
                    samples[k].append(c.rtt(size, n) * 1e6)
            row = {k: statistics.median(v) for k, v in samples.items()}
            results["rtt_us"][size] = row
            print(f"unary rtt {size:>9} B  " + "  ".join(f"{k} {v:9.1f}us" for k, v in row.items())
                  + ("  ratio " + " ".join(f"{k} {row[k] / row['grpcio']:.2f}" for k in row if k != "grpcio")
                     if "grpcio" in row else ""), flush=True)
        for size in parse_sizes(args.stream_sizes):
            n = max(8, min(2000, (256 << 20) // size))
            samples = {k: [] for k in clients}
            for c in clients.values():
                c.stream(size, 2)
            for _ in range(args.rounds):
                for k, c in clients.items():
                    samples[k].append(size * n / c.stream(size, n) / 1e6)
            row = {k: statistics.median(v) for k, v in samples.items()}
            results["stream_MBps"][size] = row
            print(f"stream    {size:>9} B  " + "  ".join(f"{k} {v:8.0f}MB/s" for k, v in row.items())
                  + ("  ratio " + " ".join(f"{k} {row[k] / row['grpcio']:.2f}" for k in row if k != "grpcio")
                     if "grpcio" in row else ""), flush=True)
    finally:
        for c in clients.values():
            c.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        serve(sys.argv[2])
    elif len(sys.argv) > 3 and sys.argv[1] == "--client":
        drive(sys.argv[2], sys.argv[3])
    else:
        main()
