"""Load test: many connections between two processes, threads and event
loops mixed, sizes from 0 B to 64 MiB, every message checked.

    python bench/load.py [--backend tcp] [--connections 256] [--threads 4]
                         [--duration 300] [--max-size 64M] [--json out.json]

Both processes run `--threads` worker threads on one Fabric each. The
connections are split among them in groups: half the groups are served by
blocking threads on both sides (the client sends a request on each of its
connections in turn and waits for the answer), half by one asyncio event
loop per thread (a coroutine per connection). Every request carries its
connection, a sequence number and a CRC-32 of its payload; the server checks
that each connection's requests arrive whole, in order, once, and answers
with a small acknowledgement or, every 16th time, with a message of its own
(random size, same checks on the client). Sizes: 70% up to 4 KiB, 25% up to
1 MiB, 5% up to --max-size; at most two messages above 8 MiB are in flight
per process (memory). At the end every connection is closed, then the Fabric;
RSS (after malloc_trim), descriptors, threads and registrations must be back
where they started. Reports connections, messages, bytes, duration, peak RSS
and every violation (there must be none). tests/test_load.py runs a short
version in CI.
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import random
import resource
import struct
import subprocess
import sys
import threading
import time
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import fabric  # noqa: E402

REQ = struct.Struct("<IQQI")     # connection, sequence, payload length, crc32
ANSWER = struct.Struct("<IQBQ")  # connection, sequence, flags (1: ok, 2: a message follows), its length
OK, FOLLOWS = 1, 2
BIG = 8 << 20
POOL_SIZE = 65 << 20
OPTIONS = dict(recv_budget=32 << 20, close_linger=10.0)


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = str(text).strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def pick_size(rng, max_size):
    r = rng.random()
    if r < 0.70:
        return rng.randint(0, 4096)
    if r < 0.95:
        return rng.randint(4097, 1 << 20)
    return rng.randint((1 << 20) + 1, max_size)


class Pool:
    """Random bytes to send from (slices, no copy): generating 64 MiB per
    message would measure the generator."""

    def __init__(self, seed):
        self.data = random.Random(seed).randbytes(POOL_SIZE)
        self.view = memoryview(self.data)

    def slice(self, rng, size):
        start = rng.randint(0, POOL_SIZE - size)
        return self.view[start:start + size]


def fd_count():
    return len(os.listdir("/proc/self/fd"))


def thread_count():
    return len(os.listdir("/proc/self/task"))


def rss_bytes():
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def domain_refs(fab):
    return getattr(fab._worker.domain, "refs", None)


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.messages = 0
        self.bytes = 0
        self.violations = []
        self.last = time.monotonic()
        self.stalls = []

    def add(self, n):
        with self.lock:
            self.messages += 1
            self.bytes += n
            self.last = time.monotonic()

    def violation(self, text):
        with self.lock:
            if len(self.violations) < 50:
                self.violations.append(text)


def guarded(target, tally, name):
    """A worker whose exception (a timeout: something hung) is a violation."""
    def run(*args):
        try:
            target(*args)
        except Exception as e:      # noqa: BLE001 - reported as a violation
            tally.violation(f"{name}: {type(e).__name__}: {e}")
    return run


def watchdog(fab, tally, stop, name, quiet=20.0):
    """Record the engine's state when nothing completed for `quiet` seconds."""
    while not stop.wait(1.0):
        if time.monotonic() - tally.last > quiet and len(tally.stalls) < 3:
            tally.stalls.append({"who": name, "at_messages": tally.messages,
                                 "state": fab._worker._debug_state()})
            tally.last = time.monotonic()


class BigGate:
    """At most two messages above BIG in flight in this process."""

    def __init__(self):
        self.sem = threading.BoundedSemaphore(2)

    def __call__(self, size):
        return self.sem if size > BIG else None


# ------------------------------------------------------------------ server

def serve_request(ep, conn, expected_seq, head, payload_view, tally, rng, pool, max_size):
    """Check one request; build the answer (and maybe a message of our own)."""
    c, seq, length, crc = REQ.unpack_from(head)
    ok = True
    if c != conn or seq != expected_seq or length != len(payload_view):
        tally.violation(f"server: connection {conn} expected request {expected_seq}, got "
                        f"connection {c} request {seq} of {length} bytes ({len(payload_view)} arrived)")
        ok = False
    elif zlib.crc32(payload_view) != crc:
        tally.violation(f"server: connection {conn} request {seq} arrived corrupted")
        ok = False
    tally.add(len(payload_view))
    follow = None
    if seq % 16 == 15:
        follow = pool.slice(rng, min(pick_size(rng, max_size), BIG))
    flags = (OK if ok else 0) | (FOLLOWS if follow is not None else 0)
    answer = ANSWER.pack(conn, seq, flags, len(follow) if follow is not None else 0)
    if follow is not None:
        answer += struct.pack("<I", zlib.crc32(follow))
    return answer, follow


def split(msg):
    view = memoryview(msg).cast("B")
    return view[:REQ.size], view[REQ.size:]


def server_sync(eps, tally, seed, max_size, pool):
    rng = random.Random(seed)
    seqs = {conn: 0 for conn, _ in eps}
    live = dict(eps)
    while live:
        for conn in list(live):
            ep = live[conn]
            try:
                msg = ep.recv(timeout=120)
            except fabric.ConnectionClosed:
                del live[conn]
                continue
            head, payload = split(msg)
            answer, follow = serve_request(ep, conn, seqs[conn], head, payload, tally, rng, pool, max_size)
            del msg, head, payload          # (a message held while we wait on others is memory we hold)
            seqs[conn] += 1
            ep.send(answer if follow is None else [answer, follow])


def server_async(eps, tally, seed, max_size, pool):
    async def one(conn, ep):
        rng = random.Random(seed * 1000 + conn)
        seq = 0
        while True:
            try:
                msg = await ep.arecv(timeout=120)
            except fabric.ConnectionClosed:
                return
            head, payload = split(msg)
            answer, follow = serve_request(ep, conn, seq, head, payload, tally, rng, pool, max_size)
            del msg, head, payload
            seq += 1
            await ep.asend(answer if follow is None else [answer, follow])

    async def main():
        await asyncio.gather(*[one(c, ep) for c, ep in eps])
    asyncio.run(main())


def serve(backend, connections, threads, max_size):
    fab = fabric.Fabric(backend, **OPTIONS)
    lst = fab.listen("127.0.0.1:0")
    print(lst.address, flush=True)
    pool = Pool(2)
    groups = [[] for _ in range(threads)]
    for _ in range(connections):
        ep = lst.accept(timeout=120)
        conn = struct.unpack("<I", bytes(ep.recv(timeout=60)))[0]
        groups[conn % threads].append((conn, ep))
    lst.close()
    for g in groups:
        g.sort()
    tally = Tally()
    workers = []
    for i, g in enumerate(groups):
        target = server_sync if i % 2 == 0 else server_async
        workers.append(threading.Thread(target=guarded(target, tally, f"server {target.__name__} {i}"),
                                        args=(g, tally, 100 + i, max_size, pool)))
    for w in workers:
        w.start()
    dog_stop = threading.Event()
    dog = threading.Thread(target=watchdog, args=(fab, tally, dog_stop, "server"), daemon=True)
    dog.start()
    buffered_max = 0
    while any(w.is_alive() for w in workers):
        buffered = 0
        for g in groups:
            for _, ep in g:
                try:
                    buffered += ep.stats()["buffered_bytes"]
                except fabric.FabricError:
                    pass
        buffered_max = max(buffered_max, buffered)
        time.sleep(0.05)
    for w in workers:
        w.join()
    dog_stop.set()
    for g in groups:
        for _, ep in g:
            ep.close()
    fab.close()
    print(json.dumps({"messages": tally.messages, "bytes": tally.bytes, "violations": tally.violations,
                      "peak_rss": peak_rss_bytes(), "buffered_max": buffered_max,
                      "stalls": tally.stalls}), flush=True)


# ------------------------------------------------------------------ client

def check_answer(msg, conn, seq, tally):
    view = memoryview(msg).cast("B")
    c, s, flags, follow = ANSWER.unpack_from(view)
    if c != conn or s != seq:
        tally.violation(f"client: connection {conn} expected answer {seq}, got {c}/{s}")
    elif not flags & OK:
        tally.violation(f"client: the server found request {seq} of connection {conn} wrong")
    if flags & FOLLOWS:
        crc = struct.unpack_from("<I", view, ANSWER.size)[0]
        body = view[ANSWER.size + 4:]
        if len(body) != follow or zlib.crc32(body) != crc:
            tally.violation(f"client: the server's message after answer {seq} of connection {conn} "
                            f"arrived corrupted ({len(body)} of {follow} bytes)")
        tally.add(len(body))


def request(conn, seq, rng, pool, max_size):
    payload = pool.slice(rng, pick_size(rng, max_size))
    return [REQ.pack(conn, seq, len(payload), zlib.crc32(payload)), payload], len(payload)


def client_sync(eps, tally, seed, max_size, pool, stop, gate):
    rng = random.Random(seed)
    seq = 0
    while not stop.is_set():
        for conn, ep in eps:
            parts, n = request(conn, seq, rng, pool, max_size)
            sem = gate(n)
            if sem:
                sem.acquire()
            try:
                ep.send(parts)
                tally.add(n)
                check_answer(ep.recv(timeout=120), conn, seq, tally)
            finally:
                if sem:
                    sem.release()
        seq += 1


def client_async(eps, tally, seed, max_size, pool, stop, gate):
    async def one(conn, ep):
        rng = random.Random(seed * 1000 + conn)
        seq = 0
        while not stop.is_set():
            parts, n = request(conn, seq, rng, pool, max_size)
            sem = gate(n)
            while sem is not None and not sem.acquire(blocking=False):
                await asyncio.sleep(0.001)
            try:
                await ep.asend(parts)
                tally.add(n)
                check_answer(await ep.arecv(timeout=120), conn, seq, tally)
            finally:
                if sem is not None:
                    sem.release()
            seq += 1

    async def main():
        await asyncio.gather(*[one(c, ep) for c, ep in eps])
    asyncio.run(main())


def run(backend="tcp", connections=256, threads=4, duration=60.0, max_size=64 << 20, env=None):
    """One load run; returns the report (see the module doc)."""
    # env: variables to set for this run, None to unset one
    full_env = dict(os.environ, PYTHONPATH=ROOT)
    saved = {k: os.environ.get(k) for k in (env or {})}
    for k, v in (env or {}).items():
        if v is None:
            full_env.pop(k, None)
            os.environ.pop(k, None)
        else:
            full_env[k] = os.environ[k] = v
    server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", "--backend", backend,
                               "--connections", str(connections), "--threads", str(threads),
                               "--max-size", str(max_size)],
                              stdout=subprocess.PIPE, text=True, env=full_env)
    try:
        address = server.stdout.readline().strip()
        if not address:
            raise RuntimeError("the load server did not start")
        pool = Pool(1)
        rss0, fds0, threads0 = rss_bytes(), fd_count(), thread_count()
        fab = fabric.Fabric(backend, **OPTIONS)
        refs0 = domain_refs(fab)
        t_connect = time.monotonic()
        groups = [[] for _ in range(threads)]
        for conn in range(connections):
            ep = fab.connect(address, timeout=120)
            ep.send(struct.pack("<I", conn))
            groups[conn % threads].append((conn, ep))
        connect_s = time.monotonic() - t_connect
        tally = Tally()
        stop = threading.Event()
        gate = BigGate()
        workers = []
        for i, g in enumerate(groups):
            target = client_sync if i % 2 == 0 else client_async
            workers.append(threading.Thread(target=guarded(target, tally, f"client {target.__name__} {i}"),
                                            args=(g, tally, 10 + i, max_size, pool, stop, gate)))
        t0 = time.monotonic()
        for w in workers:
            w.start()
        dog_stop = threading.Event()
        threading.Thread(target=watchdog, args=(fab, tally, dog_stop, "client"), daemon=True).start()
        errors = []
        deadline = t0 + duration
        while time.monotonic() < deadline and all(w.is_alive() for w in workers):
            time.sleep(0.2)
        stop.set()
        for w in workers:
            w.join(300)
            if w.is_alive():
                errors.append("a worker thread did not finish (hang)")
        dog_stop.set()
        elapsed = time.monotonic() - t0
        regions = sum(ep.stats()["registered_regions"] for g in groups for _, ep in g if not ep.closed)
        for g in groups:
            for _, ep in g:
                ep.close()
        refs_after = domain_refs(fab)
        fab.close()
        del groups, workers
        out, _ = server.communicate(timeout=300)
        server_report = json.loads(out.strip().splitlines()[-1])
        report = {
            "backend": backend, "ucx_tls": os.environ.get("UCX_TLS"), "connections": connections,
            "threads": threads, "duration_s": round(elapsed, 2), "connect_s": round(connect_s, 3),
            "max_size": max_size,
            "client_messages": tally.messages, "client_bytes": tally.bytes,
            "server_messages": server_report["messages"], "server_bytes": server_report["bytes"],
            "messages": tally.messages + server_report["messages"],
            "bytes": tally.bytes + server_report["bytes"],
            "violations": tally.violations + server_report["violations"] + errors,
            "stalls": tally.stalls + server_report.get("stalls", []),
            "registered_regions_at_end": regions,
            "domain_refs": [refs0, refs_after],
            "peak_rss_client": peak_rss_bytes(), "peak_rss_server": server_report["peak_rss"],
            "server_engine_buffered_max": server_report["buffered_max"],
            "rss_growth": rss_bytes() - rss0, "fds_growth": fd_count() - fds0,
            "threads_growth": thread_count() - threads0,
        }
        return report
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default=os.environ.get("FABRIC_BACKEND", "tcp"))
    ap.add_argument("--connections", type=int, default=256)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--duration", type=float, default=300)
    ap.add_argument("--max-size", default="64M")
    ap.add_argument("--json")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    max_size = parse_size(args.max_size)
    if args.serve:
        serve(args.backend, args.connections, args.threads, max_size)
        return 0
    report = run(args.backend, args.connections, args.threads, args.duration, max_size)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 1 if report["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
