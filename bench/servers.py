"""Server side of every contender in bench/p2p.py, one per process:
    python bench/servers.py KIND   (prints its address, then serves)
KIND: fabric-<backend>, socket, grpc, zmq; fabric-tcp-tls and socket-tls
(certificate and key from $FABRIC_BENCH_TLS_DIR/server_cert, server_key).
Echo for ping-pong, sink with a final 1-byte acknowledgement for streaming."""
import os
import socket
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MAX = 64 << 20
HDR = struct.Struct("<QB")      # raw socket framing: length, mode (0 echo, 1 sink, 2 ack)


def tls_server_context():
    import ssl
    d = os.environ["FABRIC_BENCH_TLS_DIR"]
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(os.path.join(d, "server_cert"), os.path.join(d, "server_key"))
    return ctx


def serve_fabric(backend, tls=False):
    import fabric
    fab = fabric.Fabric(backend, ssl=tls_server_context()) if tls else fabric.Fabric(backend)
    lst = fab.listen("127.0.0.1:0")
    print(lst.address, flush=True)
    buf = bytearray(MAX)
    view = memoryview(buf)
    while True:
        try:
            ep = lst.accept()
        except fabric.FabricError:
            return
        try:
            while True:
                n = ep.recv_into(buf)
                if n >= 1 and buf[0] == 0xAC and n == 1:       # end of a stream: acknowledge
                    ep.send(b"k")
                elif n >= 1 and buf[0] == 0x51:                # sink mode message: no reply
                    continue
                else:
                    ep.send(view[:n])
        except fabric.FabricError:
            ep.close(linger=0)


def recv_exact(sock, view, n):
    got = 0
    while got < n:
        r = sock.recv_into(view[got:n])
        if r == 0:
            raise EOFError
        got += r


def serve_socket(tls=False):
    ctx = tls_server_context() if tls else None
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen()
    print("%s:%d" % lst.getsockname(), flush=True)
    buf = bytearray(MAX + HDR.size)
    view = memoryview(buf)
    while True:
        conn, _ = lst.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if ctx is not None:
            conn = ctx.wrap_socket(conn, server_side=True)
        try:
            while True:
                recv_exact(conn, view, HDR.size)
                n, mode = HDR.unpack_from(buf)
                recv_exact(conn, view, n)
                if mode == 0 and ctx is not None:      # an SSLSocket has no sendmsg
                    conn.sendall(HDR.pack(n, 0) + view[:n])
                elif mode == 0:
                    conn.sendmsg([HDR.pack(n, 0), view[:n]])
                elif mode == 2:
                    conn.sendall(b"k")
        except (EOFError, ConnectionError):
            conn.close()


def serve_grpc():
    from concurrent import futures
    import grpc
    opts = [("grpc.max_receive_message_length", MAX + 1024), ("grpc.max_send_message_length", MAX + 1024)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=opts)

    def echo(request, context):
        return request

    def sink(request_iterator, context):
        n = 0
        for _ in request_iterator:
            n += 1
        return b"k"

    def pingpong(request_iterator, context):
        for request in request_iterator:
            yield request

    def put(request, context):
        return b"k"

    handler = grpc.method_handlers_generic_handler("bench.Bench", {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "Sink": grpc.stream_unary_rpc_method_handler(sink),
        "PingPong": grpc.stream_stream_rpc_method_handler(pingpong),
        "Put": grpc.unary_unary_rpc_method_handler(put),
    })
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"127.0.0.1:{port}", flush=True)
    server.wait_for_termination()


def serve_zmq():
    import zmq
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(f"127.0.0.1:{port}", flush=True)
    while True:
        ident, msg = sock.recv_multipart(copy=False)
        b = msg.buffer
        if len(b) >= 1 and b[0] == 0x51:
            continue
        if len(b) == 1 and b[0] == 0xAC:
            sock.send_multipart([ident, b"k"])
        else:
            sock.send_multipart([ident, msg], copy=False)


if __name__ == "__main__":
    kind = sys.argv[1]
    if kind == "fabric-tcp-tls":
        serve_fabric("tcp", tls=True)
    elif kind.startswith("fabric-"):
        serve_fabric(kind.split("-", 1)[1])
    elif kind == "socket-tls":
        serve_socket(tls=True)
    else:
        {"socket": serve_socket, "grpc": serve_grpc, "zmq": serve_zmq}[kind]()
