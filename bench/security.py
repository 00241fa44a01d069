"""What authentication costs and what hostile peers achieve (issue 15).

    python bench/security.py [--backends tcp,ucx] [--connects 200] [--rounds 3] [--json PATH]

Per backend, side by side in one run:
  * connect: the median time of Fabric.connect() + Listener.accept() on
    loopback, without a key and with one (the HMAC handshake's cost), over
    --connects sequential connections per round, rounds interleaved;
  * strangers: connections without the key, with another key, with garbage,
    replaying a recorded handshake: how many the listener refused, and
    whether any reached accept();
  * lockout: 200 connections that never speak plus 50 that send garbage, then
    a good client: its connect time (the first wave's listener made it wait
    the whole 10 s handshake timeout);
  * full table: 4x max_pending_handshakes (here 64) silent connections, then
    a good client: its connect time and how many were evicted (a silent
    connection gives way after 0.5 s, so about 0.5 s per table's worth).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fabric  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from hostile import CONNECTOR, mac, preamble, raw_connect as raw, read_exactly as read  # noqa: E402

KEY = b"bench key, 32 bytes long.......!"


def connect_times(name, key, n):
    a = fabric.Fabric(name, auth_key=key or False)
    b = fabric.Fabric(name, auth_key=key or False)
    lst = b.listen()
    times = []
    try:
        for _ in range(n):
            t = time.perf_counter()
            ep = a.connect(lst.address, timeout=10)
            peer = lst.accept(timeout=10)
            times.append(time.perf_counter() - t)
            ep.close(linger=0)
            peer.close(linger=0)
    finally:
        a.close(linger=0)
        b.close(linger=0)
    return statistics.median(times)


def strangers(name):
    b = fabric.Fabric(name, auth_key=KEY)
    lst = b.listen()
    tried = 0
    try:
        for key in (False, b"a different key of 32 bytes....."):
            f = fabric.Fabric(name, auth_key=key)
            for _ in range(10):
                tried += 1
                try:
                    f.connect(lst.address, timeout=10)
                except fabric.AuthenticationError:
                    pass
            f.close(linger=0)
        for _ in range(10):                       # garbage
            tried += 1
            with raw(lst.address) as s:
                s.sendall(os.urandom(64))
                try:
                    s.recv(100)            # the listener closes (often with a reset: our bytes were unread)
                except OSError:
                    pass
        s = raw(lst.address)                      # one good session, recorded
        p_c = preamble(CONNECTOR, True, name)
        s.sendall(p_c)
        p_a = read(s, 48)
        recorded = mac(KEY, CONNECTOR, p_c, p_a)
        s.sendall(recorded)
        read(s, 32)
        s.close()
        for _ in range(10):                       # replays of it
            tried += 1
            with raw(lst.address) as s:
                s.sendall(p_c)
                read(s, 48)
                s.sendall(recorded)
                read(s, 32)
        deadline = time.monotonic() + 10
        while lst.refused < tried and time.monotonic() < deadline:
            time.sleep(0.01)
        got_in = 0
        try:
            while True:
                lst.accept(timeout=0.2)
                got_in += 1
        except fabric.Timeout:
            pass
        return {"tried": tried, "refused": lst.refused, "reached_accept": got_in}
    finally:
        b.close(linger=0)


def lockout(name, idle, garbage, **options):
    b = fabric.Fabric(name, auth_key=KEY, **options)
    good = fabric.Fabric(name, auth_key=KEY)
    lst = b.listen()
    socks = []
    try:
        for _ in range(idle):
            socks.append(raw(lst.address))
        for _ in range(garbage):
            s = raw(lst.address)
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            socks.append(s)
        t = time.perf_counter()
        ep = good.connect(lst.address, timeout=30)
        lst.accept(timeout=30)
        took = time.perf_counter() - t
        ep.close(linger=0)
        return {"idle": idle, "garbage": garbage, "good_client_s": took,
                "refused": lst.refused, "evicted": lst.evicted}
    finally:
        for s in socks:
            s.close()
        b.close(linger=0)
        good.close(linger=0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", default="tcp,ucx")
    ap.add_argument("--connects", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    out = {}
    for name in args.backends.split(","):
        plain, keyed = [], []
        for _ in range(args.rounds):
            plain.append(connect_times(name, None, args.connects))
            keyed.append(connect_times(name, KEY, args.connects))
        row = {"connect_no_key_us": statistics.median(plain) * 1e6,
               "connect_key_us": statistics.median(keyed) * 1e6}
        row["connect_ratio"] = row["connect_key_us"] / row["connect_no_key_us"]
        row["strangers"] = strangers(name)
        row["lockout"] = lockout(name, 200, 50)
        row["full_table"] = lockout(name, 256, 0, max_pending_handshakes=64)
        out[name] = row
        print(f"{name}: connect {row['connect_no_key_us']:.0f} us without a key, "
              f"{row['connect_key_us']:.0f} us with one ({row['connect_ratio']:.2f}x); "
              f"strangers {row['strangers']}; lockout {row['lockout']}; full table {row['full_table']}",
              file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
