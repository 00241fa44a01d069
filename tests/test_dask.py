"""fabric as a Dask comm backend (fabric.dask), on every fabric.

Comm-level behaviours Dask relies on (its own comm tests are not shipped in
its wheel; these check the same behaviours): echo with one and many clients,
addresses, closing from either end, connect timeouts, many listeners,
(de)serialization on and off, truncated data, IPv6, hostile headers, the
zero-copy receive. Then real clusters: LocalCluster with threads and with
processes, a large worker-to-worker transfer, an array workload, a P2P
rechunk, a worker killed mid-transfer, and the dask CLI."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("distributed", reason="fabric.dask needs distributed (pip install fabric-transport[dask])")

import dask  # noqa: E402
import dask.array as da  # noqa: E402
from distributed import Client, LocalCluster  # noqa: E402
from distributed.comm import CommClosedError, connect, listen, registry  # noqa: E402
from distributed.protocol import Serialized, deserialize, to_serialize  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

import fabric  # noqa: E402
from fabric import dask as fdask  # noqa: E402
from conftest import sigint_default  # noqa: E402

# how long a step may take before the test calls it a hang (not a timing claim)
HANG = 60
IN_GUEST = os.environ.get("FABRIC_TEST_BACKENDS") == "verbs"


def deserialize_frames(serialized):
    return deserialize(serialized.header, serialized.frames)


def scheme_of(backend_name):
    return f"fabric+{backend_name}"


def run(coro, limit=HANG * 2):
    return asyncio.run(asyncio.wait_for(coro, limit))


def result_or_state(client, cluster, work, limit=HANG * 2):
    """The result of work (a collection or a future), or past `limit` an
    AssertionError saying what the cluster and this process's fabric were
    doing: a hang in CI then names where it is, not only that it happened."""
    future = work if hasattr(work, "result") else client.compute(work)
    try:
        return future.result(timeout=limit)
    except (TimeoutError, asyncio.TimeoutError):
        raise AssertionError(f"no result in {limit} s; {cluster_state(cluster)}") from None


def cluster_state(cluster):
    """The scheduler's and (threaded workers) each worker's unfinished tasks,
    and each shared Fabric's endpoints; read from another thread, so best effort."""
    out = []
    try:
        by_state = {}
        for key, ts in list(cluster.scheduler.tasks.items()):
            by_state.setdefault(ts.state, []).append(str(key))
        out.append("scheduler: " + ", ".join(f"{state} {len(keys)} {keys[:3] if state != 'memory' else ''}"
                                             for state, keys in by_state.items()))
        for address, worker in list(cluster.workers.items()):
            tasks = getattr(getattr(worker, "state", None), "tasks", None)
            if tasks is not None:
                busy = [(str(k), t.state) for k, t in list(tasks.items()) if t.state not in ("memory", "released")]
                out.append(f"worker {address} ({getattr(worker, 'status', '?')}): {busy[:10]}")
    except Exception as e:                  # noqa: BLE001 - a diagnosis must not hide the failure
        out.append(f"(scheduler state unavailable: {e!r})")
    for name, (fab, leases, _) in list(fdask._fabrics._by_name.items()):
        eps = [ep for ep in fab._worker._debug_state().get("endpoints", [])
               if ep["inq"] or ep["sendq"] or ep["rndv_in"] or ep["rndv_out"] or ep["state"] != 2]
        out.append(f"fabric {name} ({leases} leases), endpoints not idle: {eps}")
    return "; ".join(out)


async def echo_server(scheme, host="127.0.0.1", **kwargs):
    """A listener that sends back every message it reads."""
    async def handle(comm):
        try:
            while True:
                msg = await comm.read()
                await comm.write(msg)
        except CommClosedError:
            pass
        finally:
            await comm.close()

    lst = listen(f"{scheme}://{host}:0", handle, **kwargs)
    await lst.start()
    return lst


@pytest.fixture(autouse=True)
def no_fabric_left_behind():
    """After each test, every comm and listener is gone, and so is the shared
    Fabric they used (its descriptors and engine thread): what a closed
    cluster must leave behind. A leak fails the test that made it (and is
    cleaned up, so it does not fail the next one)."""
    yield
    deadline = time.monotonic() + HANG
    while fdask._fabrics._by_name and time.monotonic() < deadline:
        time.sleep(0.05)
    left = dict(fdask._fabrics._by_name)
    fdask._fabrics._by_name.clear()
    for fab, _, _ in left.values():
        fab.close(linger=0)
    assert not left, f"shared Fabrics still leased after the test: {left}"


# ------------------------------------------------------------ registration

def test_entry_points_name_every_scheme():
    """Dask finds the backends through the package's entry points alone."""
    for scheme, cls in [("fabric", fdask.FabricBackend), ("fabric+tcp", fdask.TcpBackend),
                        ("fabric+ucx", fdask.UcxBackend), ("fabric+verbs", fdask.VerbsBackend)]:
        registry.backends.pop(scheme, None)
        assert type(registry.get_backend(scheme)) is cls


# ---------------------------------------------------------- wire format

frame_sizes = st.lists(st.integers(0, 3 * fdask.INLINE_MAX), max_size=12)
# codec tests touch no fabric: the guest (20x slower Python) leaves them to the host
NO_FABRIC = pytest.mark.skipif(IN_GUEST, reason="no fabric involved: the host runs it")


@NO_FABRIC
@settings(max_examples=200, deadline=None)
@given(frame_sizes)
def test_pack_unpack_round_trip(sizes):
    frames = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    first, separate, total = fdask.pack(frames)
    head = b"".join(bytes(p) for p in first)
    assert total == len(head) + sum(v.nbytes for v in separate)
    out, later = fdask.unpack(bytearray(head))
    assert [n for _, n in later] == [v.nbytes for v in separate]
    for (i, _), v in zip(later, separate):
        out[i] = v
    assert [bytes(f) for f in out] == frames


@NO_FABRIC
@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_unpack_refuses_garbage_with_value_error(data):
    try:
        frames, later = fdask.unpack(bytearray(data))
    except ValueError:
        return
    assert data[:4] == fdask.MAGIC          # only a well-formed header gets through


@NO_FABRIC
@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1), st.lists(st.integers(0, 2**64 - 1), max_size=8), st.binary(max_size=64))
def test_unpack_bounds_what_a_header_announces(count, words, tail):
    """A header may name any count and lengths: unpack either refuses it or
    returns frames whose total stays within the limit (nothing is allocated
    from what a header claims)."""
    data = struct.pack("<4sI", fdask.MAGIC, count) + b"".join(struct.pack("<Q", w) for w in words) + tail
    try:
        frames, later = fdask.unpack(bytearray(data), max_message=1 << 20)
    except ValueError:
        return
    assert count == len(words) == len(frames)
    assert sum(n for _, n in later) + sum(f.nbytes for f in frames if f is not None) <= 1 << 20


# --------------------------------------------------------------- comms

@pytest.mark.timeout(180)
@pytest.mark.parametrize("clients", [1, 20])
def test_echo_with_one_and_many_clients(backend_name, clients):
    scheme = scheme_of(backend_name)

    async def main():
        lst = await echo_server(scheme)

        async def client(i):
            comm = await connect(lst.contact_address, timeout=HANG)
            for k in range(5):
                msg = {"op": "ping", "client": i, "k": k, "data": b"x" * (i * 1000 + k)}
                await comm.write(msg)
                assert await comm.read() == msg
            await comm.close()

        await asyncio.gather(*[client(i) for i in range(clients)])
        lst.stop()

    run(main())


@pytest.mark.timeout(120)
def test_addresses_are_consistent(backend_name):
    scheme = scheme_of(backend_name)

    async def main():
        seen = []

        async def handle(comm):
            seen.append(comm)
            await comm.read()
            await comm.close()

        lst = listen(f"{scheme}://127.0.0.1:0", handle)
        await lst.start()
        assert lst.listen_address.startswith(scheme + "://127.0.0.1:")
        assert lst.contact_address == lst.listen_address
        comm = await connect(lst.contact_address, timeout=HANG)
        assert comm.peer_address == lst.contact_address
        assert comm.local_address.startswith(scheme + "://127.0.0.1:")
        await comm.write("hello")
        while not seen:
            await asyncio.sleep(0.01)
        server_comm = seen[0]
        assert server_comm.local_address == lst.contact_address
        assert server_comm.peer_address == comm.local_address
        assert comm.same_host and server_comm.same_host
        assert comm.extra_info["fabric_backend"] == fabric.Fabric(backend_name).name
        await comm.close()
        lst.stop()

    run(main())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("who", ["client", "server"])
@pytest.mark.parametrize("how", ["close", "abort", "garbage-collected"])
def test_closing_one_end_fails_the_other(backend_name, who, how):
    scheme = scheme_of(backend_name)

    async def main():
        server_side = []
        done = asyncio.Event()

        async def handle(comm):
            server_side.append(comm)
            await done.wait()

        lst = listen(f"{scheme}://127.0.0.1:0", handle)
        await lst.start()
        client = await connect(lst.contact_address, timeout=HANG)
        while not server_side:
            await asyncio.sleep(0.01)
        server = server_side.pop()
        closing, other = (client, server) if who == "client" else (server, client)
        if how == "close":
            await closing.close()
            await closing.close()                      # idempotent
        elif how == "abort":
            closing.abort()
            closing.abort()
        else:
            closing._finalizer()                      # what garbage collection runs
        if how != "garbage-collected":
            assert closing.closed()
            with pytest.raises(CommClosedError):
                await closing.read()
            with pytest.raises(CommClosedError):
                await closing.write("x")
        with pytest.raises(CommClosedError):
            await asyncio.wait_for(other.read(), HANG)
        assert other.closed()
        with pytest.raises(CommClosedError):
            await other.write("x")
        done.set()
        await other.close()
        if how == "garbage-collected":
            closing.abort()
        lst.stop()

    run(main())


@pytest.mark.timeout(60)
def test_reads_after_the_peer_closed_return_what_was_sent_first(backend_name):
    scheme = scheme_of(backend_name)

    async def main():
        async def handle(comm):
            for i in range(3):
                await comm.write({"i": i, "data": b"y" * (i * 100_000)})
            await comm.close()

        lst = listen(f"{scheme}://127.0.0.1:0", handle)
        await lst.start()
        comm = await connect(lst.contact_address, timeout=HANG)
        await asyncio.sleep(0.2)                     # the server closed by now
        for i in range(3):
            assert (await comm.read())["i"] == i
        with pytest.raises(CommClosedError):
            await comm.read()
        lst.stop()

    run(main())


@pytest.mark.timeout(60)
def test_connect_to_nothing_raises_oserror(backend_name):
    """Nothing listens there: Dask's connect retries until its timeout, then
    raises OSError (bench/dask_compare.py measures how long that takes)."""
    scheme = scheme_of(backend_name)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]               # free, nobody listening

    async def main():
        started = time.monotonic()
        with pytest.raises(OSError):
            await connect(f"{scheme}://127.0.0.1:{port}", timeout=1)
        return time.monotonic() - started

    assert run(main()) < HANG


@pytest.mark.timeout(180)
def test_many_listeners_have_distinct_addresses(backend_name):
    scheme = scheme_of(backend_name)
    count = int(os.environ.get("FABRIC_TEST_CONNECTIONS", "100")) // (4 if IN_GUEST else 1)

    async def main():
        async def handle(comm):
            await comm.close()

        for host in ["127.0.0.1", "0.0.0.0", ""]:
            listeners = []
            for _ in range(count):
                lst = listen(f"{scheme}://{host}:0" if host else f"{scheme}://", handle)
                await lst.start()
                listeners.append(lst)
            addresses = {lst.listen_address for lst in listeners}
            assert len(addresses) == count
            contacts = {lst.contact_address for lst in listeners}
            assert len(contacts) == count
            for lst in listeners:
                lst.stop()

    run(main())


@pytest.mark.timeout(180)
@pytest.mark.parametrize("deserialize", [True, False])
def test_round_trips_with_and_without_deserializing(backend_name, deserialize):
    scheme = scheme_of(backend_name)
    rng = np.random.default_rng(1)
    array = rng.integers(0, 1 << 30, (8 << 20) // 8)

    async def main():
        got = []

        async def handle(comm):
            got.append(await comm.read())
            await comm.close()

        msgs = [{"op": "small", "x": 1}, {"op": "bytes", "x": b"z" * (8 << 20)},
                {"op": "array", "x": to_serialize(array)}, {"op": "list", "x": [to_serialize(array[:10]), 5]}]
        for msg in msgs:
            lst = listen(f"{scheme}://127.0.0.1:0", handle, deserialize=deserialize)
            await lst.start()
            comm = await connect(lst.contact_address, deserialize=deserialize, timeout=HANG)
            await comm.write(msg)
            while len(got) < msgs.index(msg) + 1:
                await asyncio.sleep(0.01)
            await comm.close()
            lst.stop()
        small, big, arr, lst_msg = got
        assert small == {"op": "small", "x": 1}
        assert big["x"] == b"z" * (8 << 20)
        if deserialize:
            assert isinstance(arr["x"], np.ndarray) and np.array_equal(arr["x"], array)
            assert np.array_equal(lst_msg["x"][0], array[:10]) and lst_msg["x"][1] == 5
        else:
            assert isinstance(arr["x"], Serialized)      # frames kept as they came
            assert np.array_equal(deserialize_frames(arr["x"]), array)

    run(main())


@pytest.mark.timeout(60)
def test_large_arrays_arrive_in_their_own_writable_buffers(backend_name):
    """A large frame lands by recv_into in a fresh host_array: the numpy array
    Dask rebuilds is writable and owns no copy of a shared buffer."""
    scheme = scheme_of(backend_name)
    array = np.arange(1 << 20, dtype=np.float64)

    async def main():
        got = []

        async def handle(comm):
            got.append(await comm.read())
            await comm.close()

        lst = listen(f"{scheme}://127.0.0.1:0", handle)
        await lst.start()
        comm = await connect(lst.contact_address, timeout=HANG)
        await comm.write({"a": to_serialize(array), "b": to_serialize(array[:5])})
        while not got:
            await asyncio.sleep(0.01)
        a = got[0]["a"]
        assert np.array_equal(a, array)
        assert a.flags.writeable
        assert a.base is not None and a.nbytes == memoryview(a.base).nbytes   # a buffer of its own
        await comm.close()
        lst.stop()

    run(main())


@pytest.mark.timeout(60)
def test_eoferror_while_deserializing_closes_the_comm(backend_name, monkeypatch):
    scheme = scheme_of(backend_name)

    async def truncated(*args, **kwargs):
        raise EOFError("truncated")

    async def main():
        server_side = []

        async def handle(comm):
            server_side.append(comm)

        lst = listen(f"{scheme}://127.0.0.1:0", handle)
        await lst.start()
        comm = await connect(lst.contact_address, timeout=HANG)
        while not server_side:
            await asyncio.sleep(0.01)
        monkeypatch.setattr(fdask, "from_frames", truncated)
        await server_side[0].write({"x": 1})
        with pytest.raises(CommClosedError):
            await comm.read()
        assert comm.closed()
        assert "closed" in repr(comm)
        await server_side[0].close()
        lst.stop()

    run(main())


@pytest.mark.timeout(60)
def test_cancelled_read_aborts_the_comm(backend_name):
    scheme = scheme_of(backend_name)

    async def main():
        lst = await echo_server(scheme)
        comm = await connect(lst.contact_address, timeout=HANG)
        assert "closed" not in repr(comm)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(comm.read(), 0.2)
        assert comm.closed()
        assert "closed" in repr(comm)
        with pytest.raises(CommClosedError):
            await comm.write("x")
        lst.stop()

    run(main())


@pytest.mark.timeout(60)
def test_unknown_connection_arguments_are_ignored(backend_name):
    scheme = scheme_of(backend_name)

    async def main():
        async def handle(comm):
            await comm.close()

        lst = listen(f"{scheme}://127.0.0.1:0", handle, require_encryption=False, something_new=3)
        await lst.start()
        comm = await connect(lst.contact_address, timeout=HANG, something_new=3)
        await comm.close()
        lst.stop()

    run(main())


@pytest.mark.timeout(60)
def test_ipv6(backend_name):
    scheme = scheme_of(backend_name)
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError as e:
        pytest.skip(f"no IPv6 loopback here: {e}")

    async def main():
        lst = await echo_server(scheme, host="[::1]")
        assert lst.listen_address.startswith(scheme + "://[::1]:")
        comm = await connect(lst.contact_address, timeout=HANG)
        assert comm.local_address.startswith(scheme + "://[::1]:")
        await comm.write({"v6": True})
        assert await comm.read() == {"v6": True}
        await comm.close()
        lst.stop()

    run(main())


HOSTILE = {
    "not a header": [b"GET / HTTP/1.1\r\n\r\n"],
    "too many frames": [struct.pack("<4sI", fdask.MAGIC, fdask.MAX_FRAMES + 1)],
    "huge frame": [struct.pack("<4sIQ", fdask.MAGIC, 1, (1 << 62) | fdask.SEPARATE)],
    "short frame": [struct.pack("<4sIQ", fdask.MAGIC, 1, 100_000 | fdask.SEPARATE), b"s" * 99_999],
    "long frame": [struct.pack("<4sIQ", fdask.MAGIC, 1, 100_000 | fdask.SEPARATE), b"l" * 100_001],
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("payload,stage", [(p, "after the handshake") for p in HOSTILE]
                         + [("not a header", "as the handshake"), ("huge frame", "as the handshake")])
def test_hostile_messages_close_that_comm_only(backend_name, payload, stage):
    """A peer that speaks fabric but not Dask's framing: its comm closes with
    CommClosedError (during the handshake: the connection is dropped before
    the handler sees it), nothing is allocated from what its header claims,
    and the listener serves the next client."""
    from distributed.comm.utils import to_frames
    scheme = scheme_of(backend_name)

    async def main():
        errors = []

        async def handle(comm):
            try:
                await comm.read()
            except CommClosedError as e:
                errors.append(e)
            await comm.close()

        lst = listen(f"{scheme}://127.0.0.1:0", handle)
        await lst.start()
        fab = fabric.Fabric(backend_name)
        ep = await fab.aconnect(lst.contact_address.split("://", 1)[1], timeout=HANG)
        await ep.arecv(timeout=HANG)                      # the listener's handshake
        if stage == "after the handshake":
            hello = await to_frames({"compression": None, "python": tuple(sys.version_info)[:3],
                                     "pickle-protocol": 5})
            first, separate, _ = fdask.pack(hello)
            assert not separate
            await ep.asend(first)
        try:
            for part in HOSTILE[payload]:
                await ep.asend(part)
        except fabric.FabricError:
            pass          # dropped while we were still sending (a part it never took)
        # the listener drops the connection
        with pytest.raises(fabric.FabricError):
            await ep.arecv(timeout=HANG)
        if stage == "after the handshake":
            assert len(errors) == 1 and isinstance(errors[0], CommClosedError)
        else:
            assert not errors                             # never handed to the handler
        await ep.aclose()
        fab.close()
        # the listener goes on serving
        comm = await connect(lst.contact_address, timeout=HANG)
        await comm.write("still there")
        await comm.close()
        lst.stop()

    run(main())


@pytest.mark.timeout(60)
def test_shared_fabric_closes_with_its_last_user(backend_name):
    scheme = scheme_of(backend_name)

    async def main():
        lst = await echo_server(scheme)
        comm = await connect(lst.contact_address, timeout=HANG)
        fab = comm._lease.fabric
        await comm.write(1)
        assert await comm.read() == 1
        await comm.close()
        assert not fab.closed               # the listener and its comm still use it
        lst.stop()
        for _ in range(500):
            if fab.closed:
                break
            await asyncio.sleep(0.01)
        assert fab.closed

    run(main())


# ------------------------------------------------------------- clusters

def skip_shared_memory_twin():
    """ucx with UCX_TLS unset already runs clusters over shared memory (two
    processes of one host negotiate it); UCX_TLS=sm would repeat it."""
    if os.environ.get("UCX_TLS") == "sm":
        pytest.skip("the ucx variant (UCX_TLS unset) runs this cluster over shared memory already")


def cluster_kwargs(processes):
    kwargs = dict(n_workers=2, threads_per_worker=1, processes=processes, dashboard_address=None,
                  silence_logs=40)
    if not processes:
        # Threaded workers measure this process's memory, which holds the
        # whole test session's (860 MiB in the guest by then, of a 1 GiB limit
        # per worker): one paused at 80 % gets no tasks, and the computation
        # waited for its 300 s timeout. What they test is the comm, not spilling.
        kwargs["memory_limit"] = 0
    return kwargs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("processes", [False, True])
def test_local_cluster_submit_gather_and_arrays(backend_name, processes):
    if processes and IN_GUEST:
        pytest.skip("worker processes import Dask for minutes under TCG; threads cover verbs")
    scheme = scheme_of(backend_name)
    with LocalCluster(protocol=f"{scheme}://", **cluster_kwargs(processes)) as cluster, \
            Client(cluster) as client:
        assert cluster.scheduler_address.startswith(scheme + "://")
        futures = client.map(lambda x: x * 2, range(50))
        assert client.gather(futures) == [x * 2 for x in range(50)]
        side = 400 if IN_GUEST else 2000                  # TCG: 16 chunks of 100x100
        x = da.random.default_rng(0).random((side, side), chunks=(side // 4, side // 4))
        expected = float((x.compute() + x.compute().T).sum())
        assert abs(float((x + x.T).sum().compute()) - expected) < 1e-6 * abs(expected)
        workers = list(client.scheduler_info()["workers"])
        assert all(w.startswith(scheme + "://") for w in workers)


@pytest.mark.timeout(300)
def test_large_worker_to_worker_transfer(backend_name):
    """256 MiB from one worker to the other (64 MiB in the guest)."""
    skip_shared_memory_twin()
    scheme = scheme_of(backend_name)
    size = (64 if IN_GUEST else 256) << 20
    with LocalCluster(protocol=f"{scheme}://", **cluster_kwargs(not IN_GUEST)) as cluster, \
            Client(cluster) as client:
        a, b = list(client.scheduler_info()["workers"])
        data = client.submit(lambda n: np.arange(n // 8, dtype=np.int64), size, workers=[a], pure=False)
        total = client.submit(lambda arr: int(arr.sum()), data, workers=[b], pure=False)
        n = size // 8
        assert result_or_state(client, cluster, total) == n * (n - 1) // 2


@pytest.mark.timeout(300)
def test_p2p_rechunk(backend_name):
    skip_shared_memory_twin()
    scheme = scheme_of(backend_name)
    with LocalCluster(protocol=f"{scheme}://", **cluster_kwargs(not IN_GUEST)) as cluster, \
            Client(cluster) as client:
        n, k = (200, 10) if IN_GUEST else (1000, 100)      # k x k pieces move (TCG: fewer)
        x = da.random.default_rng(1).random((n, n), chunks=(n, n // k))
        with dask.config.set({"array.rechunk.method": "p2p"}):
            y = x.rechunk((n // k, n))
            total = float(result_or_state(client, cluster, y.sum()))
        assert abs(total - float(result_or_state(client, cluster, x.sum()))) < 1e-6 * total


@pytest.mark.timeout(300)
def test_worker_killed_mid_transfer_the_scheduler_recovers(backend_name):
    """A worker process killed while its data moves: the cluster (the nanny
    restarts it) recomputes and the result is right."""
    if IN_GUEST:
        pytest.skip("needs worker processes (minutes under TCG); tcp and ucx cover the recovery")
    skip_shared_memory_twin()
    scheme = scheme_of(backend_name)
    with LocalCluster(protocol=f"{scheme}://", **cluster_kwargs(True)) as cluster, \
            Client(cluster) as client:
        a, b = list(client.scheduler_info()["workers"])
        pids = client.run(os.getpid)
        parts = [client.submit(lambda i: np.full(4 << 20, i, dtype=np.int64), i, workers=[a], pure=False,
                               allow_other_workers=True) for i in range(8)]
        client.wait_for_workers(2)
        total = client.submit(lambda *xs: int(sum(int(x.sum()) for x in xs)), *parts, workers=[b],
                              pure=False, allow_other_workers=True)
        time.sleep(0.05)
        os.kill(pids[a], signal.SIGKILL)
        assert total.result(timeout=HANG * 2) == sum(i * (4 << 20) for i in range(8))


@pytest.mark.timeout(300)
def test_scheduler_and_workers_from_the_cli(backend_name, tmp_path):
    if IN_GUEST:
        pytest.skip("three interpreters importing Dask take minutes under TCG")
    if os.environ.get("UCX_TLS"):
        pytest.skip("the CLI path is the same whatever UCX_TLS says: tcp and ucx (UCX_TLS unset) run it")
    scheme = scheme_of(backend_name)
    dask_cli = os.path.join(os.path.dirname(sys.executable), "dask")
    file = tmp_path / "scheduler.json"
    env = dict(os.environ)
    procs = []
    try:
        procs.append(subprocess.Popen([dask_cli, "scheduler", "--protocol", scheme, "--host", "127.0.0.1",
                                       "--port", "0", "--no-dashboard", "--scheduler-file", str(file)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                                      preexec_fn=sigint_default))
        deadline = time.monotonic() + HANG
        while not file.exists() and time.monotonic() < deadline:
            assert procs[0].poll() is None, procs[0].stderr.read().decode()[-2000:]
            time.sleep(0.1)
        with Client(scheduler_file=str(file), timeout=HANG) as client:
            address = client.scheduler.address
            assert address.startswith(scheme + "://")
            for _ in range(2):
                procs.append(subprocess.Popen([dask_cli, "worker", address, "--nthreads", "1",
                                               "--no-dashboard", "--nworkers", "1"],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                                              preexec_fn=sigint_default))
            client.wait_for_workers(2, timeout=HANG)
            assert sum(client.gather(client.map(lambda x: x + 1, range(20)))) == sum(range(1, 21))
            assert all(w.startswith(scheme + "://") for w in client.scheduler_info()["workers"])
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGINT)
        for p in reversed(procs):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stderr.close()


# ------------------------------------------- Dask's own harness and leak checks

def _gen_cluster_test(scheme):
    """A test under Dask's gen_cluster: a scheduler and two workers on
    `scheme` in this process, and Dask's checks around it (no thread,
    process or Comm left open afterwards)."""
    from distributed.utils_test import gen_cluster

    backend = scheme.split("+", 1)[1]

    @gen_cluster(client=True, scheduler_kwargs={"protocol": scheme}, worker_kwargs={"protocol": scheme},
                 timeout=HANG * 2)
    async def test(c, s, a, b):
        assert s.address.startswith(scheme + "://") and a.address.startswith(scheme + "://")
        x = c.submit(lambda n: np.arange(n), 1 << 20, workers=[a.address])
        y = c.submit(lambda v: int(v.sum()), x, workers=[b.address])
        assert await y == (1 << 20) * ((1 << 20) - 1) // 2

    available, why = fabric.available_backends().get(backend, (False, "unknown"))
    wanted = os.environ.get("FABRIC_TEST_BACKENDS")
    marks = [pytest.mark.timeout(HANG * 3)]
    if not available:
        marks.append(pytest.mark.skip(reason=f"backend {backend} unavailable here: {why}"))
    elif wanted is not None and backend not in wanted.split(","):
        marks.append(pytest.mark.skip(reason=f"FABRIC_TEST_BACKENDS={wanted} leaves {backend} out"))
    for mark in marks:
        test = mark(test)
    return test


test_gen_cluster_and_its_leak_checks_on_fabric_tcp = _gen_cluster_test("fabric+tcp")
test_gen_cluster_and_its_leak_checks_on_fabric_ucx = _gen_cluster_test("fabric+ucx")
test_gen_cluster_and_its_leak_checks_on_fabric_verbs = _gen_cluster_test("fabric+verbs")
