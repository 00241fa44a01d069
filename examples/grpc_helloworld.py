"""gRPC "hello world" with fabric.grpc: the code grpcio-tools generates from a
.proto, unchanged, over plain TCP (what stock gRPC peers speak) or over a
fabric (fabric+ucx://, fabric+tcp://, fabric+verbs://).

    python examples/grpc_helloworld.py                 # plain TCP, 127.0.0.1:PORT
    python examples/grpc_helloworld.py --backend ucx   # fabric+ucx://127.0.0.1:PORT

This process serves; a second process is the client. The stubs are generated
here at run time; a project generates them once:
    python -m grpc_tools.protoc -Iexamples/protos --python_out=. --grpc_python_out=. helloworld.proto
"""
from __future__ import annotations

import argparse
import importlib
import multiprocessing
import os
import sys
import tempfile
from concurrent import futures
from types import ModuleType
from typing import Any

import fabric.grpc

PROTOS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "protos")


def load_stubs() -> tuple[ModuleType, ModuleType]:
    """helloworld_pb2 and helloworld_pb2_grpc, generated into a temporary directory."""
    from grpc_tools import protoc
    with tempfile.TemporaryDirectory() as out:
        rc = protoc.main(["protoc", f"-I{PROTOS}", f"--python_out={out}", f"--grpc_python_out={out}",
                          os.path.join(PROTOS, "helloworld.proto")])
        if rc != 0:
            raise RuntimeError(f"protoc failed ({rc})")
        sys.path.insert(0, out)
        try:
            return importlib.import_module("helloworld_pb2"), importlib.import_module("helloworld_pb2_grpc")
        finally:
            sys.path.remove(out)


def client(target: str) -> None:
    """The peer process. Plain TCP targets work with grpc.insecure_channel too."""
    pb2, pb2_grpc = load_stubs()
    with fabric.grpc.insecure_channel(target) as channel:
        stub = pb2_grpc.GreeterStub(channel)
        reply = stub.SayHello(pb2.HelloRequest(name="fabric"), timeout=30)
    print(f"Greeter client received: {reply.message}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description="gRPC hello world over fabric.grpc")
    parser.add_argument("--backend", help="a fabric backend (tcp, ucx, verbs); default: plain TCP")
    args = parser.parse_args()
    pb2, pb2_grpc = load_stubs()

    servicer: Any = pb2_grpc.GreeterServicer       # generated at run time: unknown to type checkers

    class Greeter(servicer):
        def SayHello(self, request, context):
            return pb2.HelloReply(message=f"Hello, {request.name}!")

    scheme = f"fabric+{args.backend}://" if args.backend else ""
    server = fabric.grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb2_grpc.add_GreeterServicer_to_server(Greeter(), server)
    port = server.add_insecure_port(f"{scheme}127.0.0.1:0")     # port 0: a free one, returned
    server.start()
    target = f"{scheme}127.0.0.1:{port}"
    try:
        # "spawn", not fork: a forked child cannot use UCX its parent started
        peer = multiprocessing.get_context("spawn").Process(target=client, args=(target,))
        peer.start()
        peer.join(60)
    finally:
        server.stop(0)
    if peer.exitcode != 0:
        print(f"the client failed (exit code {peer.exitcode})", file=sys.stderr)
        return 1
    print(f"grpc_helloworld: SayHello over {target}{'' if scheme else ' (plain TCP)'}: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
