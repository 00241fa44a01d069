"""fabric-perf --tune: measure this host and backend, write a tuning profile.

Three questions, each answered by candidates measured side by side in the
same run (every candidate has its own Fabric and loopback peer; rounds are
interleaved; medians decide):
  1. eager_limit: the largest size up to which eager is at least as fast as
     rendezvous, in round trip and in streaming, at that size and every
     smaller one (sizes 4 KiB .. 1 MiB).
  2. chunk_size x chunks_in_flight: streaming bandwidth and round trip of
     1 to 64 MiB messages (geometric mean; no figure may get worse).
  3. coalesce_limit: rate of 64 B, 1 KiB and 4 KiB messages from blocking sends.
A tuned value replaces the default only if, in the same run, its median
beats the default's by more than MARGIN and it wins most rounds (loopback
figures on a shared host swing by 10-20% between rounds); otherwise the
default stays. The profile
records what was measured. The engine reads it at start-up (fabric.options).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys

from fabric.perf import measure
from fabric.perf.common import EAGER_MAX, machine_info, pin_self, spawn_peer, versions

MARGIN = 0.05
ROUNDS = 5
CROSSOVER_SIZES = [4096 << k for k in range(9)]           # 4K .. 1M
CHUNK_SIZES = [1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20]
CHUNKS_IN_FLIGHT = [1, 2, 4]
STREAM_SIZES = [1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20, 32 << 20, 64 << 20]   # every size chunking touches
COALESCE_LIMITS = [16384 + 1024, 65536 + 4096, (256 << 10) + 4096]
RATE_SIZES = [64, 1024, 4096]


class Candidate:
    def __init__(self, backend: str, knobs: dict):
        import fabric
        self.knobs = knobs
        self.fab = fabric.Fabric(backend, **knobs)
        self.proc, address = spawn_peer(backend, knobs, pin=True)
        self.ep = self.fab.connect(address, timeout=30)

    def close(self):
        try:
            self.ep.close(linger=1)
        finally:
            self.proc.kill()
            self.proc.wait()


def interleaved(backend: str, configs: dict, probe, rounds: int = ROUNDS, say=print, raw=None) -> dict:
    """{name: median of probe(endpoint)} over `rounds` interleaved rounds
    (this process on one CPU, every peer on another);
    probe returns a dict of figures, the median is taken per figure. If raw
    is a dict it receives every round's figures per name."""
    cands = {}
    pin_self()
    try:
        for name, knobs in configs.items():
            cands[name] = Candidate(backend, knobs)
        samples = {name: [] for name in configs}
        for r in range(rounds):
            for name, c in cands.items():
                say(f"  round {r + 1}/{rounds}: {name}")
                samples[name].append(probe(c.ep))
        if raw is not None:
            raw.update(samples)
        return {name: {k: statistics.median(s[k] for s in rows) for k in rows[0]}
                for name, rows in samples.items()}
    finally:
        for c in cands.values():
            c.close()


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def tune_eager_limit(backend, base, scale, say) -> tuple[int, dict]:
    def probe(ep):
        out = {}
        for s in CROSSOVER_SIZES:
            out[f"lat{s}"] = measure.run_lat(ep, s, scale * 0.25)["p50_us"]
            out[f"bw{s}"] = measure.run_bw(ep, s, scale * 0.25)["MBps"]
        return out
    res = interleaved(backend, {"eager": dict(base, eager_limit=EAGER_MAX), "rendezvous": dict(base, eager_limit=0)},
                      probe, say=say)
    limit = 0
    for s in CROSSOVER_SIZES:
        e, r = res["eager"], res["rendezvous"]
        if e[f"lat{s}"] <= r[f"lat{s}"] and e[f"bw{s}"] >= r[f"bw{s}"] * (1 - MARGIN):
            limit = s
        else:
            break
    return limit, res


def decide(raw: dict, default_name: str, score, higher_is_better: bool = True) -> tuple[str, dict]:
    """The candidate whose median score beats the default's by > MARGIN,
    which beats the default in more than half of the rounds, and which is not
    worse than the default by more than MARGIN in any single figure (so a
    better average cannot hide a size that got slower); else the default."""
    sign = 1 if higher_is_better else -1
    per_round = {name: [score(r) for r in rows] for name, rows in raw.items()}
    median = {name: statistics.median(v) for name, v in per_round.items()}
    base = per_round[default_name]
    figures = {name: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for name, rows in raw.items()}
    best, best_score = default_name, median[default_name]
    for name, v in per_round.items():
        wins = sum(1 for a, b in zip(v, base) if sign * (a - b) > 0)
        gain = (median[name] / median[default_name]) ** sign
        no_loss = all((figures[name][k] / figures[default_name][k]) ** sign >= 1 - MARGIN
                      for k in figures[name] if figures[default_name][k])
        if gain > 1 + MARGIN and wins * 2 > len(v) and no_loss and sign * (median[name] - best_score) > 0:
            best, best_score = name, median[name]
    return best, median


def tune_chunks(backend, base, scale, say) -> tuple[tuple[int, int], dict]:
    configs = {f"{c >> 10}K x {f}": dict(base, chunk_size=c, chunks_in_flight=f)
               for c in CHUNK_SIZES for f in CHUNKS_IN_FLIGHT}
    default_name = f"{base['chunk_size'] >> 10}K x {base['chunks_in_flight']}"
    configs.setdefault(default_name, dict(base))

    def probe(ep):
        figures = {f"bw{s}": measure.run_bw(ep, s, scale * 0.25, window=4)["MBps"] for s in STREAM_SIZES}
        # round trips too (as rates, higher is better): a chunking that streams
        # faster must not make a single large message slower
        figures.update({f"rtt_rate{s}": 1e6 / measure.run_lat(ep, s, scale * 0.25)["p50_us"] for s in STREAM_SIZES})
        return figures
    raw = {}
    res = interleaved(backend, configs, probe, say=say, raw=raw)
    best, scores = decide(raw, default_name, lambda r: geomean(r.values()))
    knobs = configs[best]
    return (knobs["chunk_size"], knobs["chunks_in_flight"]), {"figures": res, "score": scores,
                                                                  "default": default_name, "chosen": best}


def tune_coalesce_limit(backend, base, scale, say) -> tuple[int, dict]:
    limits = sorted(set(COALESCE_LIMITS) | {base["coalesce_limit"]})
    configs = {str(c): dict(base, coalesce_limit=c) for c in limits}

    def probe(ep):
        return {f"rate{s}": measure.run_rate(ep, s, scale * 0.5)["msgs_per_s"] for s in RATE_SIZES}
    raw = {}
    res = interleaved(backend, configs, probe, say=say, raw=raw)
    default_name = str(base["coalesce_limit"])
    best, scores = decide(raw, default_name, lambda r: geomean(r.values()))
    return int(best), {"figures": res, "score": scores, "default": default_name, "chosen": best}


def main(backend, knobs: dict, profile=None, dry_run=False, scale=1.0, json_path=None) -> int:
    import fabric
    from fabric import options as fopts
    target = profile or fopts.profile_path()
    if target is None and not dry_run:
        raise SystemExit("fabric-perf --tune: FABRIC_PROFILE=none; name a file with --profile or use --dry-run")
    # Tune from the built-in defaults, never from an earlier profile; the
    # peers inherit this.
    os.environ["FABRIC_PROFILE"] = "none"
    say = (lambda m: print(m, file=sys.stderr, flush=True))
    probe_fab = fabric.Fabric(backend, **knobs)
    backend = probe_fab.name
    base = dict(probe_fab.options)
    for k in ("progress_thread", "handshake_timeout", "close_linger"):
        base.pop(k, None)
    defaults = {k: base[k] for k in ("eager_limit", "chunk_size", "chunks_in_flight", "coalesce_limit")}
    print(f"fabric-perf --tune: backend {backend}; defaults {defaults}", flush=True)

    say("1/3 eager/rendezvous crossover")
    crossover, cross_res = tune_eager_limit(backend, base, scale, say)
    eager_limit = defaults["eager_limit"]
    if crossover != defaults["eager_limit"]:
        # adopt only what the same run showed to be better at the sizes it changes
        lo, hi = sorted((crossover, defaults["eager_limit"]))
        changed = [s for s in CROSSOVER_SIZES if lo < s <= hi]
        better = "eager" if crossover > defaults["eager_limit"] else "rendezvous"
        other = "rendezvous" if better == "eager" else "eager"
        wins = [cross_res[better][f"lat{s}"] < cross_res[other][f"lat{s}"] * (1 - MARGIN)
                and cross_res[better][f"bw{s}"] >= cross_res[other][f"bw{s}"] * (1 - MARGIN) for s in changed]
        if changed and all(wins):
            eager_limit = crossover
    print(f"  crossover measured at {crossover} B; eager_limit -> {eager_limit}", flush=True)
    base["eager_limit"] = eager_limit

    say("2/3 chunk size and chunks in flight")
    (chunk_size, in_flight), chunk_res = tune_chunks(backend, base, scale, say)
    print(f"  chunk_size -> {chunk_size}, chunks_in_flight -> {in_flight} "
          f"(score {chunk_res['score'][chunk_res['chosen']]:.0f} vs default {chunk_res['score'][chunk_res['default']]:.0f} MB/s)",
          flush=True)
    base.update(chunk_size=chunk_size, chunks_in_flight=in_flight)

    say("3/3 coalescing limit")
    coalesce_limit, coal_res = tune_coalesce_limit(backend, base, scale, say)
    print(f"  coalesce_limit -> {coalesce_limit} (score {coal_res['score'][coal_res['chosen']]:.0f} vs default "
          f"{coal_res['score'][coal_res['default']]:.0f} msg/s)", flush=True)

    tuned = {"eager_limit": eager_limit, "chunk_size": chunk_size, "chunks_in_flight": in_flight,
             "coalesce_limit": coalesce_limit}
    evidence = {"machine": machine_info(), "versions": versions(), "defaults": defaults,
                "crossover": {"measured_eager_limit": crossover, "figures": cross_res},
                "chunks": chunk_res, "coalescing": coal_res}
    print(f"fabric-perf --tune: {backend} {tuned}", flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"tool": "fabric-perf --tune", "backend": backend, "tuned": tuned, **evidence}, f, indent=2)
    if dry_run:
        print("fabric-perf --tune: --dry-run, no profile written")
        return 0
    import datetime
    path = fopts.write_profile(backend, tuned, path=target,
                               extra={"measured": datetime.datetime.now(datetime.timezone.utc)
                                      .isoformat(timespec="seconds"),
                                      "host": machine_info()["host"], "defaults": defaults})
    print(f"fabric-perf --tune: wrote {path} (read by every Fabric on backend {backend}; "
          f"FABRIC_PROFILE=none ignores it, FABRIC_PROFILE=FILE picks another)")
    return 0
