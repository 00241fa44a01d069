"""Where the time of one small gRPC call goes, on each side.

    python bench/grpc_profile.py [--kinds fabric+ucx,fabric-plain,grpcio] [--aio] [--calls 2000]
                                 [--root DIR] [--json F]

For each kind (as in bench/grpc_user.py: both ends fabric.grpc over
fabric+ucx, fabric+tcp or plain TCP, or grpcio on both ends), a server
process and a client process, gRPC's test service, 8 B UnaryCall in a
blocking loop (or an awaited loop with --aio). Two passes:
  1. unprofiled: wall time per call, CPU time per call of each process,
     threads each process ran, voluntary context switches per call;
  2. profiled (cProfile on every thread, thread CPU time as its clock): CPU
     microseconds per call by category, on the client and on the server:
       HTTP/2 core     fabric's C core (fabric.grpc._h2, _hpack)
       HTTP/2 (h2)     h2, hpack, hyperframe (the pure-Python core, before)
       gRPC layer      fabric/grpc/*.py (calls, contexts, connection drivers)
       protobuf        serialization and parsing
       hand-offs       threads, locks, queues, executors, events (waking and being woken)
       engine          fabric's byte stream and endpoint calls (a wait that
                       spins counts here; one that blocks costs no CPU)
       asyncio         the event loop's own work (with --aio)
       grpcio          grpcio's own Python and Cython layers
       other           everything else (the servicer, the benchmark loop)
--root runs another checkout of fabric (an older commit, for "before").
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import resource
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

CATEGORIES = ("HTTP/2 core", "HTTP/2 (h2)", "gRPC layer", "protobuf", "hand-offs", "engine", "asyncio",
              "grpcio", "other")


def category(filename: str, name: str) -> str:
    text = filename + " " + name
    if "fabric.grpc._h2" in text or "fabric.grpc._hpack" in text or "/fabric/grpc/_h2." in text \
            or "/fabric/grpc/_hpack." in text:
        return "HTTP/2 core"
    if "/h2/" in filename or "/hpack/" in filename or "/hyperframe/" in filename:
        return "HTTP/2 (h2)"
    if "/fabric/grpc/_transport" in filename or "fabric/stream.py" in filename or "fabric.protocol" in text \
            or "fabric/aio.py" in filename or "fabric/api.py" in filename or "fabric.Endpoint" in text \
            or "'Endpoint' objects" in text or "'Request' objects" in text:
        return "engine"
    if "/fabric/grpc/" in filename:
        return "gRPC layer"
    if "protobuf" in text or "SerializeToString" in name or "FromString" in name or "ParseFromString" in name:
        return "protobuf"
    if "/grpc/" in filename or "cygrpc" in text or "grpc._cython" in text:
        return "grpcio"
    if "threading.py" in filename or "/queue.py" in filename or "concurrent/futures" in filename or \
            "_thread." in text or "'_queue" in text or "lock' objects" in text or "SimpleQueue" in text:
        return "hand-offs"
    if "/asyncio/" in filename or "_asyncio" in text or "select.epoll" in text or "selectors.py" in filename:
        return "asyncio"
    return "other"


class ThreadProfiles:
    """cProfile on every thread of the process (thread CPU time as its
    clock), on from the process's start: Python 3.11 cannot hook threads that
    are already running, and a server's reader and executor threads start
    before the measurement. start() clears what was counted so far."""

    def __init__(self):
        self.profiles = []
        self.lock = threading.Lock()

    def _new(self):
        p = cProfile.Profile(time.thread_time)
        with self.lock:
            self.profiles.append(p)
        p.enable()

    def _hook(self, frame, event, arg):
        sys.setprofile(None)                   # this thread's hook: replaced by its own profiler
        self._new()

    def install(self):
        threading.setprofile(self._hook)       # every thread started from now on
        self._new()                            # this one

    def _totals(self):
        """(file, function) -> inline time so far, over every thread's profile."""
        out = {}
        with self.lock:
            profiles = list(self.profiles)
        for p in profiles:
            for e in p.getstats():
                code = e.code
                key = (code.co_filename, code.co_name) if hasattr(code, "co_filename") else ("~", str(code))
                out[key] = out.get(key, 0.0) + e.inlinetime
        return out

    def start(self):
        self.base = self._totals()

    def stop(self):
        now = self._totals()
        return {k: v - self.base.get(k, 0.0) for k, v in now.items() if v - self.base.get(k, 0.0) > 0}


def categorize(times, calls):
    out = dict.fromkeys(CATEGORIES, 0.0)
    top = []
    for (filename, name), t in (times or {}).items():
        c = category(filename, name)
        out[c] += t
        top.append((t, c, f"{os.path.basename(filename)}:{name}"))
    top.sort(reverse=True)
    return ({k: v / calls * 1e6 for k, v in out.items()},
            [(round(t / calls * 1e6, 2), c, where) for t, c, where in top[:25]])


# ---------------------------------------------------------------- the two processes
def usage():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_nvcsw, r.ru_nivcsw, r.ru_minflt


def run_side(role, kind, port, aio, root):
    """--serve / --client: commands on stdin (start PROFILE, stop CALLS, call N), JSON replies."""
    if root:
        sys.path.insert(0, root)
    import grpc_user
    pb, pb_grpc = grpc_user.generated()
    profiles = ThreadProfiles() if f"--profile={role}" in sys.argv else None
    if profiles is not None:
        profiles.install()
    base = None
    if role == "server":
        server_ready = threading.Event()
        holder = {}

        def serve():
            if aio:
                import asyncio
                loop = asyncio.new_event_loop()
                holder["loop"] = loop
                loop.run_until_complete(_aio_server(pb, pb_grpc, kind, holder, server_ready))
                loop.run_forever()
            else:
                from concurrent import futures
                _, stack, transport = grpc_user.stacks(kind)
                pool = futures.ThreadPoolExecutor(max_workers=8)
                if stack == "grpcio":
                    import grpc
                    server = grpc.server(pool, options=grpc_user.OPTIONS)
                else:
                    import fabric.grpc
                    server = fabric.grpc.server(pool, options=grpc_user.OPTIONS)
                pb_grpc.add_TestServiceServicer_to_server(grpc_user._servicer(pb, pb_grpc, False), server)
                holder["port"] = server.add_insecure_port(grpc_user._server_address(transport))
                server.start()
                holder["server"] = server
                server_ready.set()
        threading.Thread(target=serve, daemon=True).start()
        server_ready.wait(60)
        print(holder["port"], flush=True)
        client = None
    else:
        client = (grpc_user.AioClient if aio else grpc_user.SyncClient)(pb, pb_grpc, kind, port)
        print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if words[0] == "start":
            if profiles is not None:
                profiles.start()
            base = (usage(), threading.active_count())
            print("{}", flush=True)
        elif words[0] == "call":
            n, size = int(words[1]), int(words[2])
            t = client.rtt(size, n)
            print(json.dumps({"wall_us": t * 1e6}), flush=True)
        elif words[0] == "stop":
            calls = int(words[1])
            (cpu0, vol0, invol0, flt0), threads0 = base
            cpu1, vol1, invol1, flt1 = usage()
            stats = profiles.stop() if profiles is not None else None
            cats, top = categorize(stats, calls)
            print(json.dumps({"cpu_us": (cpu1 - cpu0) / calls * 1e6, "voluntary_switches": (vol1 - vol0) / calls,
                              "involuntary_switches": (invol1 - invol0) / calls,
                              "page_faults": (flt1 - flt0) / calls,
                              "threads": threading.active_count(), "categories": cats, "top": top}), flush=True)
    if client is not None:
        client.close()


async def _aio_server(pb, pb_grpc, kind, holder, ready):
    import grpc_user
    _, stack, transport = grpc_user.stacks(kind)
    if stack == "grpcio":
        import grpc.aio
        server = grpc.aio.server(options=grpc_user.OPTIONS)
    else:
        import fabric.grpc.aio
        server = fabric.grpc.aio.server(options=grpc_user.OPTIONS)
    pb_grpc.add_TestServiceServicer_to_server(grpc_user._servicer(pb, pb_grpc, True), server)
    holder["port"] = server.add_insecure_port(grpc_user._server_address(transport))
    await server.start()
    holder["server"] = server
    ready.set()


class Pair:
    def __init__(self, kind, aio, root, profile=None):
        env = dict(os.environ, PYTHONPATH=(root or os.path.dirname(HERE)), FABRIC_BENCH_ROOT=(root or os.path.dirname(HERE)))
        args = [sys.executable, os.path.abspath(__file__)]
        extra = (["--aio"] if aio else []) + (["--root", root] if root else []) + ([f"--profile={profile}"] if profile else [])
        self.server = subprocess.Popen(args + ["--side", "server", kind, "0"] + extra, stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True, env=env)
        port = self.server.stdout.readline().strip()
        self.client = subprocess.Popen(args + ["--side", "client", kind, port] + extra, stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True, env=env)
        if self.client.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{kind}: the client did not start")

    @staticmethod
    def ask(proc, line):
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
        return json.loads(proc.stdout.readline())

    def measure(self, calls, size):
        self.ask(self.client, f"call 50 {size}")             # warm
        for p in (self.server, self.client):
            self.ask(p, "start")
        wall = self.ask(self.client, f"call {calls} {size}")["wall_us"]
        client = self.ask(self.client, f"stop {calls}")
        server = self.ask(self.server, f"stop {calls}")
        return {"wall_us": wall, "client": client, "server": server}

    def close(self):
        for p in (self.client, self.server):
            try:
                p.stdin.close()
            except OSError:
                pass
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default="fabric+ucx,fabric-plain,grpcio")
    ap.add_argument("--aio", action="store_true")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--size", type=int, default=8, help="request and response bytes")
    ap.add_argument("--root", help="another checkout of fabric to measure (before)")
    ap.add_argument("--json")
    ap.add_argument("--no-profile", action="store_true", help="the unprofiled pass only")
    args = ap.parse_args(argv)
    results = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "aio": args.aio, "kinds": {}}
    for kind in args.kinds.split(","):
        plain = None
        profiled = {}
        for profile in (None,) if args.no_profile else (None, "client", "server"):   # one side profiled at a time
            pair = Pair(kind, args.aio, args.root, profile)
            try:
                got = pair.measure(args.calls if not profile else max(200, args.calls // 2), args.size)
            finally:
                pair.close()
            if profile:
                profiled[profile] = got[profile]
                profiled[profile]["wall_us"] = got["wall_us"]
            else:
                plain = got
        results["kinds"][kind] = {"unprofiled": plain, "profiled": profiled}
        print(f"== {kind}{' (aio)' if args.aio else ''}: {plain['wall_us']:.0f} us per call; CPU per call: "
              f"client {plain['client']['cpu_us']:.0f} us, server {plain['server']['cpu_us']:.0f} us; "
              f"voluntary switches per call: client {plain['client']['voluntary_switches']:.2f}, "
              f"server {plain['server']['voluntary_switches']:.2f}; page faults per call: client "
              f"{plain['client']['page_faults']:.1f}, server {plain['server']['page_faults']:.1f}; threads: client {plain['client']['threads']}, "
              f"server {plain['server']['threads']}")
        for side in () if args.no_profile else ("client", "server"):
            cats = profiled[side]["categories"]
            print(f"   {side:<6} profiled ({profiled[side]['wall_us']:.0f} us per call), CPU us/call: " + ", ".join(
                f"{k} {v:.1f}" for k, v in cats.items() if v >= 0.5))
            for t, c, where in profiled[side]["top"][:8]:
                print(f"          {t:7.2f}  {c:<12} {where}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    if len(sys.argv) > 4 and sys.argv[1] == "--side":
        root = sys.argv[sys.argv.index("--root") + 1] if "--root" in sys.argv else None
        run_side(sys.argv[2], sys.argv[3], sys.argv[4], "--aio" in sys.argv, root)
    else:
        main()
