"""Inside the Soft-RoCE guest: fabric/verbs beside perftest (ib_send_lat,
ib_read_bw, ib_write_bw on rxe0) and fabric/tcp in the same guest.

    python tools/softroce.py --timeout 1500 -- .venv/bin/python bench/softroce_compare.py

Latency: perftest's typical one-way latency doubled into a round trip, fabric's
median round trip. Bandwidth: one-way MB/s (perftest: BW average)."""
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def perftest(tool, size, extra=()):
    base = [tool, "-d", "rxe0", "-x", "1", "-s", str(size), *extra]
    server = subprocess.Popen(base, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(2.0)
    for _ in range(20):
        client = subprocess.run(base + ["192.0.2.1"], capture_output=True, text=True, timeout=300)
        if client.returncode == 0:
            break
        time.sleep(0.5)
    server.wait(timeout=60)
    rows = [l.split() for l in client.stdout.splitlines() if re.match(r"^\s*\d+\s+\d+\s+[\d.]+", l)]
    if not rows:
        raise RuntimeError(f"{tool} printed no result: {client.stdout[-400:]} {client.stderr[-400:]}")
    return [float(x) for x in rows[-1]]


def fabric_runs(backend, lat_sizes, bw_sizes, rounds):
    import fabric
    from fabric.perf import cli, measure
    fab = fabric.Fabric(backend)
    proc, address = cli.spawn_peer(backend, {})
    ep = fab.connect(address, timeout=120)
    lat = {s: statistics.median(measure.run_lat(ep, s, 0.02)["p50_us"] for _ in range(rounds)) for s in lat_sizes}
    bw = {s: statistics.median(measure.run_bw(ep, s, 0.02, 8)["MBps"] for _ in range(rounds)) for s in bw_sizes}
    ep.close()
    proc.kill()
    proc.wait()
    return lat, bw


def main():
    rounds = 3
    lat_sizes = [8, 4096, 65536]
    bw_sizes = [65536, 131072, 262144, 1 << 20, 4 << 20, 16 << 20]
    send_lat = perftest("ib_send_lat", 8, ["-n", "2000"])     # bytes iters t_min t_max t_typical ...
    read_bw = {s: perftest("ib_read_bw", s, ["-n", "200"])[3] for s in (65536, 4 << 20)}
    write_bw = {s: perftest("ib_write_bw", s, ["-n", "200"])[3] for s in (65536, 4 << 20)}
    v_lat, v_bw = fabric_runs("verbs", lat_sizes, bw_sizes, rounds)
    t_lat, t_bw = fabric_runs("tcp", lat_sizes, bw_sizes, rounds)
    rtt_perftest = 2 * send_lat[4]
    print(f"ib_send_lat 8 B: typical one-way {send_lat[4]:.2f} us -> round trip {rtt_perftest:.2f} us")
    print("ib_read_bw MB/s: " + ", ".join(f"{s}: {v:.1f}" for s, v in read_bw.items()))
    print("ib_write_bw MB/s: " + ", ".join(f"{s}: {v:.1f}" for s, v in write_bw.items()))
    print(f"{'size':>10} {'verbs rtt us':>13} {'tcp rtt us':>11}")
    for s in lat_sizes:
        print(f"{s:>10} {v_lat[s]:>13.1f} {t_lat[s]:>11.1f}")
    print(f"{'size':>10} {'verbs MB/s':>11} {'tcp MB/s':>9} {'verbs/tcp':>10} {'verbs/ib_read_bw':>17}")
    for s in bw_sizes:
        ref = read_bw.get(s)
        print(f"{s:>10} {v_bw[s]:>11.1f} {t_bw[s]:>9.1f} {v_bw[s] / t_bw[s]:>10.2f} "
              f"{(v_bw[s] / ref) if ref else float('nan'):>17.2f}")
    print(f"8 B round trip: verbs {v_lat[8]:.1f} us = {v_lat[8] / rtt_perftest:.1f}x ib_send_lat's round trip; "
          f"tcp {t_lat[8]:.1f} us")


if __name__ == "__main__":
    main()
