"""What TLS costs on the tcp fabric, side by side in one run (issue 15).

    python bench/tls_compare.py [--rounds 5] [--json PATH]

Contenders, each against its own server process on loopback (bench/servers.py):
  fabric-tcp      Fabric("tcp"), the defaults
  fabric-tcp-tls  Fabric("tcp", ssl=...): the same with TLS (OpenSSL in user space;
                  this kernel has no kernel TLS)
  socket          a raw Python socket (sendmsg / recv_into, length-prefixed)
  socket-tls      the same socket wrapped by Python's ssl module (sendall: an
                  SSLSocket has no sendmsg)
Measured: the 8 B round trip (median of rounds of 2000) and one-way 16 MiB
throughput (64 messages per round, acknowledged at the end); rounds interleave
the contenders. Certificates are made with the openssl command (a test CA).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import ssl
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from bench.p2p import HDR, FabricClient, SocketClient, start_server  # noqa: E402
from grpc_interop import certificates  # noqa: E402

import fabric  # noqa: E402


class TlsSocketClient(SocketClient):
    def __init__(self, address, ctx):
        super().__init__(address)
        self.sock = ctx.wrap_socket(self.sock, server_hostname=address.rsplit(":", 1)[0])

    def rtt(self, payload, n):
        import time
        hdr = HDR.pack(len(payload), 0)
        sock = self.sock
        t0 = time.perf_counter()
        for _ in range(n):
            sock.sendall(hdr + payload)
            self._recv_exact(HDR.size + len(payload))
        return (time.perf_counter() - t0) / n


class TlsFabricClient(FabricClient):
    def __init__(self, address, ctx):
        self.fab = fabric.Fabric("tcp", ssl=ctx)
        self.ep = self.fab.connect(address, timeout=30)
        self.buf = bytearray(64 << 20)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="fabric-tls-bench-")
    for name, data in certificates().items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
    client_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client_ctx.load_verify_locations(os.path.join(d, "ca"))
    env = {"FABRIC_BENCH_TLS_DIR": d}
    servers, clients = [], {}
    try:
        for kind in ("fabric-tcp", "fabric-tcp-tls", "socket", "socket-tls"):
            proc, address = start_server(kind, env_extra=env)
            servers.append(proc)
            if kind == "fabric-tcp":
                clients[kind] = FabricClient("tcp", address)
            elif kind == "fabric-tcp-tls":
                clients[kind] = TlsFabricClient(address, client_ctx)
            elif kind == "socket":
                clients[kind] = SocketClient(address)
            else:
                clients[kind] = TlsSocketClient(address, client_ctx)
        small, big = b"\x00" * 8, b"\x00" * (16 << 20)
        for c in clients.values():              # warm-up
            c.rtt(small, 200)
            c.stream(big, 4)
        rtt = {k: [] for k in clients}
        bw = {k: [] for k in clients}
        for _ in range(args.rounds):
            for k, c in clients.items():
                rtt[k].append(c.rtt(small, 2000) * 1e6)
                bw[k].append(64 * len(big) / c.stream(big, 64) / 1e6)
        out = {k: {"rtt_8B_us": statistics.median(rtt[k]), "oneway_16MiB_MBps": statistics.median(bw[k])}
               for k in clients}
        t, p, s, st = (out[k] for k in ("fabric-tcp-tls", "fabric-tcp", "socket", "socket-tls"))
        out["ratios"] = {
            "tls_vs_plain_rtt": t["rtt_8B_us"] / p["rtt_8B_us"],
            "tls_vs_plain_bw": t["oneway_16MiB_MBps"] / p["oneway_16MiB_MBps"],
            "tls_vs_python_ssl_rtt": t["rtt_8B_us"] / st["rtt_8B_us"],
            "tls_vs_python_ssl_bw": t["oneway_16MiB_MBps"] / st["oneway_16MiB_MBps"],
            "python_ssl_vs_socket_bw": st["oneway_16MiB_MBps"] / s["oneway_16MiB_MBps"],
        }
        for k, v in out.items():
            print(k, {a: round(b, 2) for a, b in v.items()}, file=sys.stderr)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        json.dump(out, sys.stdout, indent=1)
        print()
    finally:
        for c in clients.values():
            try:
                c.close()
            except Exception:  # noqa: BLE001 - best effort at the end
                pass
        for p in servers:
            p.kill()
            p.wait()


if __name__ == "__main__":
    main()
