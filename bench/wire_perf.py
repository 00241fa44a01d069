"""fabric-perf across the two-guest wire, per fabric, with perftest beside it.

    python tools/softroce.py --guests 2 -- sh -c "FABRIC_WIRE_AGENT=\\$FABRIC_PEER_ADDR \\
        .venv/bin/python bench/wire_perf.py; .venv/bin/python tests/wire_agent.py quit" \\
        ::: .venv/bin/python tests/wire_agent.py serve

Runs in the first guest. For each backend the second guest's agent starts
`fabric-perf --server` there and this guest runs `fabric-perf --connect`
(lat and bw at --sizes). Then perftest across the same wire and rxe devices:
ib_read_lat (8 B and 64 KiB) and ib_send_bw (1 MiB), its server started
through the agent, GID index 1 (rxe's ::ffff:IPv4 entry).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def fabric_perf(backend: str, sizes: str, scale: str) -> int:
    from wire_agent import RemoteProcess
    peer = os.environ["FABRIC_PEER_ADDR"]
    server = RemoteProcess([sys.executable, "-m", "fabric.perf", "--server", f"{peer}:0", "--backend", backend],
                           {"FABRIC_PROFILE": "none"})
    try:
        address = server.read_line(120).strip()
        if not address:
            print(f"wire_perf: no {backend} server across the wire", flush=True)
            return 1
        return subprocess.run([sys.executable, "-m", "fabric.perf", "--connect", address, "-b", backend,
                               "-t", "lat,bw", "-s", sizes, "--scale", scale],
                              env=dict(os.environ, FABRIC_PROFILE="none")).returncode
    finally:
        server.kill()
        server.close()


def perftest(tool: list[str]) -> int:
    from wire_agent import RemoteProcess
    server = RemoteProcess(tool)
    try:
        time.sleep(3)          # its listening socket is up
        print("$", " ".join(tool), os.environ["FABRIC_PEER_ADDR"], flush=True)
        return subprocess.run(tool + [os.environ["FABRIC_PEER_ADDR"]], timeout=300).returncode
    finally:
        server.wait(60) if server.poll() is None else None
        server.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="verbs,tcp,ucx")
    ap.add_argument("--sizes", default="8,64K,1M,16M")
    ap.add_argument("--scale", default="0.2")
    args = ap.parse_args(argv)
    rc = 0
    for b in args.backends.split(","):
        print(f"== fabric-perf {b} across the wire", flush=True)
        rc |= fabric_perf(b, args.sizes, args.scale)
    common = ["-d", "rxe0", "-x", "1", "-F"]
    for tool in (["ib_read_lat", *common, "-s", "8", "-n", "200"],
                 ["ib_read_lat", *common, "-s", "65536", "-n", "100"],
                 ["ib_send_bw", *common, "-s", "1048576", "-n", "100"]):
        rc |= perftest(tool)
    return rc


if __name__ == "__main__":
    sys.exit(main())
