"""asyncio variants: they work inside a running loop without blocking it."""
import asyncio

import numpy as np
import pytest

import fabric
from conftest import connect_pair, small_options

EAGER = small_options()["eager_limit"]
CHUNK = small_options()["chunk_size"]


async def apair(backend_name):
    fab = fabric.Fabric(backend_name, **small_options())
    other = fabric.Fabric(backend_name, **small_options())
    lst = other.listen("127.0.0.1:0")
    server_task = asyncio.ensure_future(lst.aaccept(timeout=10))
    client = await fab.aconnect(lst.address, timeout=10)
    server = await server_task
    lst.close()
    return client, server


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def connect_pairs(fab, lst, n, pairs):
    """n connections from fab to lst, each appended to pairs as (client,
    server) once open (the caller closes what is there, however far it got)."""
    for _ in range(n):
        accepting = asyncio.ensure_future(lst.aaccept(timeout=10))
        client = await fab.aconnect(lst.address, timeout=10)
        pairs.append((client, await accepting))


@pytest.mark.timeout(90)
def test_async_round_trips_all_protocols(backend_name):
    async def main():
        client, server = await apair(backend_name)
        for size in [0, 5, EAGER, EAGER + 1, 3 * CHUNK + 1, 1 << 20]:
            data = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8).tobytes()
            send = asyncio.ensure_future(client.asend(data))
            assert await server.arecv(timeout=10) == data
            await send
            buf = bytearray(size)
            send = asyncio.ensure_future(server.asend(data))
            assert await client.arecv_into(buf, timeout=10) == size and bytes(buf) == data
            await send
        await client.aclose()
        await server.aclose()
    run(main())


@pytest.mark.timeout(90)
def test_loop_keeps_running_during_transfers(backend_name):
    async def main():
        client, server = await apair(backend_name)
        ticks = 0
        stop = False

        async def ticker():
            nonlocal ticks
            while not stop:
                ticks += 1
                await asyncio.sleep(0.001)

        t = asyncio.ensure_future(ticker())
        recv = asyncio.ensure_future(server.arecv(timeout=20))
        await asyncio.sleep(0.05)            # nothing sent yet: the loop must keep ticking
        assert ticks > 5 and not recv.done()
        big = bytes(8 << 20)
        await client.asend(big)
        assert len(await recv) == len(big)
        stop = True
        await t
        client.close()
        server.close()
    run(main())


@pytest.mark.timeout(90)
def test_concurrent_receivers_are_served_in_order(backend_name):
    async def main():
        client, server = await apair(backend_name)
        receivers = [asyncio.ensure_future(server.arecv(timeout=10)) for _ in range(20)]
        await asyncio.sleep(0)
        for i in range(20):
            await client.asend(i.to_bytes(2, "little") * (i * 500))
        got = await asyncio.gather(*receivers)
        assert [len(g) for g in got] == [i * 1000 for i in range(20)]
        assert [bytes(g[:2]) for g in got[1:]] == [i.to_bytes(2, "little") for i in range(1, 20)]
        client.close()
        server.close()
    run(main())


@pytest.mark.timeout(90)
def test_timeout_and_cancellation_lose_nothing(backend_name):
    async def main():
        client, server = await apair(backend_name)
        with pytest.raises(fabric.Timeout):
            await server.arecv(timeout=0.05)
        task = asyncio.ensure_future(server.arecv_into(bytearray(4 * CHUNK)))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        data = bytes(range(256)) * (4 * CHUNK // 256)
        req = client.isend(data)
        assert await server.arecv(timeout=10) == data
        await req
        client.close()
        server.close()
    run(main())


@pytest.mark.timeout(90)
def test_async_peer_close_is_reported(backend_name):
    async def main():
        client, server = await apair(backend_name)
        await client.asend(b"bye")
        await client.aclose()
        assert await server.arecv(timeout=10) == b"bye"
        with pytest.raises(fabric.ConnectionClosed):
            await server.arecv(timeout=10)
        server.close()
    run(main())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("connections", [1, 100])
def test_closing_an_endpoint_wakes_every_coroutine_waiting_on_it(backend_name, connections):
    """A close from this side (Dask's comm.abort() while its reader waits)
    ends the receives, the unfinished send and the accept waiting on that
    endpoint or listener at once, with no timeout of their own; the
    connection left open keeps working. (The close unregistered the endpoint
    before the loop looked, and its waiters slept forever.)"""
    async def main():
        fab = fabric.Fabric(backend_name, **small_options())
        other = fabric.Fabric(backend_name, **small_options())
        lst = other.listen("127.0.0.1:0")
        pairs = []
        try:
            await connect_pairs(fab, lst, connections + 1, pairs)
            kept_client, kept_server = pairs.pop()
            waiting = []
            for client, _ in pairs:
                waiting.append(asyncio.ensure_future(client.arecv()))
                waiting.append(asyncio.ensure_future(client.arecv_into(bytearray(1 << 20))))
                waiting.append(asyncio.ensure_future(client.isend(bytes(4 << 20)).await_done()))
            accept = asyncio.ensure_future(lst.aaccept())
            await asyncio.sleep(0.2)
            assert not any(w.done() for w in waiting) and not accept.done()
            for client, _ in pairs:
                client.close(linger=0)
            lst.close()
            done, pending = await asyncio.wait(waiting + [accept], timeout=20)
            assert not pending, f"{len(pending)} of {len(waiting) + 1} waits still asleep after the close"
            for w in done:
                error = w.exception()
                # the send may have finished before the close (the peer pulled ahead)
                assert error is None or isinstance(error, fabric.ConnectionClosed), repr(error)
            assert sum(isinstance(w.exception(), fabric.ConnectionClosed) for w in waiting) >= 2 * connections
            assert isinstance(accept.exception(), fabric.ConnectionClosed)
            await kept_client.asend(b"still here")
            assert await kept_server.arecv(timeout=10) == b"still here"
            kept_client.close()
            kept_server.close()
        finally:
            for client, server in pairs:
                client.close()
                server.close()
            lst.close()
            fab.close()
            other.close()
    run(main())


@pytest.mark.timeout(120)
def test_sends_above_the_peers_max_message_fail_alone_on_100_connections(backend_name):
    async def main():
        fab = fabric.Fabric(backend_name, **small_options())
        strict = fabric.Fabric(backend_name, **small_options(max_message=1000))
        lst = strict.listen("127.0.0.1:0")
        pairs = []
        try:
            await connect_pairs(fab, lst, 100, pairs)

            async def one(i, client, server):
                with pytest.raises(fabric.MessageTooLarge):
                    await client.asend(bytes(2000 if i % 2 else 100_000))   # eager / rendezvous
                data = i.to_bytes(4, "little") * 250                         # 1000 B: the limit itself
                await client.asend(data)
                assert await server.arecv(timeout=30) == data

            await asyncio.gather(*(one(i, c, s) for i, (c, s) in enumerate(pairs)))
        finally:
            for client, server in pairs:
                client.close()
                server.close()
            fab.close()
            strict.close()
    run(main())


@pytest.mark.timeout(90)
@pytest.mark.parametrize("progress_by", ["request_done", "fabric_progress"])
def test_progress_made_by_another_coroutine_wakes_the_receiver(progress_by):
    """A call on the loop's thread outside the loop's own polling (a send's
    Request.done(), Fabric.progress()) may take the message another coroutine
    awaits: that receiver must still be woken. (It waited for the progress
    thread's one-second fallback: fabric.grpc.aio over fabric+tcp took 1-3 s
    per call, forever with the thread off, as here.)"""
    import select

    async def main():
        fab = fabric.Fabric("tcp", **small_options(progress_thread=0))
        other = fabric.Fabric("tcp", **small_options(progress_thread=0))
        lst = other.listen("127.0.0.1:0")
        server_task = asyncio.ensure_future(lst.aaccept(timeout=10))
        client = await fab.aconnect(lst.address, timeout=10)
        server = await server_task
        lst.close()
        receiver = asyncio.ensure_future(client.arecv())
        for _ in range(3):
            await asyncio.sleep(0)
        assert not receiver.done()            # it waits for the loop to report the endpoint
        server.send(b"ping")
        # the message is in the client's socket (the Fabric's epoll descriptor is readable) ...
        assert select.select([client.worker.fileno()], [], [], 10)[0]
        # ... and this coroutine's call takes it, without yielding to the loop
        if progress_by == "request_done":
            assert client.isend(b"pong").done()
        else:
            fab.progress()
        assert await asyncio.wait_for(receiver, 20) == b"ping"
        if progress_by == "request_done":
            assert await server.arecv(timeout=10) == b"pong"
        client.close()
        server.close()
        fab.close()
        other.close()
    run(main())


@pytest.mark.timeout(90)
def test_a_write_left_for_the_poller_by_a_call_on_the_loop_thread_is_armed():
    """A call on the loop's thread outside the loop's polling (a send's
    Request.done()) that serves the peer's pull and leaves the rest of a
    large write waiting for socket space must arm the loop's descriptor for
    it. (Left unarmed it waited for the progress thread's watch of a silent
    loop: fabric.grpc.aio over fabric+tcp stalled so, one large call in ten;
    forever with the thread off, as here.)"""
    import select
    import threading
    big = np.random.default_rng(5).integers(0, 255, 16 << 20, dtype=np.uint8).tobytes()
    opts = small_options(progress_thread=0, chunk_size=16 << 20, chunks_in_flight=1)

    async def main():
        fab = fabric.Fabric("tcp", **opts)
        other = fabric.Fabric("tcp", **opts)
        lst = other.listen("127.0.0.1:0")
        server_task = asyncio.ensure_future(lst.aaccept(timeout=10))
        client = await fab.aconnect(lst.address, timeout=10)
        server = await server_task
        lst.close()
        watching = asyncio.ensure_future(client.arecv())     # the loop watches the client's Fabric
        for _ in range(3):
            await asyncio.sleep(0)
        req = client.isend(big)
        for _ in range(3):
            await asyncio.sleep(0)           # the loop has seen to what the send itself left
        got = []
        receiver = threading.Thread(target=lambda: got.append(bytes(server.recv(timeout=30))))
        receiver.start()                     # a blocking receiver: it pulls from its own thread
        # the pull asks for the whole message at once; the loop does not run
        # meanwhile, so this coroutine's call is what serves them, and the
        # socket takes only part of what they ask for
        assert select.select([client.worker.fileno()], [], [], 20)[0]
        assert not req.done()
        # from here only the loop's own polling can move the rest
        await asyncio.get_running_loop().run_in_executor(None, receiver.join, 30)
        assert got and got[0] == big
        assert req.done()
        watching.cancel()
        client.close()
        server.close()
        fab.close()
        other.close()
    run(main())


@pytest.mark.timeout(90)
def test_first_wait_of_a_loop_sees_what_arrived_while_it_attached(backend_name, monkeypatch):
    """The first coroutine of a loop to wait on a Fabric attaches the loop;
    the progress thread may deliver the awaited message at that moment. The
    wait compared the endpoint's generation before attaching, and the engine
    queues moves for the loop only once attached: that message was seen only
    at the receive's deadline (CI: 30 s, then a failed test, on verbs)."""
    import time

    from fabric import aio

    fab = fabric.Fabric(backend_name, **small_options())       # no loop has used it yet
    other = fabric.Fabric(backend_name, **small_options())
    client, server = connect_pair(fab, other)
    attach = aio._Driver._watch
    delivered = []

    def attach_after_delivery(self, on):
        if on and not self.watching and not delivered:
            before = client.stats()["fabric_recvs"]
            server.send(b"while attaching")
            deadline = time.monotonic() + 30
            # the progress thread (the loop is not attached yet) takes it
            while client.stats()["fabric_recvs"] == before and time.monotonic() < deadline:
                time.sleep(0.005)
            delivered.append(client.stats()["fabric_recvs"] > before)
        attach(self, on)

    monkeypatch.setattr(aio._Driver, "_watch", attach_after_delivery)

    async def main():
        # no receive timeout: only the hang limit below ends a lost wake-up
        return await asyncio.wait_for(client.arecv(), 20)

    assert asyncio.run(main()) == b"while attaching"
    assert delivered == [True]
    fab.close()
    other.close()


async def _outcome(req, timeout=30):
    """'sent' or 'failed': how a request ended, waited for at most `timeout` s."""
    try:
        await asyncio.wait_for(req, timeout)
        return "sent"
    except fabric.FabricError:
        return "failed"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("connections", [1, 64])
@pytest.mark.parametrize("receiver", ["recv", "recv_into", "closes_halfway"])
def test_a_busy_loops_large_sends_are_served_while_it_computes(backend_name, receiver, connections):
    """An asyncio sender starts large sends and then runs code that does not
    yield (here it waits for its peers, which only progress made outside the
    loop can satisfy). Its peers pull (recv), are written into (recv_into),
    or receive half and close their Fabric. Everything sent arrives, or fails,
    before the loop runs again: the progress thread serves a polling loop
    that leaves an event waiting (Fabric.progress_stats busy_loop_rounds,
    where the sender's CPU must serve)."""
    import threading

    size = 1 << 20
    messages = [np.random.default_rng(i).integers(0, 255, size, dtype=np.uint8).tobytes()
                for i in range(connections)]
    fab = fabric.Fabric(backend_name, **small_options())
    other = fabric.Fabric(backend_name, **small_options())
    pairs = [connect_pair(fab, other) for _ in range(connections)]
    got = []

    def receive():
        buf = bytearray(size)
        for n, (_, server) in enumerate(pairs):
            if receiver == "closes_halfway" and n == max(1, connections // 2):
                other.close(linger=0)
                return
            if receiver == "recv_into":
                assert server.recv_into(buf, timeout=60) == size
                got.append(bytes(buf))
            else:
                got.append(bytes(server.recv(timeout=60)))

    async def main():
        watching = asyncio.ensure_future(pairs[0][0].arecv())   # the loop polls the sender's Fabric
        for _ in range(3):
            await asyncio.sleep(0)
        before = fab.progress_stats["busy_loop_rounds"]
        requests = [client.isend(msg) for (client, _), msg in zip(pairs, messages)]
        thread = threading.Thread(target=receive, daemon=True)
        thread.start()
        thread.join(90)                        # the loop is blocked until its peers are done
        assert not thread.is_alive(), "the peers waited for a loop that was not polling"
        assert got == messages[:len(got)]
        outcomes = [await _outcome(req) for req in requests]
        watching.cancel()
        return before, outcomes

    before, outcomes = asyncio.run(main())
    if receiver == "closes_halfway":
        assert len(got) == max(1, connections // 2)
        assert "failed" in outcomes or connections == 1
    else:
        assert len(got) == connections and outcomes == ["sent"] * connections
    if "reads_served" in fab.backend.capabilities:
        # the sender's CPU serves pulls and writes (verbs' NIC and UCX's
        # rendezvous may complete without it)
        assert fab.progress_stats["busy_loop_rounds"] > before
    fab.close()
    other.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("connections", [1, 200])
def test_a_busy_loops_peer_killed_mid_pull_fails_what_it_had_not_taken(backend_name, connections,
                                                                     peer_factory):
    """A loop that does not yield has large sends in flight to a peer process
    on `connections` connections; the peer receives half of them (its pulls
    served while the loop computes), then is killed with SIGKILL. What it took
    arrived intact; every other send fails within seconds of the kill, none
    hangs, and the loop's Fabric carries on."""
    import hashlib
    import json
    import threading
    import time

    size = 256 << 10
    taken = connections // 2
    messages = [np.random.default_rng(i).integers(0, 255, size, dtype=np.uint8).tobytes()
                for i in range(connections)]
    digests = {hashlib.sha256(m).hexdigest() for m in messages}
    # the peer pulls nothing ahead of its recv() calls (its budget is below one message)
    peer = peer_factory("receive_then_wait", connections, taken, backend=backend_name,
                        env={"FABRIC_TEST_OPTIONS": json.dumps({"recv_budget": 64 << 10})})
    fab = fabric.Fabric(backend_name, **small_options())
    clients = [fab.connect(peer.first_line, timeout=60) for _ in range(connections)]
    said, killed = [], []

    def watch_and_kill():
        while True:
            line = peer.read_line(timeout=90)
            if line != "waiting" and line:
                said.append(line)
                continue
            break
        peer.kill()
        killed.append(time.monotonic())

    async def main():
        watching = asyncio.ensure_future(clients[0].arecv())     # the loop polls the Fabric
        for _ in range(3):
            await asyncio.sleep(0)
        before = fab.progress_stats["busy_loop_rounds"]
        requests = [c.isend(m) for c, m in zip(clients, messages)]
        thread = threading.Thread(target=watch_and_kill, daemon=True)
        thread.start()
        thread.join(120)                       # the loop does not run meanwhile
        assert not thread.is_alive(), "the peer waited for a loop that was not polling"
        outcomes = [await _outcome(req) for req in requests]
        settled = time.monotonic()
        watching.cancel()
        return before, outcomes, settled

    before, outcomes, settled = asyncio.run(main())
    assert len(said) == taken and set(said) <= digests
    assert outcomes.count("sent") >= taken and outcomes.count("failed") >= 1
    assert settled - killed[0] < 15, "a send to the killed peer waited past its death"
    if taken and "reads_served" in fab.backend.capabilities:
        assert fab.progress_stats["busy_loop_rounds"] > before
    a, b = connect_pair(fab)                   # the Fabric carries on
    a.send(b"after")
    assert bytes(b.recv(timeout=10)) == b"after"
    fab.close()
