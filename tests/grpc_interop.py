"""The interop test service (tests/protos/interop.proto): code generated with
grpcio-tools at test time, and a servicer that behaves like gRPC's interop
server (echoed metadata, requested statuses, sizes and sleeps)."""
from __future__ import annotations

import importlib
import os
import sys
import tempfile
import threading
import time

import grpc

HERE = os.path.dirname(os.path.abspath(__file__))
_lock = threading.Lock()
_modules = None

ECHO_INITIAL = "x-grpc-test-echo-initial"
ECHO_TRAILING = "x-grpc-test-echo-trailing-bin"


def generated():
    """(interop_pb2, interop_pb2_grpc), compiled once per process."""
    global _modules
    with _lock:
        if _modules is None:
            from grpc_tools import protoc
            out = tempfile.mkdtemp(prefix="fabric-interop-")
            rc = protoc.main(["protoc", f"-I{os.path.join(HERE, 'protos')}", f"--python_out={out}",
                              f"--grpc_python_out={out}", os.path.join(HERE, "protos", "interop.proto")])
            if rc != 0:
                raise RuntimeError(f"protoc failed ({rc})")
            sys.path.insert(0, out)
            _modules = (importlib.import_module("interop_pb2"), importlib.import_module("interop_pb2_grpc"))
        return _modules


def servicer_class():
    pb, pb_grpc = generated()

    def echo_metadata(context):
        md = dict(context.invocation_metadata())
        if ECHO_INITIAL in md:
            context.send_initial_metadata(((ECHO_INITIAL, md[ECHO_INITIAL]),))
        if ECHO_TRAILING in md:
            context.set_trailing_metadata(((ECHO_TRAILING, md[ECHO_TRAILING]),))

    def apply_status(status, context):
        if status.code:
            context.abort(_code(status.code), status.message)

    class TestService(pb_grpc.TestServiceServicer):
        def __init__(self):
            self.cancelled = threading.Event()
            self.calls = 0

        def EmptyCall(self, request, context):
            echo_metadata(context)
            return pb.Empty()

        def UnaryCall(self, request, context):
            self.calls += 1
            echo_metadata(context)
            if request.sleep_ms:
                context.add_callback(self.cancelled.set)
                end = time.monotonic() + request.sleep_ms / 1000
                while time.monotonic() < end and context.is_active():
                    time.sleep(0.005)
            apply_status(request.response_status, context)
            return pb.SimpleResponse(payload=pb.Payload(body=bytes(request.response_size)))

        def StreamingOutputCall(self, request, context):
            echo_metadata(context)
            for p in request.response_parameters:
                if p.interval_us:
                    time.sleep(p.interval_us / 1e6)
                yield pb.StreamingOutputCallResponse(payload=pb.Payload(body=bytes(p.size)))
            apply_status(request.response_status, context)

        def StreamingInputCall(self, request_iterator, context):
            echo_metadata(context)
            return pb.StreamingInputCallResponse(
                aggregated_payload_size=sum(len(r.payload.body) for r in request_iterator))

        def FullDuplexCall(self, request_iterator, context):
            echo_metadata(context)
            context.add_callback(self.cancelled.set)
            for request in request_iterator:
                apply_status(request.response_status, context)
                for p in request.response_parameters:
                    yield pb.StreamingOutputCallResponse(payload=pb.Payload(body=bytes(p.size)))

    return TestService


def _code(number: int) -> grpc.StatusCode:
    for c in grpc.StatusCode:
        if c.value[0] == number:
            return c
    return grpc.StatusCode.UNKNOWN


def async_servicer_class():
    """The same service for grpc.aio servers: coroutines and async generators."""
    import asyncio
    pb, pb_grpc = generated()

    async def echo_metadata(context):
        md = dict(context.invocation_metadata())
        if ECHO_INITIAL in md:
            await context.send_initial_metadata(((ECHO_INITIAL, md[ECHO_INITIAL]),))
        if ECHO_TRAILING in md:
            context.set_trailing_metadata(((ECHO_TRAILING, md[ECHO_TRAILING]),))

    async def apply_status(status, context):
        if status.code:
            await context.abort(_code(status.code), status.message)

    class AsyncTestService(pb_grpc.TestServiceServicer):
        def __init__(self):
            self.cancelled = asyncio.Event()

        async def EmptyCall(self, request, context):
            await echo_metadata(context)
            return pb.Empty()

        async def UnaryCall(self, request, context):
            await echo_metadata(context)
            if request.sleep_ms:
                # grpc.aio cancels the handler's task; its done callbacks say so
                context.add_done_callback(lambda ctx: self.cancelled.set())
                await asyncio.sleep(request.sleep_ms / 1000)
            await apply_status(request.response_status, context)
            return pb.SimpleResponse(payload=pb.Payload(body=bytes(request.response_size)))

        async def StreamingOutputCall(self, request, context):
            await echo_metadata(context)
            for p in request.response_parameters:
                if p.interval_us:
                    await asyncio.sleep(p.interval_us / 1e6)
                yield pb.StreamingOutputCallResponse(payload=pb.Payload(body=bytes(p.size)))
            await apply_status(request.response_status, context)

        async def StreamingInputCall(self, request_iterator, context):
            await echo_metadata(context)
            total = 0
            async for r in request_iterator:
                total += len(r.payload.body)
            return pb.StreamingInputCallResponse(aggregated_payload_size=total)

        async def FullDuplexCall(self, request_iterator, context):
            await echo_metadata(context)
            # the call is over for the server (grpc.aio ends a cancelled
            # call's request stream and keeps context.cancelled() False)
            context.add_done_callback(lambda ctx: self.cancelled.set())
            async for request in request_iterator:
                await apply_status(request.response_status, context)
                for p in request.response_parameters:
                    yield pb.StreamingOutputCallResponse(payload=pb.Payload(body=bytes(p.size)))

    return AsyncTestService


_certificates = None


def certificates() -> dict:
    """A test CA and server and client certificates it signed (names localhost,
    foo.test.example, 127.0.0.1), made with the openssl command once per
    process; PEM bytes by name: ca, server_key, server_cert, client_key,
    client_cert, and other_ca (a CA that signed nothing here)."""
    global _certificates
    import subprocess
    with _lock:
        if _certificates is None:
            d = tempfile.mkdtemp(prefix="fabric-tls-")

            def run(*args):
                subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)
            for ca in ("ca", "other_ca"):
                run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.pem",
                    "-days", "2", "-subj", f"/CN=fabric test {ca}")
            with open(os.path.join(d, "names.ext"), "w") as f:
                f.write("subjectAltName=DNS:localhost,DNS:foo.test.example,IP:127.0.0.1\n")
            for who in ("server", "client"):
                run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{who}.key", "-out", f"{who}.csr",
                    "-subj", f"/CN=fabric test {who}")
                run("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                    "-out", f"{who}.pem", "-days", "2", "-extfile", "names.ext")

            def read(name):
                with open(os.path.join(d, name), "rb") as f:
                    return f.read()
            _certificates = {"ca": read("ca.pem"), "other_ca": read("other_ca.pem"),
                             "server_key": read("server.key"), "server_cert": read("server.pem"),
                             "client_key": read("client.key"), "client_cert": read("client.pem")}
        return _certificates


def tls_credentials(server_module, client_module):
    """(server credentials, channel credentials) for mutual TLS, each from the
    given module (grpc or fabric.grpc)."""
    c = certificates()
    server = server_module.ssl_server_credentials([(c["server_key"], c["server_cert"])],
                                                  root_certificates=c["ca"], require_client_auth=True)
    channel = client_module.ssl_channel_credentials(c["ca"], c["client_key"], c["client_cert"])
    return server, channel
