"""The four measurements of fabric-perf, each on a connected endpoint whose
peer runs fabric.perf.wire.serve_endpoint. Warm-up rounds are excluded;
iteration counts scale with the message size (`scale` multiplies them)."""
from __future__ import annotations

import statistics
import time

from fabric.perf import wire

clock = time.perf_counter


def iterations(size: int, scale: float = 1.0, budget: int = 64 << 20, lo: int = 5, hi: int = 20000) -> int:
    return max(lo, min(hi, int(budget * scale) // max(size, 64)))


def _percentiles(samples_us: list[float]) -> dict:
    samples_us.sort()
    last = len(samples_us) - 1
    return {"p50_us": statistics.median(samples_us),
            "p99_us": samples_us[min(last, int(len(samples_us) * 0.99))],
            "max_us": samples_us[-1]}


def _payload(size: int) -> bytes:
    return bytes([wire.PAYLOAD_BYTE]) * size


def run_lat(ep, size: int, scale: float = 1.0) -> dict:
    """Ping-pong: send `size` bytes, receive them back; one sample per round trip."""
    wire.set_mode(ep, wire.ECHO)
    payload, buf = _payload(size), bytearray(max(size, 1))
    send, recv_into = ep.send, ep.recv_into
    n = iterations(size, scale)
    for _ in range(max(3, n // 10)):
        send(payload)
        recv_into(buf)
    samples = []
    for _ in range(n):
        t0 = clock()
        send(payload)
        recv_into(buf)
        samples.append((clock() - t0) * 1e6)
    return {"size": size, "iterations": n, **_percentiles(samples)}


def _stream(ep, payload, count: int, window: int) -> float:
    """Seconds to hand `count` messages to the engine (at most `window`
    unfinished) and have the peer confirm it received them all."""
    t0 = clock()
    reqs = []
    for _ in range(count):
        reqs.append(ep.isend(payload))
        if len(reqs) >= window:
            reqs.pop(0).wait()
    for r in reqs:
        r.wait()
    wire.set_mode(ep, wire.SYNC)
    return clock() - t0


def run_bw(ep, size: int, scale: float = 1.0, window: int = 8) -> dict:
    """One-way streaming with `window` messages in flight."""
    wire.set_mode(ep, wire.SINK)
    payload = _payload(size)
    n = max(8, iterations(size, scale * 4))
    _stream(ep, payload, max(2, n // 10), window)
    elapsed = _stream(ep, payload, n, window)
    return {"size": size, "iterations": n, "window": window,
            "MBps": size * n / elapsed / 1e6, "msgs_per_s": n / elapsed}


def _blast(ep, payload, count: int) -> float:
    send = ep.send
    t0 = clock()
    for _ in range(count):
        send(payload)
    wire.set_mode(ep, wire.SYNC)
    return clock() - t0


def run_rate(ep, size: int, scale: float = 1.0) -> dict:
    """Small messages per second, each sent with a blocking send() as an
    application would (the engine coalesces what queues up while the fabric
    is busy, unless its Fabric has coalesce=0)."""
    wire.set_mode(ep, wire.SINK)
    payload = _payload(size)
    n = iterations(size, scale, budget=16 << 20, lo=1000, hi=200000)
    _blast(ep, payload, max(100, n // 10))
    rate = n / _blast(ep, payload, n)
    return {"size": size, "iterations": n, "msgs_per_s": rate, "MBps": rate * size / 1e6}


def run_rpc(ep, request: int, response: int, scale: float = 1.0) -> dict:
    """Request of `request` bytes answered by `response` bytes."""
    wire.set_mode(ep, wire.RPC, response)
    payload, buf = _payload(request), bytearray(max(response, 1))
    send, recv_into = ep.send, ep.recv_into
    n = iterations(request + response, scale)
    for _ in range(max(3, n // 10)):
        send(payload)
        recv_into(buf)
    samples = []
    t_all = clock()
    for _ in range(n):
        t0 = clock()
        send(payload)
        recv_into(buf)
        samples.append((clock() - t0) * 1e6)
    elapsed = clock() - t_all
    return {"request": request, "response": response, "iterations": n,
            "calls_per_s": n / elapsed, **_percentiles(samples)}
