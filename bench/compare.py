"""Side by side, in one run: fabric on every available backend against a raw
Python socket, pyzmq, grpcio (unary and streaming) and ucx_perftest (C, from
the libucx wheel) on the same UCX transports.

    python bench/compare.py [--lat-sizes 8,...,64M] [--bw-sizes 64K,1M,16M,64M] [--rounds 3]
                            [--contenders ...] [--json out.json] [--plot out.png]

Every contender is a client in this process (ucx_perftest: its own client
process) talking to a server process on loopback. For each size, rounds are
interleaved across contenders; the figure is the median over rounds.
  lat  round trip of a message of that size both ways (us)
  bw   one-way streaming of that size with a window in flight, then a 1-byte
       acknowledgement (MB/s)
Contenders: fabric/tcp, fabric/ucx-tcp and fabric/ucx-sm (UCX_TLS=tcp / sm),
fabric/verbs where an RDMA device exists; socket (length-prefixed sendmsg /
recv_into); zmq (DEALER/ROUTER, zero-copy sends from 64 KiB); grpc-unary (one
call per message; bw: calls in flight as futures); grpc-stream (bidirectional
stream ping-pong; bw: client streaming); perftest-tcp, perftest-sm
(ucx_perftest tag_lat x 2 and tag_bw with UCX_TLS=tcp / sm). Ratios are
fabric / peer from the same run: lat < 1 and bw > 1 mean fabric is faster.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench.p2p import FabricClient, GrpcClient, SocketClient, ZmqClient, start_server  # noqa: E402

UCX_VARIANTS = {"tcp": {}, "ucx-tcp": {"UCX_TLS": "tcp"}, "ucx-sm": {"UCX_TLS": "sm"}, "verbs": {}}


def parse_size_list(text):
    from fabric.perf.cli import parse_sizes
    return parse_sizes(text)


class FabricContender(FabricClient):
    """bench/p2p's fabric client with its own server process; UCX variants
    set UCX_TLS for both (UCX reads it when a Fabric opens its context)."""

    def __init__(self, variant):
        backend = "ucx" if variant.startswith("ucx") else variant
        env = UCX_VARIANTS[variant]
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            self.proc, address = start_server(f"fabric-{backend}", env_extra=env)
            super().__init__(backend, address)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def stream(self, payload, n, window=8):
        return super().stream(payload, n, window)

    def close(self):
        super().close()
        self.proc.kill()
        self.proc.wait()


class GrpcUnary(GrpcClient):
    def __init__(self):
        self.proc, address = start_server("grpc")
        super().__init__(address)
        self.put = self.channel.unary_unary("/bench.Bench/Put")

    def stream(self, payload, n, window=8):
        t0 = time.perf_counter()
        pending = []
        for _ in range(n):
            pending.append(self.put.future(payload))
            if len(pending) >= window:
                pending.pop(0).result()
        for f in pending:
            f.result()
        return time.perf_counter() - t0

    def close(self):
        super().close()
        self.proc.kill()
        self.proc.wait()


class GrpcStream(GrpcClient):
    """One long-lived bidirectional stream for ping-pong; client streaming for bw."""

    def __init__(self):
        import queue
        self.proc, address = start_server("grpc")
        super().__init__(address)
        self.requests = queue.SimpleQueue()
        stop = object()
        self.stop = stop
        pingpong = self.channel.stream_stream("/bench.Bench/PingPong")

        def gen():
            while True:
                item = self.requests.get()
                if item is stop:
                    return
                yield item
        self.responses = pingpong(gen())

    def rtt(self, payload, n):
        put, responses = self.requests.put, self.responses
        t0 = time.perf_counter()
        for _ in range(n):
            put(payload)
            next(responses)
        return (time.perf_counter() - t0) / n

    def stream(self, payload, n, window=8):
        return GrpcClient.stream(self, payload, n)

    def close(self):
        self.requests.put(self.stop)
        try:
            for _ in self.responses:
                pass
        except Exception:
            pass
        super().close()
        self.proc.kill()
        self.proc.wait()


class Served:
    """A bench/p2p client with its own server process."""

    def __init__(self, kind, cls):
        self.proc, address = start_server(kind)
        self.client = cls(address)

    def rtt(self, payload, n):
        return self.client.rtt(payload, n)

    def stream(self, payload, n, window=8):
        return self.client.stream(payload, n)

    def close(self):
        self.client.close()
        self.proc.kill()
        self.proc.wait()


class Perftest:
    """ucx_perftest (C) on the same transport: tag_lat (one-way, doubled) and tag_bw."""

    def __init__(self, tls):
        from bench.ucx_compare import perftest_paths, ucx_perftest
        perftest_paths()            # raises ImportError without the libucx wheel
        self.tls, self.run = tls, ucx_perftest
        self.port = 14500 + (os.getpid() + hash(tls)) % 1000

    def rtt(self, payload, n):
        return 2 * self.run("tag_lat", len(payload), max(n, 100), self.tls, self.port)["p50_us"] / 1e6

    def stream(self, payload, n, window=8):
        mbps = self.run("tag_bw", len(payload), max(n, 20), self.tls, self.port)["MBps"]
        return len(payload) * n / (mbps * 1e6)

    def close(self):
        pass


def default_contenders():
    import fabric
    avail = fabric.available_backends()
    names = ["fabric/tcp"]
    if avail.get("ucx", (False,))[0]:
        names += ["fabric/ucx-tcp", "fabric/ucx-sm"]
    if avail.get("verbs", (False,))[0]:
        names.append("fabric/verbs")
    names += ["socket", "zmq", "grpc-unary", "grpc-stream"]
    try:
        import libucx  # noqa: F401
        names += ["perftest-tcp", "perftest-sm"]
    except ImportError:
        pass
    return names


def make(name):
    if name.startswith("fabric/"):
        return FabricContender(name.split("/", 1)[1])
    if name == "socket":
        return Served("socket", SocketClient)
    if name == "zmq":
        return Served("zmq", ZmqClient)
    if name == "grpc-unary":
        return GrpcUnary()
    if name == "grpc-stream":
        return GrpcStream()
    if name.startswith("perftest-"):
        return Perftest(name.split("-", 1)[1])
    raise SystemExit(f"unknown contender {name!r}")


def lat_iterations(size):
    return max(5, min(2000, (128 << 20) // max(size, 1)))


def bw_count(size):
    return max(8, min(2000, (256 << 20) // max(size, 1)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lat-sizes", default="8-64M")
    ap.add_argument("--bw-sizes", default="64K,1M,16M,64M")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--contenders", default=None, help="comma list (default: everything available)")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args(argv)
    names = args.contenders.split(",") if args.contenders else default_contenders()
    lat_sizes, bw_sizes = parse_size_list(args.lat_sizes), parse_size_list(args.bw_sizes)
    contenders = {}
    try:
        for n in names:
            contenders[n] = make(n)
        lat = {s: {} for s in lat_sizes}
        bw = {s: {} for s in bw_sizes}
        for s in lat_sizes:
            payload = os.urandom(s)
            n = lat_iterations(s)
            samples = {name: [] for name in contenders}
            for name, c in contenders.items():
                if not name.startswith("perftest"):
                    c.rtt(payload, max(2, n // 10))             # warm-up
            for _ in range(args.rounds):
                for name, c in contenders.items():
                    samples[name].append(c.rtt(payload, n) * 1e6)
            lat[s] = {name: statistics.median(v) for name, v in samples.items()}
            print(f"lat {s:>9} B  " + "  ".join(f"{k} {v:.1f}" for k, v in lat[s].items()), flush=True)
        for s in bw_sizes:
            payload = os.urandom(s)
            n = bw_count(s)
            samples = {name: [] for name in contenders}
            for name, c in contenders.items():
                if not name.startswith("perftest"):
                    c.stream(payload, max(2, n // 10))
            for _ in range(args.rounds):
                for name, c in contenders.items():
                    samples[name].append(s * n / c.stream(payload, n) / 1e6)
            bw[s] = {name: statistics.median(v) for name, v in samples.items()}
            print(f"bw  {s:>9} B  " + "  ".join(f"{k} {v:.0f}" for k, v in bw[s].items()), flush=True)
    finally:
        for c in contenders.values():
            try:
                c.close()
            except Exception:
                pass
    fabric_names = [n for n in contenders if n.startswith("fabric/")]
    peers = [n for n in contenders if not n.startswith("fabric/")]
    ratios = {f: {p: {"lat": {s: lat[s][f] / lat[s][p] for s in lat_sizes},
                      "bw": {s: bw[s][f] / bw[s][p] for s in bw_sizes}} for p in peers} for f in fabric_names}
    print("\nratios fabric / peer (lat: < 1 faster; bw: > 1 faster)")
    for f in fabric_names:
        for p in peers:
            r = ratios[f][p]
            print(f"{f:>15} / {p:<13} lat " + " ".join(f"{v:.2f}" for v in r["lat"].values())
                  + " | bw " + " ".join(f"{v:.2f}" for v in r["bw"].values()))
    import fabric
    results = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
               "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                           "platform": platform.platform()},
               "versions": {"fabric": fabric.__version__,
                            "backends": {k: v[1] for k, v in fabric.available_backends().items()}},
               "rounds": args.rounds, "lat_us": lat, "bw_MBps": bw, "ratios": ratios}
    try:
        import grpc
        import zmq
        results["versions"].update(grpcio=grpc.__version__, pyzmq=zmq.__version__)
    except ImportError:
        pass
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if args.plot:
        plot(results, args.plot)
    return results


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.4))
    names = list(next(iter(results["lat_us"].values())))
    for name in names:
        style = "-" if name.startswith("fabric/") else "--"
        xs = sorted(results["lat_us"], key=int)
        a.plot([int(x) for x in xs], [results["lat_us"][x][name] for x in xs], style, marker="o", ms=3, label=name)
        xs = sorted(results["bw_MBps"], key=int)
        b.plot([int(x) for x in xs], [results["bw_MBps"][x][name] for x in xs], style, marker="o", ms=3, label=name)
    for ax, title, ylabel in ((a, "Round trip", "p50 round trip (us)"), (b, "One-way streaming", "MB/s")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
