"""An external HTTP/2 load generator against gRPC servers on plain TCP:
h2load (Debian's nghttp2-client) sends gRPC's UnaryCall (gRPC headers, a
length-prefixed protobuf SimpleRequest as the body) to fabric.grpc's server
and to grpcio's, one after the other, same load.

    python bench/h2load_grpc.py [--clients 100] [--streams 10] [--requests 50000] [--size 8]
                                [--servers fabric,grpcio,fabric-aio,grpcio-aio] [--json F]

Each server runs in a process of its own (gRPC's test service of
tests/protos/interop.proto, handlers on a ThreadPoolExecutor(8), or async
with -aio) and counts the calls it answered. A run is clean when h2load
reports every request done with a 2xx status and none failed or errored,
and the server answered exactly that many calls (h2load does not read
gRPC trailers: the count is how we know each call reached the handler).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
PATH = "/fabric.interop.TestService/UnaryCall"


def serve(kind):
    """(child) A server of kind on 127.0.0.1; prints its port; on stdin EOF prints the calls answered."""
    import grpc_user
    pb, pb_grpc = grpc_user.generated()
    aio = kind.endswith("-aio")
    stack = kind.split("-")[0]
    counted = [0]
    if aio:
        import asyncio

        class Servicer(pb_grpc.TestServiceServicer):
            async def UnaryCall(self, request, context):
                counted[0] += 1
                return pb.SimpleResponse(payload=pb.Payload(body=bytes(request.response_size)))

        async def main():
            import grpc.aio
            import fabric.grpc.aio
            server = (grpc.aio if stack == "grpcio" else fabric.grpc.aio).server()
            pb_grpc.add_TestServiceServicer_to_server(Servicer(), server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            print(port, flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
            print(counted[0], flush=True)
            await server.stop(0)
        asyncio.run(main())
        return
    import threading
    from concurrent import futures
    lock = threading.Lock()

    class Servicer(pb_grpc.TestServiceServicer):
        def UnaryCall(self, request, context):
            with lock:
                counted[0] += 1
            return pb.SimpleResponse(payload=pb.Payload(body=bytes(request.response_size)))
    import grpc
    import fabric.grpc
    server = (grpc if stack == "grpcio" else fabric.grpc).server(futures.ThreadPoolExecutor(8))
    pb_grpc.add_TestServiceServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    sys.stdin.read()
    print(counted[0], flush=True)
    server.stop(0)


def request_body(size: int) -> bytes:
    import grpc_user
    pb, _ = grpc_user.generated()
    msg = pb.SimpleRequest(response_size=size, payload=pb.Payload(body=bytes(size))).SerializeToString()
    return b"\0" + len(msg).to_bytes(4, "big") + msg


def parse(out: str) -> dict:
    """h2load's summary lines."""
    r = {}
    m = re.search(r"finished in ([\d.]+)(\w+), ([\d.]+) req/s", out)
    if m:
        scale = {"s": 1, "ms": 1e-3, "us": 1e-6}.get(m.group(2), 1)
        r["seconds"] = float(m.group(1)) * scale
        r["req_per_s"] = float(m.group(3))
    m = re.search(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
                  r"(\d+) errored, (\d+) timeout", out)
    if m:
        r.update(dict(zip(("total", "started", "done", "succeeded", "failed", "errored", "timeout"),
                          map(int, m.groups()))))
    m = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", out)
    if m:
        r.update(dict(zip(("2xx", "3xx", "4xx", "5xx"), map(int, m.groups()))))
    m = re.search(r"time for request:\s+([\d.]+)(\w+)\s+([\d.]+)(\w+)\s+([\d.]+)(\w+)", out)
    if m:
        units = {"us": 1, "ms": 1e3, "s": 1e6}
        r["request_us"] = {"min": float(m.group(1)) * units[m.group(2)], "max": float(m.group(3)) * units[m.group(4)],
                           "mean": float(m.group(5)) * units[m.group(6)]}
    return r


def run(kind, clients, streams, requests, size, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT)
    server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", kind], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        port = int(server.stdout.readline())
        with tempfile.NamedTemporaryFile(suffix=".bin", delete=False) as f:
            f.write(request_body(size))
            body = f.name
        cmd = ["h2load", "-n", str(requests), "-c", str(clients), "-m", str(streams), "-d", body,
               "-H", "content-type: application/grpc", "-H", "te: trailers",
               f"http://127.0.0.1:{port}{PATH}"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        os.unlink(body)
        result = parse(p.stdout)
        result["h2load_exit"] = p.returncode
        result["h2load_tail"] = p.stdout[-1500:]
    finally:
        server.stdin.close()
        answered = server.stdout.readline().strip()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
    result["answered"] = int(answered) if answered.isdigit() else None
    result["clean"] = (result.get("done") == requests and result.get("succeeded") == requests
                       and result.get("failed") == 0 and result.get("errored") == 0 and result.get("timeout") == 0
                       and result.get("2xx") == requests and result["answered"] == requests)
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--streams", type=int, default=10)
    ap.add_argument("--requests", type=int, default=50000)
    ap.add_argument("--size", type=int, default=8)
    ap.add_argument("--servers", default="fabric,grpcio,fabric-aio,grpcio-aio")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if shutil.which("h2load") is None:
        sys.exit("h2load is not installed (apt install nghttp2-client)")
    results = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "servers": {}}
    for kind in args.servers.split(","):
        r = run(kind, args.clients, args.streams, args.requests, args.size)
        results["servers"][kind] = r
        print(f"{kind:<11} {r.get('req_per_s', 0):9.0f} req/s  done {r.get('done')} / {args.requests}, "
              f"failed {r.get('failed')}, errored {r.get('errored')}, 2xx {r.get('2xx')}, "
              f"answered {r['answered']}: {'clean' if r['clean'] else 'NOT CLEAN'}; "
              f"mean request {r.get('request_us', {}).get('mean', 0):.0f} us", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        serve(sys.argv[2])
    else:
        main()
