"""grpcio's own service packages run unchanged on fabric servers, sync and
aio, over plain TCP (stock and fabric clients) and a fabric stream:
grpcio-health-checking (Check, and Watch, which relies on the context's
termination callbacks to forget a watcher when its client goes away) and
grpcio-reflection (which picks its aio servicer by isinstance(server,
grpc.aio.Server))."""
import asyncio
import time
from concurrent import futures

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("h2")
health = pytest.importorskip("grpc_health.v1.health")
health_pb2 = pytest.importorskip("grpc_health.v1.health_pb2")
health_pb2_grpc = pytest.importorskip("grpc_health.v1.health_pb2_grpc")
reflection = pytest.importorskip("grpc_reflection.v1alpha.reflection")
reflection_pb2 = pytest.importorskip("grpc_reflection.v1alpha.reflection_pb2")
reflection_pb2_grpc = pytest.importorskip("grpc_reflection.v1alpha.reflection_pb2_grpc")

import grpc.aio  # noqa: E402

import fabric.grpc as fgrpc  # noqa: E402
import fabric.grpc.aio as faio  # noqa: E402

pytestmark = pytest.mark.timeout(60)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# (client kind, address kind): a stock client on plain TCP, ours on plain TCP and on fabric+tcp
PATHS = [("grpcio", "plain"), ("fabric", "plain"), ("fabric", "fabric+tcp")]


def _target(server, address_kind):
    if address_kind == "plain":
        return f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    return f"fabric+tcp://127.0.0.1:{server.add_insecure_port('fabric+tcp://127.0.0.1:0')}"


def _wait_until(predicate, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


@pytest.mark.parametrize("client_kind,address_kind", PATHS)
def test_health_check_and_watch(client_kind, address_kind):
    servicer = health.HealthServicer()
    server = fgrpc.server(futures.ThreadPoolExecutor(8))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    target = _target(server, address_kind)
    server.start()
    servicer.set("svc", SERVING)
    channel = (grpc.insecure_channel if client_kind == "grpcio" else fgrpc.insecure_channel)(target)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        assert stub.Check(health_pb2.HealthCheckRequest(service="svc"), timeout=10).status == SERVING
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(health_pb2.HealthCheckRequest(service="nobody"), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        watch = stub.Watch(health_pb2.HealthCheckRequest(service="svc"), timeout=20)
        assert next(watch).status == SERVING
        servicer.set("svc", NOT_SERVING)
        assert next(watch).status == NOT_SERVING
        servicer.set("svc", SERVING)
        assert next(watch).status == SERVING
        watch.cancel()
        # the cancel reaches the handler's add_callback, which forgets the watcher
        assert _wait_until(lambda: not servicer._send_response_callbacks.get("svc"))
    finally:
        channel.close()
        server.stop(None)


@pytest.mark.parametrize("client_kind,address_kind", PATHS)
def test_aio_health_check_and_watch(client_kind, address_kind):
    from grpc_health.v1.health import aio as health_aio

    async def main():
        servicer = health_aio.HealthServicer()
        server = faio.server()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        target = _target(server, address_kind)
        await server.start()
        await servicer.set("svc", SERVING)
        channel = (grpc.aio.insecure_channel if client_kind == "grpcio" else faio.insecure_channel)(target)
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            assert (await stub.Check(health_pb2.HealthCheckRequest(service="svc"), timeout=10)).status == SERVING
            with pytest.raises(grpc.RpcError) as info:
                await stub.Check(health_pb2.HealthCheckRequest(service="nobody"), timeout=10)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            watch = stub.Watch(health_pb2.HealthCheckRequest(service="svc"), timeout=20)
            assert (await watch.read()).status == SERVING
            await servicer.set("svc", NOT_SERVING)
            assert (await watch.read()).status == NOT_SERVING
            watch.cancel()
            for _ in range(500):               # the watcher's condition is dropped when its call ends
                if not servicer._server_watchers.get("svc"):
                    break
                await asyncio.sleep(0.01)
            assert not servicer._server_watchers.get("svc")
        finally:
            await channel.close()
            await server.stop(None)
    asyncio.run(main())


def _list_services(stub_calls):
    responses = list(stub_calls)
    return sorted(s.name for s in responses[0].list_services_response.service)


@pytest.mark.parametrize("client_kind,address_kind", PATHS)
def test_reflection(client_kind, address_kind):
    server = fgrpc.server(futures.ThreadPoolExecutor(4))
    names = (health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    reflection.enable_server_reflection(names, server)
    target = _target(server, address_kind)
    server.start()
    channel = (grpc.insecure_channel if client_kind == "grpcio" else fgrpc.insecure_channel)(target)
    try:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(file_containing_symbol="grpc.health.v1.Health")]
        responses = list(stub.ServerReflectionInfo(iter(requests), timeout=10))
        assert sorted(s.name for s in responses[0].list_services_response.service) == sorted(names)
        assert responses[1].file_descriptor_response.file_descriptor_proto
    finally:
        channel.close()
        server.stop(None)


@pytest.mark.parametrize("client_kind,address_kind", PATHS)
def test_aio_reflection(client_kind, address_kind):
    async def main():
        server = faio.server()
        assert isinstance(server, grpc.aio.Server)         # reflection picks its aio servicer by this
        names = (health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        target = _target(server, address_kind)
        await server.start()
        channel = (grpc.aio.insecure_channel if client_kind == "grpcio" else faio.insecure_channel)(target)
        try:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            call = stub.ServerReflectionInfo(timeout=10)
            await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            listed = await call.read()
            await call.write(reflection_pb2.ServerReflectionRequest(file_containing_symbol="grpc.health.v1.Health"))
            found = await call.read()
            await call.done_writing()
            assert sorted(s.name for s in listed.list_services_response.service) == sorted(names)
            assert found.file_descriptor_response.file_descriptor_proto, found
            assert await call.code() == grpc.StatusCode.OK
        finally:
            await channel.close()
            await server.stop(None)
    asyncio.run(main())
