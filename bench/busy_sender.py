"""A large message from an asyncio sender whose loop is busy after it sends.

    python bench/busy_sender.py [--backend tcp] [--sizes 1M,16M] [--busy 0,5,20,50]
                                [--receiver recv|into] [--rounds 5] [--json out.json]

The sender's coroutine starts a send (`isend`), then computes for BUSY ms
without awaiting (deserialising, a Dask task, a model step: the loop runs
no callbacks meanwhile), then awaits the send. The receiver, another
process, waits in a blocking `recv()` (it pulls the message: the sender must
serve the pull) or `recv_into()` (it posts its buffer: the sender must go on
writing once the socket has room). Reported: the time from the isend to the
message being complete at the receiver (CLOCK_MONOTONIC, one host), median
over the round's messages, against the same size with BUSY 0, in the same
run. Served by the engine's progress thread, it stays near the transfer time
whatever BUSY is; served only by the loop, it grows with BUSY.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import struct
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import fabric  # noqa: E402
from fabric.info import human_size as human  # noqa: E402
from fabric.perf.cli import parse_sizes  # noqa: E402

MESSAGES = 12     # per size and busy time (--messages)


def receive(backend, receiver, plan, queue, messages):
    global MESSAGES
    MESSAGES = messages
    fab = fabric.Fabric(backend)
    lst = fab.listen("127.0.0.1:0")
    queue.put(lst.address)
    ep = lst.accept(timeout=60)
    for size, _busy in plan:
        buf = bytearray(size)
        for _ in range(MESSAGES):
            if receiver == "into":
                ep.recv_into(buf, timeout=120)
                head = bytes(buf[:8])
            else:
                msg = ep.recv(timeout=120)
                head = bytes(memoryview(msg)[:8])
            done = time.monotonic()
            (started,) = struct.unpack("d", head)
            ep.send(struct.pack("d", done - started))
    ep.recv(timeout=60)
    fab.close()


def spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def send_all(backend, address, plan):
    out = {}
    async with fabric.Fabric(backend) as fab:
        ep = await fab.aconnect(address, timeout=60)
        for size, busy in plan:
            msg = bytearray(size)
            took = []
            for _ in range(MESSAGES):
                struct.pack_into("d", msg, 0, time.monotonic())
                req = ep.isend(msg)
                spin(busy / 1000.0)
                await req
                reply = await ep.arecv(timeout=120)
                took.append(struct.unpack("d", bytes(reply))[0])
            out[(size, busy)] = statistics.median(took[2:])
        await ep.asend(b"bye")
        await ep.aclose()
    return out


def one_round(backend, receiver, plan):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    peer = ctx.Process(target=receive, args=(backend, receiver, plan, queue, MESSAGES))
    peer.start()
    try:
        return asyncio.run(send_all(backend, queue.get(timeout=60), plan))
    finally:
        peer.join(60)


def main(argv=None):
    global MESSAGES
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="tcp")
    ap.add_argument("--sizes", default="1M,16M")
    ap.add_argument("--busy", default="0,5,20,50", help="ms the sender computes after each isend")
    ap.add_argument("--receiver", default="recv", choices=("recv", "into"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--messages", type=int, default=12)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    MESSAGES = args.messages
    sizes = parse_sizes(args.sizes)
    busies = [float(b) for b in args.busy.split(",")]
    if 0.0 not in busies:
        busies.insert(0, 0.0)
    plan = [(s, b) for s in sizes for b in busies]
    runs = [one_round(args.backend, args.receiver, plan) for _ in range(args.rounds)]
    rows = []
    print(f"backend {args.backend}, receiver {args.receiver}, {args.rounds} rounds, "
          f"median of {MESSAGES - 2} messages per round")
    print(f"{'size':>6} {'busy ms':>8} {'delivered ms (min-max over rounds)':>36} {'minus busy-0':>22}")
    for size, busy in plan:
        took = [r[(size, busy)] * 1e3 for r in runs]
        extra = [r[(size, busy)] * 1e3 - r[(size, 0.0)] * 1e3 for r in runs]
        rows.append({"size": size, "busy_ms": busy, "delivered_ms": took, "extra_ms": extra})
        print(f"{human(size):>6} {busy:>8g} {statistics.median(took):>14.2f} ({min(took):.2f}-{max(took):.2f})"
              f"{statistics.median(extra):>14.2f} ({min(extra):.2f}-{max(extra):.2f})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"backend": args.backend, "receiver": args.receiver, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
