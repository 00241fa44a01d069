"""What h2 costs per gRPC unary call, without any transport.

    python bench/h2_cost.py [--calls 3000] [--rounds 5]

Two h2 connections in this process (configured as fabric.grpc configures
them) exchange exactly the frames of a unary call with an 8-byte message:
request HEADERS + DATA(END_STREAM), response HEADERS + DATA + trailers. Times
the four steps (client send, server receive, server send, client receive)
with hpack as it is and with fabric.grpc's remembered HPACK work
(_MemoHpack), interleaved rounds, medians.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import h2.config  # noqa: E402
import h2.connection  # noqa: E402

from fabric.grpc import _http2  # noqa: E402  (also installs its cheap frame reprs)

REQUEST = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/bench.Bench/Echo"),
           (b":authority", b"127.0.0.1:50051"), (b"content-type", b"application/grpc"),
           (b"te", b"trailers"), (b"user-agent", b"fabric-grpc")]
RESPONSE = [(b":status", b"200"), (b"content-type", b"application/grpc")]
TRAILERS = [(b"grpc-status", b"0")]
MESSAGE = b"\0\0\0\0\x08" + b"x" * 8
STEPS = ("client send", "server receive", "server send", "client receive")


def pair(memo: bool):
    def make(client_side):
        conn = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=client_side, header_encoding=None, validate_outbound_headers=False,
            normalize_outbound_headers=False, validate_inbound_headers=False))
        if memo:
            conn.encoder = _http2._MemoHpack(conn.encoder, "encode")
            conn.decoder = _http2._MemoHpack(conn.decoder, "decode")
        return conn
    client, server = make(True), make(False)
    client.initiate_connection()
    server.initiate_connection()
    for _ in range(2):
        server.receive_data(client.data_to_send())
        client.receive_data(server.data_to_send())
    return client, server


def run(client, server, calls: int) -> list[float]:
    spent = [0.0] * 4
    for _ in range(calls):
        t0 = time.perf_counter()
        sid = client.get_next_available_stream_id()
        client.send_headers(sid, REQUEST)
        client.send_data(sid, MESSAGE, end_stream=True)
        request = client.data_to_send()
        t1 = time.perf_counter()
        server.receive_data(request)
        t2 = time.perf_counter()
        server.send_headers(sid, RESPONSE)
        server.send_data(sid, MESSAGE)
        server.send_headers(sid, TRAILERS, end_stream=True)
        response = server.data_to_send()
        t3 = time.perf_counter()
        client.receive_data(response)
        t4 = time.perf_counter()
        for i, (a, b) in enumerate(((t0, t1), (t1, t2), (t2, t3), (t3, t4))):
            spent[i] += b - a
    return [x / calls * 1e6 for x in spent]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    samples = {False: [], True: []}
    for _ in range(args.rounds):
        for memo in (False, True):
            client, server = pair(memo)
            samples[memo].append(run(client, server, args.calls))
    for memo in (False, True):
        steps = [statistics.median(s[i] for s in samples[memo]) for i in range(4)]
        label = "remembered HPACK" if memo else "hpack as is"
        print(f"{label:17} " + "  ".join(f"{name} {v:5.1f} us" for name, v in zip(STEPS, steps))
              + f"  total {sum(steps):6.1f} us per call")


if __name__ == "__main__":
    main()
