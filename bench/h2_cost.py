"""What an HTTP/2 core costs per gRPC unary call, without any transport:
the measurement behind fabric.grpc's choice of HTTP/2 core.

    python bench/h2_cost.py [--calls 5000] [--rounds 5] [--size 8]

Two connections in this process exchange exactly the frames of a unary call
with a --size byte message: request HEADERS + DATA(END_STREAM), response
HEADERS + DATA + trailers, as gRPC sends them. Cores compared, each as its
Python API hands things to the caller:
  fabric   fabric.grpc's core (fabric/grpc/_hpack.pyx, _h2.pyx): whole messages
           (the gRPC prefix cut in C), headers as tuples
  ngh2     libnghttp2 1.70 through the ngh2 package (pip install ngh2; it is
           not a dependency of fabric: skipped when absent); gRPC framing of
           its DATA bytes in Python, as a driver over it would do
  h2       the h2 package (pure Python), the core fabric.grpc used before
Times the four steps (client send, server receive, server send, client
receive); interleaved rounds, medians, microseconds per call.
"""
from __future__ import annotations

import argparse
import os
import statistics
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REQUEST = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/grpc.testing.TestService/UnaryCall"),
           (b":authority", b"127.0.0.1:50051"), (b"te", b"trailers"), (b"content-type", b"application/grpc"),
           (b"user-agent", b"fabric-grpc/0.2"), (b"grpc-accept-encoding", b"identity,deflate,gzip")]
RESPONSE = [(b":status", b"200"), (b"content-type", b"application/grpc"),
            (b"grpc-accept-encoding", b"identity,deflate,gzip")]
TRAILERS = [(b"grpc-status", b"0")]
STEPS = ("client send", "server receive", "server send", "client receive")


def unframe(data: bytes) -> bytes:
    """One gRPC message out of DATA bytes (what a driver over a plain
    HTTP/2 library does)."""
    flag, length = struct.unpack_from(">BI", data)
    return data[5:5 + length]


class FabricCore:
    name = "fabric"

    def __init__(self, size):
        from fabric.grpc import _h2
        self.body = b"x" * size
        self.client = _h2.Connection(True, initial_window=64 << 20, connection_window=256 << 20)
        self.server = _h2.Connection(False, initial_window=64 << 20, connection_window=256 << 20)
        self.client.initiate()
        self.server.initiate()
        for _ in range(2):
            self._move(self.client, self.server)
            self._move(self.server, self.client)

    @staticmethod
    def _move(a, b):
        out = a.take_output()
        touched = []
        for seg in out or ():
            touched += b.receive(seg)
        return touched

    def call(self, spent):
        t0 = time.perf_counter()
        s = self.client.open_stream(REQUEST)
        self.client.send_message(s, self.body, end_stream=True)
        out = self.client.take_output()
        t1 = time.perf_counter()
        ss = self.server.receive(out[0])[0]
        self.server.accepted(ss)
        msg = ss.messages.popleft()
        self.server.consume(ss, len(msg))
        t2 = time.perf_counter()
        self.server.send_headers(ss, RESPONSE)
        self.server.send_message(ss, msg)
        self.server.send_headers(ss, TRAILERS, True)
        out = self.server.take_output()
        t3 = time.perf_counter()
        self.client.receive(out[0])
        reply = s.messages.popleft()
        self.client.consume(s, len(reply))
        assert s.ended and s.trailers is not None and reply == self.body
        t4 = time.perf_counter()
        for i, (a, b) in enumerate(((t0, t1), (t1, t2), (t2, t3), (t3, t4))):
            spent[i] += b - a


class Ngh2Core:
    name = "ngh2"

    def __init__(self, size):
        import ngh2
        self.ngh2 = ngh2
        self.message = struct.pack(">BI", 0, size) + b"x" * size
        self.client = ngh2.Connection(ngh2.Role.CLIENT)
        self.server = ngh2.Connection(ngh2.Role.SERVER)
        self.client.initiate_connection()
        self.server.initiate_connection()
        for _ in range(2):
            self.server.receive_data(self.client.data_to_send())
            self.client.receive_data(self.server.data_to_send())
        self.client.events()
        self.server.events()

    def call(self, spent):
        ev = self.ngh2
        t0 = time.perf_counter()
        sid = self.client.send_request(REQUEST)
        self.client.send_data(sid, self.message, end_stream=True)
        out = self.client.data_to_send()
        t1 = time.perf_counter()
        self.server.receive_data(out)
        msg = None
        for e in self.server.events():
            if isinstance(e, ev.DataReceived):
                msg = unframe(e.data)
        t2 = time.perf_counter()
        self.server.send_response(sid, RESPONSE)
        self.server.send_data(sid, struct.pack(">BI", 0, len(msg)) + msg)
        self.server.send_trailers(sid, TRAILERS)
        out = self.server.data_to_send()
        t3 = time.perf_counter()
        self.client.receive_data(out)
        reply = None
        for e in self.client.events():
            if isinstance(e, ev.DataReceived):
                reply = unframe(e.data)
        assert reply == self.message[5:]
        t4 = time.perf_counter()
        for i, (a, b) in enumerate(((t0, t1), (t1, t2), (t2, t3), (t3, t4))):
            spent[i] += b - a


class H2Core:
    name = "h2"

    def __init__(self, size):
        import h2.config
        import h2.connection
        import h2.events
        self.events = h2.events
        self.message = struct.pack(">BI", 0, size) + b"x" * size

        def make(client_side):
            return h2.connection.H2Connection(h2.config.H2Configuration(
                client_side=client_side, header_encoding=None, validate_outbound_headers=False,
                normalize_outbound_headers=False, validate_inbound_headers=False))
        self.client, self.server = make(True), make(False)
        self.client.initiate_connection()
        self.server.initiate_connection()
        for _ in range(2):
            self.server.receive_data(self.client.data_to_send())
            self.client.receive_data(self.server.data_to_send())

    def call(self, spent):
        t0 = time.perf_counter()
        sid = self.client.get_next_available_stream_id()
        self.client.send_headers(sid, REQUEST)
        self.client.send_data(sid, self.message, end_stream=True)
        out = self.client.data_to_send()
        t1 = time.perf_counter()
        msg = None
        for e in self.server.receive_data(out):
            if isinstance(e, self.events.DataReceived):
                msg = unframe(e.data)
                self.server.acknowledge_received_data(e.flow_controlled_length, sid)
        t2 = time.perf_counter()
        self.server.send_headers(sid, RESPONSE)
        self.server.send_data(sid, struct.pack(">BI", 0, len(msg)) + msg)
        self.server.send_headers(sid, TRAILERS, end_stream=True)
        out = self.server.data_to_send()
        t3 = time.perf_counter()
        reply = None
        for e in self.client.receive_data(out):
            if isinstance(e, self.events.DataReceived):
                reply = unframe(e.data)
                self.client.acknowledge_received_data(e.flow_controlled_length, sid)
        assert reply == self.message[5:]
        t4 = time.perf_counter()
        for i, (a, b) in enumerate(((t0, t1), (t1, t2), (t2, t3), (t3, t4))):
            spent[i] += b - a


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--size", type=int, default=8)
    args = ap.parse_args(argv)
    cores = []
    for cls in (FabricCore, Ngh2Core, H2Core):
        try:
            cores.append(cls(args.size))
        except ImportError as e:
            print(f"{cls.name}: skipped ({e})")
    samples = {c.name: [] for c in cores}
    steps = {c.name: [[] for _ in STEPS] for c in cores}
    for c in cores:                          # warm-up
        c.call([0.0] * 4)
    for _ in range(args.rounds):
        for c in cores:
            spent = [0.0] * 4
            for _ in range(args.calls if c.name != "h2" else max(1, args.calls // 10)):
                c.call(spent)
            n = args.calls if c.name != "h2" else max(1, args.calls // 10)
            samples[c.name].append(sum(spent) / n * 1e6)
            for i in range(4):
                steps[c.name][i].append(spent[i] / n * 1e6)
    for c in cores:
        v = samples[c.name]
        print(f"{c.name:<7} {statistics.median(v):7.2f} us per unary call [{min(v):.2f}-{max(v):.2f}]  " +
              "  ".join(f"{s} {statistics.median(x):.2f}" for s, x in zip(STEPS, steps[c.name])))


if __name__ == "__main__":
    main()
