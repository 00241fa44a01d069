"""Point-to-point benchmark: fabric against a raw Python socket, grpcio and
pyzmq, in one run, two processes each, interleaved round by round; medians.

    python bench/p2p.py [--backends tcp] [--sizes 8,65536,...] [--rounds 5] [--json out.json]

Latency is the ping-pong round trip (same size both ways). Throughput is
one-way streaming of `--stream-size` messages with a window in flight and a
1-byte acknowledgement at the end. Ratios are fabric / peer from the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import struct
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

HDR = struct.Struct("<QB")
MAX = 64 << 20


def parse_contender(spec):
    """'tcp' or 'tcp@spin_us=0,eager_limit=1M': backend and option overrides."""
    backend, _, rest = spec.partition("@")
    opts = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    return backend, opts


def start_server(kind, options=None, env_extra=None):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE))
    env.update(env_extra or {})
    for k, v in (options or {}).items():
        env["FABRIC_" + k.upper()] = v
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "servers.py"), kind],
                            stdout=subprocess.PIPE, text=True, env=env)
    address = proc.stdout.readline().strip()
    if not address:
        raise RuntimeError(f"server {kind} did not start")
    return proc, address


def iterations(size, budget_bytes=256 << 20, lo=5, hi=2000):
    return max(lo, min(hi, budget_bytes // max(size, 1)))


class FabricClient:
    def __init__(self, backend, address, options=None):
        import fabric
        self.fab = fabric.Fabric(backend, **(options or {}))
        self.ep = self.fab.connect(address, timeout=30)
        self.buf = bytearray(MAX)

    def rtt(self, payload, n):
        ep, buf = self.ep, self.buf
        send, recv_into = ep.send, ep.recv_into
        t0 = time.perf_counter()
        for _ in range(n):
            send(payload)
            recv_into(buf)
        return (time.perf_counter() - t0) / n

    def stream(self, payload, n, window=4):
        ep = self.ep
        payload = b"\x51" + payload[1:]
        t0 = time.perf_counter()
        reqs = []
        for _ in range(n):
            reqs.append(ep.isend(payload))
            if len(reqs) >= window:
                reqs.pop(0).wait()
        for r in reqs:
            r.wait()
        ep.send(b"\xac")
        ep.recv_into(self.buf)
        return time.perf_counter() - t0

    def close(self):
        self.ep.close()


class SocketClient:
    def __init__(self, address):
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray(MAX + HDR.size)
        self.view = memoryview(self.buf)

    def _recv_exact(self, n):
        got, view, sock = 0, self.view, self.sock
        while got < n:
            got += sock.recv_into(view[got:n])

    def rtt(self, payload, n):
        hdr = HDR.pack(len(payload), 0)
        sock = self.sock
        t0 = time.perf_counter()
        for _ in range(n):
            sock.sendmsg([hdr, payload])
            self._recv_exact(HDR.size + len(payload))
        return (time.perf_counter() - t0) / n

    def stream(self, payload, n):
        hdr = HDR.pack(len(payload), 1)
        t0 = time.perf_counter()
        for _ in range(n):
            self.sock.sendall(hdr)
            self.sock.sendall(payload)
        self.sock.sendall(HDR.pack(0, 2))
        self._recv_exact(1)
        return time.perf_counter() - t0

    def close(self):
        self.sock.close()


class GrpcClient:
    def __init__(self, address):
        import grpc
        opts = [("grpc.max_receive_message_length", MAX + 1024), ("grpc.max_send_message_length", MAX + 1024)]
        self.channel = grpc.insecure_channel(address, options=opts)
        self.echo = self.channel.unary_unary("/bench.Bench/Echo")
        self.sink = self.channel.stream_unary("/bench.Bench/Sink")
        grpc.channel_ready_future(self.channel).result(timeout=30)

    def rtt(self, payload, n):
        echo = self.echo
        t0 = time.perf_counter()
        for _ in range(n):
            echo(payload)
        return (time.perf_counter() - t0) / n

    def stream(self, payload, n):
        t0 = time.perf_counter()
        self.sink(iter([payload] * n))
        return time.perf_counter() - t0

    def close(self):
        self.channel.close()


class ZmqClient:
    def __init__(self, address):
        import zmq
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect("tcp://" + address)

    def rtt(self, payload, n):
        sock = self.sock
        t0 = time.perf_counter()
        for _ in range(n):
            sock.send(payload, copy=len(payload) < 65536)
            sock.recv(copy=False)
        return (time.perf_counter() - t0) / n

    def stream(self, payload, n):
        payload = b"\x51" + payload[1:]
        t0 = time.perf_counter()
        for _ in range(n):
            self.sock.send(payload, copy=False)
        self.sock.send(b"\xac")
        self.sock.recv()
        return time.perf_counter() - t0

    def close(self):
        self.sock.close(linger=0)
        self.ctx.term()


def make_clients(backends, peers):
    servers, clients = [], {}
    for spec in backends:
        b, opts = parse_contender(spec)
        proc, addr = start_server(f"fabric-{b}", opts)
        servers.append(proc)
        clients[f"fabric/{spec}"] = FabricClient(b, addr, opts)
    for kind, cls in (("socket", SocketClient), ("grpc", GrpcClient), ("zmq", ZmqClient)):
        if kind in peers:
            proc, addr = start_server(kind)
            servers.append(proc)
            clients[kind] = cls(addr)
    return servers, clients


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="tcp",
                    help="fabric contenders: backend[@option=value,...], comma-separated by ';'")
    ap.add_argument("--peers", default="socket,grpc,zmq")
    ap.add_argument("--sizes", default=",".join(str(1 << k) for k in range(3, 27, 1)))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--stream-size", type=int, default=16 << 20)
    ap.add_argument("--stream-count", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    backends = [b for b in args.backends.split(";") if b]
    peers = [p for p in args.peers.split(",") if p]
    sizes = [int(s) for s in args.sizes.split(",")]
    servers, clients = make_clients(backends, peers)
    results = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                           "platform": platform.platform()},
               "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
               "latency_us": {}, "throughput_MBps": {}}
    try:
        for size in sizes:
            payload = os.urandom(size)
            n = iterations(size)
            samples = {name: [] for name in clients}
            for name, c in clients.items():      # warm-up, excluded
                c.rtt(payload, max(2, n // 10))
            for _ in range(args.rounds):
                for name, c in clients.items():
                    samples[name].append(c.rtt(payload, n) * 1e6)
            row = {name: statistics.median(v) for name, v in samples.items()}
            results["latency_us"][size] = row
            print(f"rtt {size:>9} B  " + "  ".join(f"{k} {v:9.1f}us" for k, v in row.items()), flush=True)
        payload = os.urandom(args.stream_size)
        samples = {name: [] for name in clients}
        for name, c in clients.items():
            c.stream(payload, 2)
        for _ in range(args.rounds):
            for name, c in clients.items():
                t = c.stream(payload, args.stream_count)
                samples[name].append(args.stream_size * args.stream_count / t / 1e6)
        row = {name: statistics.median(v) for name, v in samples.items()}
        results["throughput_MBps"][args.stream_size] = row
        print(f"one-way {args.stream_size} B  " + "  ".join(f"{k} {v:8.0f}MB/s" for k, v in row.items()))
    finally:
        for c in clients.values():
            c.close()
        for p in servers:
            p.kill()
            p.wait()
    ratios = {}
    for b in backends:
        f = f"fabric/{b}"
        for peer in clients:
            if peer == f:
                continue
            ratios[f"{f} / {peer}"] = {
                "rtt": {s: results["latency_us"][s][f] / results["latency_us"][s][peer] for s in sizes},
                "throughput": {s: results["throughput_MBps"][s][f] / results["throughput_MBps"][s][peer]
                               for s in results["throughput_MBps"]}}
    results["ratios"] = ratios
    for name, r in ratios.items():
        print(f"{name}: rtt ratio " + " ".join(f"{s}:{v:.2f}" for s, v in r["rtt"].items())
              + "  throughput ratio " + " ".join(f"{v:.2f}" for v in r["throughput"].values()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
