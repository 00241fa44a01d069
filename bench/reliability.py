"""Reliability figures (bench/RESULTS.md, "Reliability"): how fast a dead
peer is noticed, how long a storm of connects takes, per backend.

    python bench/reliability.py [--variants tcp,ucx-tcp,ucx-sm,verbs] [--rounds 5]
                                [--connects 1000] [--json out.json]

Dead peer: a peer process is killed (SIGKILL) while this process has a
receive waiting, a large send being pulled by the peer, and small sends
queued behind credits the peer no longer returns; the time from kill() to
each operation's ConnectionLost, and how long close() of that endpoint then
takes. Connect storm: `--connects` connections to one listener in another
process that accepts with plain accept(): half from 64 threads with the
blocking API, half at once from one event loop; time and failures.
Nothing here is asserted: the tests check behaviour, this measures it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import fabric  # noqa: E402
from conftest import VARIANTS, small_options  # noqa: E402

PEERS = os.path.join(ROOT, "tests", "peers.py")


def start_peer(role, backend, *args, env=None):
    full = dict(os.environ, PYTHONPATH=ROOT)
    full.update(env or {})
    p = subprocess.Popen([sys.executable, PEERS, role, backend, *map(str, args)],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=full)
    return p, p.stdout.readline().strip()


def dead_peer_round(backend, env):
    """One kill; seconds from kill() to each failure, and close()'s duration."""
    chunk = small_options()["chunk_size"]
    fab = fabric.Fabric(backend, **small_options())
    peer, address = start_peer("big_receiver", backend, 1, env=env)
    ep = fab.connect(address, timeout=30)
    filler = [ep.isend(b"f" * 4000) for _ in range(400)]       # the peer's budget fills
    small = ep.isend(b"s" * 100)
    large = ep.isend(os.urandom(64 * chunk))
    time.sleep(0.3)
    seen = {}
    killed = []

    def watch(name, call):
        try:
            call()
            seen[name] = None
        except fabric.ConnectionLost:
            seen[name] = time.monotonic() - killed[0]

    threads = [threading.Thread(target=watch, args=("recv", lambda: ep.recv(timeout=30))),
               threading.Thread(target=watch, args=("large_send", lambda: large.wait(timeout=30))),
               threading.Thread(target=watch, args=("queued_send", lambda: small.wait(timeout=30)))]
    for t in threads:
        t.start()
    time.sleep(0.1)
    killed.append(time.monotonic())
    peer.kill()
    for t in threads:
        t.join(40)
    t0 = time.monotonic()
    ep.close()
    seen["close"] = time.monotonic() - t0
    peer.wait()
    del filler
    fab.close(linger=0)
    return seen


def connect_storm(backend, env, n):
    fab = fabric.Fabric(backend, **small_options(credits=4, send_buffers=2, coalesce_limit=4096,
                                                 eager_limit=2048))
    peer, address = start_peer("accept_many", backend, n, env=env)
    failures = []

    def one(_):
        try:
            return fab.connect(address, timeout=120)
        except fabric.FabricError as e:
            failures.append(repr(e))

    t0 = time.monotonic()
    with ThreadPoolExecutor(64) as pool:
        eps = list(pool.map(one, range(n // 2)))
    t_sync = time.monotonic() - t0

    async def storm():
        return await asyncio.gather(*[fab.aconnect(address, timeout=120) for _ in range(n - n // 2)],
                                    return_exceptions=True)
    t1 = time.monotonic()
    more = asyncio.run(storm())
    t_async = time.monotonic() - t1
    failures += [repr(e) for e in more if isinstance(e, BaseException)]
    eps = [e for e in eps + list(more) if isinstance(e, fabric.Endpoint)]
    for i, ep in enumerate(eps):
        ep.isend(b"%d" % i)
    ok = sum(1 for i, ep in enumerate(eps) if bytes(ep.recv(timeout=60)) == b"%d" % i)
    for ep in eps:
        ep.close()
    peer.wait(timeout=120)
    fab.close()
    return {"connects": n, "sync_half_s": round(t_sync, 3), "async_half_s": round(t_async, 3),
            "total_s": round(t_sync + t_async, 3), "failures": len(failures), "echoed": ok,
            "first_failures": failures[:3]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="tcp,ucx-tcp,ucx-sm")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--connects", type=int, default=1000)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    report = {"command": " ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])), "variants": {}}
    for variant in args.variants.split(","):
        backend, env = VARIANTS[variant]
        ok, why = fabric.available_backends().get(backend, (False, "unknown"))
        if not ok:
            report["variants"][variant] = {"skipped": why}
            continue
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            rounds = [dead_peer_round(backend, env) for _ in range(args.rounds)]
            dead = {}
            for key in ("recv", "large_send", "queued_send", "close"):
                vals = [r[key] for r in rounds if r.get(key) is not None]
                dead[key] = {"median_ms": round(statistics.median(vals) * 1e3, 2) if vals else None,
                             "max_ms": round(max(vals) * 1e3, 2) if vals else None,
                             "failed_to_fail": sum(1 for r in rounds if r.get(key) is None)}
            storm = connect_storm(backend, env, args.connects)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        report["variants"][variant] = {"dead_peer": dead, "connect_storm": storm}
        print(variant, json.dumps(report["variants"][variant]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
