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

TLS (plain TCP only): secure_channel(target, ssl_channel_credentials(...)) and
server.add_secure_port(address, ssl_server_credentials(...)), grpcio's signatures.

Status codes, handlers and errors are grpcio's own (grpc.StatusCode,
grpc.unary_unary_rpc_method_handler, grpc.RpcError).
"""
from fabric.grpc._channel import Channel, RpcError
from fabric.grpc._server import Server
from fabric.grpc._tls import ChannelCredentials, ServerCredentials

__all__ = ["insecure_channel", "secure_channel", "server", "ssl_channel_credentials", "ssl_server_credentials",
           "Channel", "Server", "RpcError", "ChannelCredentials", "ServerCredentials"]


def insecure_channel(target, options=None, compression=None, fabric=None):
    """A grpc.Channel to target (host:port, or fabric[+backend]://host:port)."""
    return Channel(target, options, compression, fabric)


def secure_channel(target, credentials, options=None, compression=None):
    """A grpc.Channel over TLS to target (host:port): credentials from
    ssl_channel_credentials() (this module's or grpc's). Options as grpcio's,
    including grpc.ssl_target_name_override."""
    return Channel(target, options, compression, None, credentials)


def ssl_channel_credentials(root_certificates=None, private_key=None, certificate_chain=None):
    """What a secure channel trusts (PEM roots; None: $GRPC_DEFAULT_SSL_ROOTS_FILE_PATH
    or the system's) and, for mutual TLS, the client's key and certificate chain."""
    return ChannelCredentials(root_certificates, private_key, certificate_chain)


def ssl_server_credentials(private_key_certificate_chain_pairs, root_certificates=None,
                           require_client_auth=False):
    """For Server.add_secure_port: the server's (key, chain) PEM pairs and, to
    verify client certificates, root_certificates (required, not only
    checked when offered, with require_client_auth)."""
    return ServerCredentials(private_key_certificate_chain_pairs, root_certificates, require_client_auth)


def server(thread_pool, handlers=None, interceptors=None, options=None, maximum_concurrent_rpcs=None,
           compression=None, fabric=None):
    """A grpc.Server; add_insecure_port takes host:port and fabric[+backend]://host:port."""
    return Server(thread_pool, handlers, interceptors, options, maximum_concurrent_rpcs, compression, fabric)
