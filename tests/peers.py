"""Peer processes for the two-process tests: python peers.py ROLE BACKEND ARGS."""
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fabric  # noqa: E402
import hostile  # noqa: E402 (tests/, this script's directory)

SMALL = dict(eager_limit=4096, chunk_size=16384, chunks_in_flight=3, coalesce_limit=8192,
             credits=8, send_buffers=4, recv_budget=1 << 20, spin_us=20)
SMALL.update(json.loads(os.environ.get("FABRIC_TEST_OPTIONS", "{}")))
FAULT = os.environ.pop("FABRIC_FAULT_INJECT", "")
# where the listening roles listen: loopback, or this host's address on the
# wire when the tests run on another host (tests/wire_agent.py sets it)
HERE_ANY = os.environ.get("FABRIC_TEST_HOST", "127.0.0.1") + ":0"


def say(text):
    print(text, flush=True)


def echo(backend, count):
    """Listen, accept one endpoint, echo `count` messages, then close."""
    fab = fabric.Fabric(backend, **SMALL)
    lst = fab.listen(HERE_ANY)
    say(lst.address)
    ep = lst.accept(timeout=30)
    for _ in range(int(count)):
        ep.send(ep.recv(timeout=30))
    ep.close()


def echo_at(backend, address, count):
    """echo(), listening on a given address (for the namespace test)."""
    fab = fabric.Fabric(backend, **SMALL)
    lst = fab.listen(address)
    say(lst.address)
    ep = lst.accept(timeout=30)
    for _ in range(int(count)):
        ep.send(ep.recv(timeout=30))
    ep.close()


def echo_client(backend, address, sizes):
    """Connect, send each size, check the echo; exit 0 if all match."""
    fab = fabric.Fabric(backend, **SMALL)
    ep = fab.connect(address, timeout=30)
    say("connected " + ep.local_address + " -> " + ep.peer_address)
    for size in map(int, sizes.split(",")):
        data = os.urandom(size)
        req = ep.isend(data)
        if ep.recv(timeout=30) != data:
            raise SystemExit(f"echo of {size} bytes differs")
        req.wait(timeout=30)
    ep.close()
    say("ok")


def digest_server(backend, count):
    """Receive `count` messages and answer with the sha256 of each."""
    fab = fabric.Fabric(backend, **SMALL)
    lst = fab.listen(HERE_ANY)
    say(lst.address)
    ep = lst.accept(timeout=30)
    for _ in range(int(count)):
        ep.send(hashlib.sha256(ep.recv(timeout=30)).digest())
    ep.close()


def big_sender(backend, address, size):
    """Connect and start sending one big message, then wait to be killed."""
    fab = fabric.Fabric(backend, **SMALL)
    ep = fab.connect(address, timeout=30)
    data = bytearray(int(size))
    req = ep.isend(data)
    say("sending")
    time.sleep(60)
    req.wait()


def faulty_sender(backend, address, size):
    """Connect and send one message while FABRIC_FAULT_INJECT forges its
    announcement; report how the send ended, then send a normal message."""
    os.environ.pop("FABRIC_FAULT_INJECT", None)
    fab_ok = fabric.Fabric(backend, **SMALL)
    os.environ["FABRIC_FAULT_INJECT"] = FAULT
    fab = fabric.Fabric(backend, **SMALL)
    ep = fab.connect(address, timeout=60)
    say("connected")
    req = ep.isend(bytearray(int(size)))
    try:
        req.wait(timeout=60)
        say("send ok")
    except fabric.FabricError as e:
        say(f"send failed {type(e).__name__}")
    ep.close(linger=0)
    ok = fab_ok.connect(address, timeout=60)
    ok.send(b"still fine")
    ok.close()


def big_receiver(backend, size):
    """Accept, and start receiving one big message slowly: print, then sleep."""
    fab = fabric.Fabric(backend, **SMALL)
    lst = fab.listen(HERE_ANY)
    say(lst.address)
    ep = lst.accept(timeout=30)
    time.sleep(60)


def count_then_signal(backend, count):
    """Accept two connections; once `count` messages arrived on the first,
    say so on the second (the sender waits on the second meanwhile)."""
    fab = fabric.Fabric(backend, **SMALL)
    lst = fab.listen(HERE_ANY)
    say(lst.address)
    # accept() gives connections in the order their handshakes finish, not
    # the order they were made: each says which it is first
    a = lst.accept(timeout=60)
    b = lst.accept(timeout=60)
    first, second = bytes(a.recv(timeout=60)), bytes(b.recv(timeout=60))
    assert {first, second} == {b"data", b"signal"}, (first, second)
    data, signal = (a, b) if first == b"data" else (b, a)
    for _ in range(int(count)):
        data.recv(timeout=60)
    signal.send(b"got all")
    signal.recv(timeout=60)


def accept_many(backend, count):
    """Accept `count` connections with plain accept(), echo one message on
    each, then report how many were served."""
    fab = fabric.Fabric(backend, **SMALL)
    lst = fab.listen(HERE_ANY)
    say(lst.address)
    eps = [lst.accept(timeout=120) for _ in range(int(count))]
    for ep in eps:
        ep.send(ep.recv(timeout=60))
    for ep in eps:
        ep.close()
    say(f"served {len(eps)}")
    fab.close()


def faulty(backend, address, scenario):
    """A peer that FABRIC_FAULT_INJECT (die@stage or garbage@stage) breaks at
    one protocol stage while it plays `scenario` against the victim at
    address (tests/test_faults.py). It reports each step on stdout."""
    os.environ["FABRIC_FAULT_INJECT"] = FAULT
    fab = fabric.Fabric(backend, **SMALL)
    if scenario != "serve_hello":
        say("starting")
    if scenario == "serve_hello":           # the victim connects to us
        lst = fab.listen(HERE_ANY)
        say(lst.address)
        try:
            lst.accept(timeout=30)
        except fabric.FabricError as e:
            say(f"accept failed {type(e).__name__}")
        time.sleep(30)
        return
    try:
        ep = fab.connect(address, timeout=30)
    except fabric.FabricError as e:
        say(f"connect failed {type(e).__name__}")
        time.sleep(30)
        return
    say("connected")
    try:
        if scenario == "send_large":        # rndv: we announce a large message
            ep.send(bytearray(5 * SMALL["chunk_size"]))
        elif scenario == "send_when_posted":  # put: the victim's receive waits before we send
            for i in range(2):
                ep.recv(timeout=30)             # "go": the victim's POST came before it
                ep.send(bytes([i + 1]) * (5 * SMALL["chunk_size"]))
        elif scenario == "recv_large":      # pull / chunk_done: we pull the victim's message
            ep.recv(timeout=30)
        elif scenario == "send_many":       # batch: small messages coalesce
            reqs = [ep.isend(i.to_bytes(4, "little") * 8) for i in range(2000)]
            for r in reqs:
                r.wait(timeout=30)
        elif scenario == "send_then_close":  # close
            for i in range(10):
                ep.send(i.to_bytes(4, "little") * 8)
            ep.close()
        say("scenario done")
    except fabric.FabricError as e:
        say(f"scenario failed {type(e).__name__}")
    time.sleep(30)


def send_then_vanish(backend, address, count):
    """Sends `count` small messages, closes its Fabric (which lets what is
    queued leave) and exits at once, as a rank finishing its last collective
    does. Every message must still arrive."""
    fab = fabric.Fabric(backend, **SMALL)
    say("starting")
    ep = fab.connect(address, timeout=30)
    for i in range(int(count)):
        ep.send(i.to_bytes(4, "little"))
    fab.close()
    os._exit(0)


# ------------------------------------------------- hostile or dying peers (issue 15)

def half_mac(backend, address, key_hex):
    """Connect with the key, send the preamble and half of a valid MAC, then
    wait to be killed in the middle of the exchange."""
    s = hostile.raw_connect(address, timeout=30)
    ours = hostile.preamble(hostile.CONNECTOR, True, backend)
    s.sendall(ours)
    theirs = hostile.read_exactly(s, 48)
    assert len(theirs) == 48
    s.sendall(hostile.mac(bytes.fromhex(key_hex), hostile.CONNECTOR, ours, theirs)[:16])
    say("half sent")
    time.sleep(60)


def half_mac_listener(backend):
    """A listener that answers a keyed connector's preamble, takes its MAC,
    and is killed before it answers with its own."""
    import socket
    lst = socket.socket()
    lst.bind((HERE_ANY.rsplit(":", 1)[0], 0))
    lst.listen(4)
    say("%s:%d" % lst.getsockname()[:2])
    s, _ = lst.accept()
    assert len(hostile.read_exactly(s, 48)) == 48
    s.sendall(hostile.preamble(hostile.ACCEPTOR, True, backend))
    assert len(hostile.read_exactly(s, 32)) == 32
    say("got its mac")
    time.sleep(60)


def connect_storm(backend, address):
    """Connect and close over and over from asyncio, 16 at a time (the key
    comes from FABRIC_AUTH_KEY), until killed."""
    import asyncio
    fab = fabric.Fabric(backend, **SMALL)

    async def one():
        try:
            ep = await fab.aconnect(address, timeout=30)
            ep.close(linger=0)
        except fabric.FabricError:
            pass

    async def main():
        say("storming")
        while True:
            await asyncio.gather(*[one() for _ in range(16)])
    asyncio.run(main())


def crash_in_send(backend, address):
    """Connect, send b"hello", then send 64 bytes from memory nobody may read:
    the process faults (SIGSEGV) wherever the bytes are first copied. On UCX
    shared memory that is inside a slot of the receiver's queue, which UCX
    reserved before copying. A fabric that refuses the send (tcp: the kernel
    says EFAULT) ends the process too."""
    import mmap
    fab = fabric.Fabric(backend, **SMALL)
    ep = fab.connect(address, timeout=30)
    ep.send(b"hello")
    unreadable = mmap.mmap(-1, 4096, prot=0)
    say("crashing")
    try:
        ep.send(memoryview(unreadable)[:64])
    except fabric.FabricError as e:
        say(f"refused: {e}")
    os._exit(3)


def receive_then_wait(backend, connections, count):
    """Accept `connections` endpoints, receive one message with recv() on each
    of the first `count`, saying each one's sha256; then say 'waiting' and
    wait to be killed with the other messages still unreceived."""
    fab = fabric.Fabric(backend, **SMALL)
    lst = fab.listen(HERE_ANY)
    say(lst.address)
    eps = [lst.accept(timeout=60) for _ in range(int(connections))]
    for ep in eps[:int(count)]:
        say(hashlib.sha256(ep.recv(timeout=60)).hexdigest())
    say("waiting")
    time.sleep(120)


def tls_sender(backend, address, ca_path, size):
    """Connect over TLS and start sending one big message, then wait to be
    killed."""
    import ssl
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(ca_path)
    fab = fabric.Fabric("tcp", ssl=ctx, **SMALL)
    ep = fab.connect(address, timeout=30)
    ep.send(b"first")
    req = ep.isend(bytearray(int(size)))
    say("sending")
    time.sleep(60)
    req.wait()


def wire_server(backend):
    """Echo every message on every connection until the peer closes it,
    from asyncio: the other host's end of the wire suite (many connections
    at once, every protocol's sizes). A connection that fails is reported
    ("connection failed: ...") and the others go on."""
    import asyncio

    async def serve(ep):
        try:
            while True:
                await ep.asend(await ep.arecv(timeout=3600))
        except fabric.ConnectionClosed:
            pass
        except fabric.FabricError as e:
            say(f"connection failed: {type(e).__name__}: {e}")
        finally:
            ep.close(linger=0)

    async def main():
        fab = fabric.Fabric(backend, **SMALL)
        lst = fab.listen(HERE_ANY)
        say(lst.address)
        tasks = set()
        while True:
            task = asyncio.ensure_future(serve(await lst.aaccept(timeout=3600)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    asyncio.run(main())


if __name__ == "__main__":
    role, backend, *args = sys.argv[1:]
    globals()[role](backend, *args)
