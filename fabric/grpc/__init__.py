"""gRPC over fabric: a channel and a server that grpcio-tools' generated code
uses unchanged, speaking gRPC's HTTP/2 protocol (via h2) over a fabric byte
stream (fabric+tcp://, fabric+ucx://, fabric+verbs://, fabric://) or over plain
TCP (host:port) where the peer is a stock gRPC implementation.

    import fabric.grpc
    channel = fabric.grpc.insecure_channel("fabric+ucx://10.0.0.1:50051")
    stub = helloworld_pb2_grpc.GreeterStub(channel)

    server = fabric.grpc.server(futures.ThreadPoolExecutor(8))
    helloworld_pb2_grpc.add_GreeterServicer_to_server(Greeter(), server)
    server.add_insecure_port("fabric+ucx://0.0.0.0:50051")
    server.add_insecure_port("0.0.0.0:50052")        # stock gRPC clients
    server.start()

Status codes, handlers and errors are grpcio's own (grpc.StatusCode,
grpc.unary_unary_rpc_method_handler, grpc.RpcError).
"""
from fabric.grpc._channel import Channel, RpcError
from fabric.grpc._server import Server

__all__ = ["insecure_channel", "server", "Channel", "Server", "RpcError"]


def insecure_channel(target, options=None, compression=None, fabric=None):
    """A grpc.Channel to target (host:port, or fabric[+backend]://host:port)."""
    return Channel(target, options, compression, fabric)


def server(thread_pool, handlers=None, interceptors=None, options=None, maximum_concurrent_rpcs=None,
           compression=None, fabric=None):
    """A grpc.Server; add_insecure_port takes host:port and fabric[+backend]://host:port."""
    return Server(thread_pool, handlers, interceptors, options, maximum_concurrent_rpcs, compression, fabric)
