"""Receiver-posted buffers (POST / PUT): a recv_into() that waits before its
message is sent offers its buffer, and the sender writes the message into
it (tcp WRITE, verbs RDMA WRITE) instead of announcing it for a pull.

What must hold, on every backend that writes into posts (the others say
why they are skipped): a waiting receive gets its message by a put; a
message larger than the posted buffer, a receive that times out or is
cancelled while the sender writes, and a sender with posts switched off all
lose nothing (every message once, in order, intact); a peer writing outside
what was posted to it, or into a post released since, fails only that
connection with a fabric error and leaves the bytes around the buffer
untouched; a peer killed mid-write fails the waiting receive promptly."""
from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

import fabric
from conftest import PEER_FACING, connect_pair, small_options, wait_for

CHUNK = small_options()["chunk_size"]
EAGER = small_options()["eager_limit"]
HANG = 30
GUARD = 4096


def writes_into_posts(backend_name):
    fab = fabric.Fabric(backend_name, **small_options())
    try:
        return "ordered_write" in fab._worker.backend.capabilities
    finally:
        fab.close(linger=0)


@pytest.fixture
def posting(backend_name):
    if not writes_into_posts(backend_name):
        pytest.skip(f"{backend_name} does not write into posted buffers: over ucx a waiting receive "
                    "is met by UCX's own tag rendezvous (its zero-copy path), not by a fabric write")
    return backend_name


def pattern(index, size):
    unit = index.to_bytes(4, "little") + b"\xa5\x5a\x0f\xf0"
    return (unit * (size // 8 + 1))[:size]


class Waiting:
    """recv_into(buf) in a thread, begun now (so its POST leaves first)."""

    def __init__(self, ep, buf, timeout=HANG):
        self.ep, self.buf, self.result, self.error = ep, buf, None, None
        self.thread = threading.Thread(target=self.run, args=(timeout,), daemon=True)
        self.thread.start()

    def run(self, timeout):
        try:
            self.result = self.ep.recv_into(self.buf, timeout=timeout)
        except BaseException as e:      # noqa: BLE001 - the test looks at it
            self.error = e

    def join(self):
        self.thread.join(HANG + 10)
        assert not self.thread.is_alive(), "recv_into never returned"
        return self


def post_reached_peer(receiver, offered_before):
    return wait_for(lambda: receiver.stats()["posts_offered"] > offered_before, HANG)


def guarded(size):
    """A buffer of `size` between guard bytes: (whole, the middle as a view)."""
    whole = bytearray(b"\xcc" * (GUARD + size + GUARD))
    return whole, memoryview(whole)[GUARD:GUARD + size]


def guards_intact(whole):
    return whole[:GUARD] == b"\xcc" * GUARD and whole[-GUARD:] == b"\xcc" * GUARD


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [EAGER + 1, CHUNK, 5 * CHUNK + 3, 4 << 20])
def test_a_waiting_recv_into_gets_its_message_written_into_it(posting, size):
    a = fabric.Fabric(posting, **small_options())
    b = fabric.Fabric(posting, **small_options())
    try:
        client, server = connect_pair(a, b)
        for i in range(3):
            whole, view = guarded(size + 100)
            offered = server.stats()["posts_offered"]
            waiting = Waiting(server, view)
            assert post_reached_peer(server, offered)
            time.sleep(0.05)                       # the POST is on its way: let it land
            data = pattern(i, size)
            client.send(data)
            waiting.join()
            assert waiting.error is None, waiting.error
            assert waiting.result == size
            assert view[:size] == data
            assert view[size:] == b"\xcc" * 100, "bytes past the message were written"
            assert guards_intact(whole)
        assert client.stats()["sent_put"] >= 1, client.stats()
        assert server.stats()["puts_received"] == client.stats()["sent_put"]
        assert server.stats()["registered_regions"] == 0
        assert wait_for(lambda: client.stats()["registered_regions"] == 0, HANG)
    finally:
        a.close(linger=0)
        b.close(linger=0)


@pytest.mark.timeout(120)
def test_a_posted_buffer_too_small_is_not_written(posting):
    """The sender pulls instead: the receive reports MessageTooLarge and the
    next receive gets the message whole."""
    a = fabric.Fabric(posting, **small_options())
    b = fabric.Fabric(posting, **small_options())
    try:
        client, server = connect_pair(a, b)
        whole, view = guarded(3 * CHUNK)
        offered = server.stats()["posts_offered"]
        waiting = Waiting(server, view)
        assert post_reached_peer(server, offered)
        time.sleep(0.05)
        data = pattern(7, 3 * CHUNK + 1)
        client.send(data)
        waiting.join()
        assert isinstance(waiting.error, fabric.MessageTooLarge), waiting.error
        assert guards_intact(whole) and view == b"\xcc" * len(view)
        assert bytes(server.recv(timeout=HANG)) == data
        assert client.stats()["sent_put"] == 0
    finally:
        a.close(linger=0)
        b.close(linger=0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", ["receiver", "sender"])
def test_posts_switched_off_on_either_side(posting, which):
    ropts = small_options(posted_receives=0 if which == "receiver" else 1)
    sopts = small_options(posted_receives=0 if which == "sender" else 1)
    a = fabric.Fabric(posting, **sopts)
    b = fabric.Fabric(posting, **ropts)
    try:
        client, server = connect_pair(a, b)
        for i in range(3):
            buf = bytearray(4 * CHUNK)
            waiting = Waiting(server, buf)
            time.sleep(0.05)
            data = pattern(i, 3 * CHUNK)
            client.send(data)
            waiting.join()
            assert waiting.error is None and waiting.result == len(data) and buf[:len(data)] == data
        assert server.stats()["posts_offered"] == 0
        assert client.stats()["sent_put"] == 0
    finally:
        a.close(linger=0)
        b.close(linger=0)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("posted_receives", [1, 0])
def test_receives_that_time_out_while_the_sender_writes_lose_nothing(backend_name, posted_receives):
    """recv_into with short timeouts against a stream of large messages:
    whatever moment each receive gives up at (before the POST is used,
    while the writes or the pulls land, after the message completed), every
    message arrives once, in order, intact."""
    opts = small_options(posted_receives=posted_receives)
    a = fabric.Fabric(backend_name, **opts)
    b = fabric.Fabric(backend_name, **opts)
    try:
        client, server = connect_pair(a, b)
        count = 60
        sizes = [(3 * CHUNK + 17 * i) if i % 3 else (256 << 10) + i for i in range(count)]
        reqs = []

        def send_all():
            # most messages wait for a post first (then a receive that gives
            # up races the writes), some go at once (then it races the pull)
            for i, size in enumerate(sizes):
                if i % 5:
                    offered = server.stats()["posts_offered"]
                    wait_for(lambda: server.stats()["posts_offered"] > offered, 0.005 * (i % 3))
                reqs.append(client.isend(pattern(i, size)))

        sender = threading.Thread(target=send_all)
        sender.start()
        got = 0
        timeouts = 0
        deadline = time.monotonic() + 120
        while got < count and time.monotonic() < deadline:
            buf = bytearray(512 << 10)
            try:
                n = server.recv_into(buf, timeout=0.0005 * (1 + got % 5))
            except fabric.Timeout:
                timeouts += 1
                continue
            assert n == sizes[got] and buf[:n] == pattern(got, n), f"message {got} lost or corrupted"
            assert buf[n:] == bytes(len(buf) - n), f"message {got}: bytes past its end were written"
            got += 1
        sender.join(HANG)
        assert got == count, f"received {got} of {count}"
        for r in reqs:
            r.wait(timeout=HANG)
        assert timeouts > 0, "no receive timed out: the test exercised nothing"
        if posted_receives and writes_into_posts(backend_name):
            assert client.stats()["sent_put"] > 0, "no message was written into a post"
        client.send(b"after")
        assert bytes(server.recv(timeout=HANG)) == b"after"
        assert wait_for(lambda: server.stats()["registered_regions"] == 0, HANG)
    finally:
        a.close(linger=0)
        b.close(linger=0)


@pytest.mark.timeout(180)
def test_cancelled_async_receives_while_the_sender_writes_lose_nothing(backend_name):
    async def main():
        a = fabric.Fabric(backend_name, **small_options())
        b = fabric.Fabric(backend_name, **small_options())
        try:
            lst = b.listen("127.0.0.1:0")
            accepting = asyncio.ensure_future(lst.aaccept(timeout=HANG))
            client = await a.aconnect(lst.address, timeout=HANG)
            server = await accepting
            count = 40
            sizes = [3 * CHUNK + 5 * i for i in range(count)]

            async def send_all():
                for i, size in enumerate(sizes):
                    offered = server.stats()["posts_offered"]
                    for _ in range(i % 4):           # (a post, if one comes soon)
                        if server.stats()["posts_offered"] > offered:
                            break
                        await asyncio.sleep(0.001)
                    await client.asend(pattern(i, size))

            sending = asyncio.ensure_future(send_all())
            got = cancelled = 0
            while got < count:
                buf = bytearray(4 * CHUNK)
                task = asyncio.ensure_future(server.arecv_into(buf, timeout=HANG))
                await asyncio.sleep(0.0003 * (got % 7))
                task.cancel()
                try:
                    n = await task
                except asyncio.CancelledError:
                    cancelled += 1
                    continue
                assert n == sizes[got] and buf[:n] == pattern(got, n), f"message {got} lost or corrupted"
                got += 1
            await asyncio.wait_for(sending, HANG)
            assert cancelled > 0
            if writes_into_posts(backend_name):
                assert client.stats()["sent_put"] > 0, "no message was written into a post"
            await client.asend(b"after")
            assert bytes(await server.arecv(timeout=HANG)) == b"after"
        finally:
            a.close(linger=0)
            b.close(linger=0)
    asyncio.run(asyncio.wait_for(main(), 150))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["bad_write", "stale_post"])
def test_a_peer_writing_outside_what_was_posted_fails_only_its_connection(posting, monkeypatch, fault):
    """bad_write: the hostile sender writes across the end of the posted
    buffer; stale_post: it writes its second message into the first one's
    buffer, released since (and handed back to the application). Either
    way the receive fails with a fabric error, the bytes around the buffer
    and the earlier message stay as they were, and another connection of
    the same Fabric carries on."""
    monkeypatch.setenv("FABRIC_FAULT_INJECT", fault)
    hostile = fabric.Fabric(posting, **small_options())
    monkeypatch.delenv("FABRIC_FAULT_INJECT")
    victim = fabric.Fabric(posting, **small_options())
    honest = fabric.Fabric(posting, **small_options())
    try:
        client, server = connect_pair(hostile, victim)
        other_client, other_server = connect_pair(honest, victim)
        size = 3 * CHUNK
        first_whole, first = guarded(size)
        if fault == "stale_post":
            offered = server.stats()["posts_offered"]
            waiting = Waiting(server, first)
            assert post_reached_peer(server, offered)
            time.sleep(0.05)
            client.send(pattern(1, size))
            waiting.join()
            assert waiting.error is None and waiting.result == size and first == pattern(1, size)
        whole, view = guarded(size)
        offered = server.stats()["posts_offered"]
        waiting = Waiting(server, view)
        assert post_reached_peer(server, offered)
        time.sleep(0.05)
        req = client.isend(pattern(2, size))
        waiting.join()
        assert isinstance(waiting.error, (fabric.ProtocolError, fabric.ConnectionLost)), waiting.error
        assert guards_intact(whole) and guards_intact(first_whole)
        if fault == "stale_post":
            assert first == pattern(1, size), "a write landed in a buffer released to the application"
        with pytest.raises(fabric.FabricError):
            req.wait(timeout=HANG)
            client.recv(timeout=HANG)
        assert server.stats()["registered_regions"] == 0
        data = pattern(3, 5 * CHUNK)
        other_client.send(data)
        assert bytes(other_server.recv(timeout=HANG)) == data
    finally:
        hostile.close(linger=0)
        victim.close(linger=0)
        honest.close(linger=0)


@pytest.mark.timeout(120)
def test_a_sender_killed_mid_write_fails_the_waiting_receive_promptly(posting, peer_factory):
    victim = fabric.Fabric(posting, **small_options())
    try:
        lst = victim.listen(PEER_FACING)
        peer = peer_factory("faulty", lst.address, "send_when_posted", backend=posting,
                            env={"FABRIC_FAULT_INJECT": "die@put"})
        ep = lst.accept(timeout=HANG)
        whole, view = guarded(5 * CHUNK)
        offered = ep.stats()["posts_offered"]
        waiting = Waiting(ep, view)
        assert post_reached_peer(ep, offered)
        time.sleep(0.05)
        ep.send(b"go")
        started = time.monotonic()
        waiting.join()
        assert isinstance(waiting.error, fabric.ConnectionLost), waiting.error
        assert time.monotonic() - started < HANG
        assert guards_intact(whole)
        assert ep.stats()["registered_regions"] == 0
        peer.proc.wait(HANG)
        assert peer.proc.returncode == -9, "the peer did not die at the write"
        other = fabric.Fabric(posting, **small_options())
        try:
            c, s = connect_pair(other, victim)
            c.send(os.urandom(5 * CHUNK))
            assert len(s.recv(timeout=HANG)) == 5 * CHUNK
        finally:
            other.close(linger=0)
    finally:
        victim.close(linger=0)


@pytest.mark.timeout(300)
def test_hundreds_of_connections_each_with_a_waiting_receive(posting):
    """200 connections (FABRIC_TEST_CONNECTIONS in the guest), each receive posted before its message is sent, all
    at once on two Fabrics (asyncio): every message is written into its
    own connection's buffer, none into another's."""
    count, size = min(200, int(os.environ.get("FABRIC_TEST_CONNECTIONS", "200"))), 2 * CHUNK + 11

    async def main():
        a = fabric.Fabric(posting, **small_options())
        b = fabric.Fabric(posting, **small_options())
        try:
            lst = b.listen("127.0.0.1:0")
            pairs = []
            for _ in range(count):
                accepting = asyncio.ensure_future(lst.aaccept(timeout=HANG))
                client = await a.aconnect(lst.address, timeout=HANG)
                pairs.append((client, await accepting))
            bufs = [bytearray(3 * CHUNK) for _ in range(count)]
            receives = [asyncio.ensure_future(s.arecv_into(buf, timeout=HANG))
                        for (_, s), buf in zip(pairs, bufs)]
            deadline = time.monotonic() + HANG
            while (sum(s.stats()["posts_offered"] for _, s in pairs) < count
                   and time.monotonic() < deadline):
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            await asyncio.gather(*(c.asend(pattern(i, size)) for i, (c, _) in enumerate(pairs)))
            got = await asyncio.gather(*receives)
            assert got == [size] * count
            for i, buf in enumerate(bufs):
                assert buf[:size] == pattern(i, size), f"connection {i} got another's bytes"
            puts = sum(c.stats()["sent_put"] for c, _ in pairs)
            assert puts >= count // 2, f"only {puts} of {count} messages were written into posts"
        finally:
            a.close(linger=0)
            b.close(linger=0)
    asyncio.run(asyncio.wait_for(main(), 280))
