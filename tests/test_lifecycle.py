"""Lifetimes: interpreter exit with threads still blocked, Fabric.close(),
context managers, ResourceWarning, fork, and every public method on objects
that are closed, failed or were never built (none may crash the interpreter).
Runs on every backend (see conftest)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest

import fabric
from conftest import ROOT, connect_pair, sigint_default, small_options


def run_script(code, backend_name, timeout=60, env=None):
    """Run code in a fresh interpreter (argv[1] = backend); a hang fails the test."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code), backend_name],
                              capture_output=True, text=True, timeout=timeout, env=full_env)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the interpreter did not exit within {timeout} s "
                             f"(stderr: {e.stderr!r})") from None


def fd_count():
    return len(os.listdir("/proc/self/fd"))


def thread_count():
    return len(os.listdir("/proc/self/task"))


# ------------------------------------------------------------------ exit

PREAMBLE = """
import sys, time, threading, socket, fabric
OPTS = dict(eager_limit=4096, chunk_size=16384, recv_budget=1 << 20, credits=8, send_buffers=4)
fab = fabric.Fabric(sys.argv[1], **OPTS); lst = fab.listen()
ep = fab.connect(lst.address, timeout=10); peer = lst.accept(timeout=10)
"""

BLOCKED = {
    # the script: a daemon thread blocked in recv at exit
    "recv": "threading.Thread(target=peer.recv, daemon=True).start()",
    "recv_into": "threading.Thread(target=peer.recv_into, args=(bytearray(1 << 20),), daemon=True).start()",
    "accept": "lst2 = fab.listen(); threading.Thread(target=lst2.accept, daemon=True).start()",
    # larger than the receiver's recv_budget: it waits for a receive that never comes
    "send": "threading.Thread(target=ep.send, args=(bytes(4 << 20),), daemon=True).start()",
    "request_wait": "req = ep.isend(bytes(4 << 20)); threading.Thread(target=req.wait, daemon=True).start()",
    "connect_handshake": ("raw = socket.socket(); raw.bind(('127.0.0.1', 0)); raw.listen(8); "
                          "addr = '127.0.0.1:%d' % raw.getsockname()[1]; "
                          "threading.Thread(target=fab.connect, args=(addr,), daemon=True).start()"),
    # Each blocked wait wakes every 200 ms; a wake-up after the interpreter
    # freed its thread states crashed when it asked for the GIL (verbs in the
    # guest, 1 exit in 4): many waiters make that window likely to be hit.
    "threads": ("pairs = [(fab.connect(lst.address, timeout=10), lst.accept(timeout=10)) for _ in range(12)]; "
                "[threading.Thread(target=e.recv, daemon=True).start() for p in pairs for e in p]"),
    "many": ("[threading.Thread(target=e.recv, daemon=True).start() for e in (peer, ep)]; "
             "lst2 = fab.listen(); threading.Thread(target=lst2.accept, daemon=True).start()"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("blocked_in", sorted(BLOCKED))
def test_interpreter_exits_with_threads_blocked_in_fabric(backend_name, blocked_in):
    """Regression: exit hung in Listener.__dealloc__ on the engine lock that a
    daemon thread, blocked on the GIL at exit, held forever."""
    code = PREAMBLE + BLOCKED[blocked_in] + "\ntime.sleep(0.3)\nprint('exiting')\n"
    r = run_script(code, backend_name, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "exiting", r.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("blocked_in", ["recv", "send"])
def test_ctrl_c_interrupts_a_blocked_call_promptly(backend_name, blocked_in):
    """SIGINT raises KeyboardInterrupt out of a blocking call; the process
    then exits (no wait on UCX or a lock)."""
    call = "peer.recv()" if blocked_in == "recv" else "ep.send(bytes(4 << 20))"
    code = PREAMBLE + textwrap.dedent(f"""
        print("blocking", flush=True)
        try:
            {call}
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            raise
    """)
    full_env = dict(os.environ, PYTHONPATH=ROOT)
    # SIGINT at its default in the child: a suite started as a background job
    # of a non-interactive shell (CI, nohup) inherits it ignored, and Python
    # then installs no KeyboardInterrupt handler
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), backend_name],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                            preexec_fn=sigint_default)
    try:
        assert proc.stdout.readline().strip() == "blocking"
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "interrupted" in out, err
    assert "KeyboardInterrupt" in err
    # and exits as Python does on an uncaught KeyboardInterrupt: no crash on
    # the way out (a native rendezvous in flight over ucx once segfaulted here)
    assert proc.returncode in (1, -signal.SIGINT), (proc.returncode, err[-3000:])
    assert "Fatal Python error" not in err, err[-3000:]


@pytest.mark.timeout(60)
def test_interrupted_receive_keeps_its_message(backend_name):
    """A receive interrupted (here: cancelled) after its message arrived
    leaves the message for the next receive."""
    async def main():
        a = fabric.Fabric(backend_name, **small_options())
        b = fabric.Fabric(backend_name, **small_options())
        client, server = connect_pair(a, b)
        try:
            for i in range(20):
                task = asyncio.ensure_future(server.arecv(timeout=10))
                await asyncio.sleep(0)
                client.send(b"m%d" % i)
                await asyncio.sleep(0.002 * (i % 4))
                task.cancel()
                try:
                    got = await task
                except asyncio.CancelledError:
                    got = await server.arecv(timeout=10)
                assert bytes(got) == b"m%d" % i
        finally:
            a.close(linger=0)
            b.close(linger=0)
    asyncio.run(asyncio.wait_for(main(), 50))


# ------------------------------------------------------------- Fabric.close

@pytest.mark.timeout(60)
def test_fabric_close_fails_pending_operations_and_releases_everything(backend_name):
    """Regression: there was no Fabric.close(); its thread, epoll set and
    backend context lived until garbage collection."""
    fds0, threads0 = fd_count(), thread_count()
    server_fab = fabric.Fabric(backend_name, **small_options())
    client_fab = fabric.Fabric(backend_name, **small_options())
    pairs = [connect_pair(client_fab, server_fab) for _ in range(8)]
    for c, s in pairs:
        c.send(b"x" * 100)
        assert s.recv(timeout=10) == b"x" * 100
    lst = server_fab.listen()
    outcomes = []

    def blocked(call):
        try:
            call()
            outcomes.append("returned")
        except fabric.ConnectionClosed:
            outcomes.append("closed")
        except BaseException as e:   # noqa: BLE001 - reported below
            outcomes.append(repr(e))

    threads = [threading.Thread(target=blocked, args=(s.recv,)) for _, s in pairs[:4]]
    threads.append(threading.Thread(target=blocked, args=(lst.accept,)))
    threads.append(threading.Thread(target=blocked, args=(lambda: pairs[5][1].send(bytes(4 << 20)),)))
    for t in threads:
        t.start()
    time.sleep(0.3)
    server_fab.close()
    for t in threads:
        t.join(10)
    assert outcomes == ["closed"] * len(threads), outcomes
    assert server_fab.closed and all(s.closed for _, s in pairs) and lst.closed
    server_fab.close()                     # idempotent
    with pytest.raises(fabric.FabricError):
        server_fab.listen()
    with pytest.raises(fabric.FabricError):
        pairs[0][1].send(b"late")
    with pytest.raises(fabric.FabricError):
        _ = lst.address
    # the survivors learn it (CLOSE was sent) and can be closed too
    for c, _ in pairs:
        with pytest.raises(fabric.ConnectionLost):
            c.recv(timeout=10)
    client_fab.close()
    del pairs, lst, threads
    assert thread_count() == threads0
    assert fd_count() == fds0


@pytest.mark.timeout(60)
def test_closed_connections_hand_their_ucx_endpoints_back(backend_name):
    """Regression: error-mode NONE endpoints (UCX_TLS=sm, and ucx between
    two processes of one host) were closed with UCP_EP_CLOSE_FLAG_FORCE,
    which UCX refuses for that mode (INVALID_PARAM): every closed connection
    left its UCP endpoint behind until the Fabric went."""
    if backend_name != "ucx":
        pytest.skip("UCP endpoints exist on the ucx fabric only")
    server_fab = fabric.Fabric(backend_name, **small_options())
    client_fab = fabric.Fabric(backend_name, **small_options())
    for round_ in range(3):
        pairs = [connect_pair(client_fab, server_fab) for _ in range(10)]
        for c, s in pairs:
            c.send(b"x" * 100)
            assert s.recv(timeout=10) == b"x" * 100
        assert server_fab._worker.domain.endpoints == (10, 0)
        for c, s in pairs:
            c.close()
            s.close()
        # (a forced close may complete in UCX's next progress)
        deadline = time.monotonic() + 10
        while (any(f._worker.domain.endpoints != (0, 0) for f in (client_fab, server_fab))
               and time.monotonic() < deadline):
            time.sleep(0.01)
        for fab in (client_fab, server_fab):
            assert fab._worker.domain.endpoints == (0, 0), (round_, backend_name)
    client_fab.close()
    server_fab.close()


@pytest.mark.timeout(60)
def test_fabric_close_flushes_queued_sends_first(backend_name):
    a = fabric.Fabric(backend_name, **small_options())
    b = fabric.Fabric(backend_name, **small_options())
    client, server = connect_pair(a, b)
    for i in range(200):                   # more than credits: most wait in the queue
        client.isend(b"%d" % i)
    a.close()
    assert [bytes(server.recv(timeout=10)) for _ in range(200)] == [b"%d" % i for i in range(200)]
    with pytest.raises(fabric.ConnectionClosed):
        server.recv(timeout=10)
    b.close()


@pytest.mark.timeout(60)
def test_fabric_context_managers(backend_name):
    fds0, threads0 = fd_count(), thread_count()
    with fabric.Fabric(backend_name, **small_options()) as a, \
            fabric.Fabric(backend_name, **small_options()) as b:
        client, server = connect_pair(a, b)
        client.send(b"with")
        assert server.recv(timeout=10) == b"with"
    assert a.closed and b.closed and client.closed and server.closed

    async def main():
        async with fabric.Fabric(backend_name, **small_options()) as c, \
                fabric.Fabric(backend_name, **small_options()) as d:
            lst = d.listen()
            accepting = asyncio.ensure_future(lst.aaccept(timeout=10))
            ep = await c.aconnect(lst.address, timeout=10)
            peer = await accepting
            await ep.asend(b"async with")
            assert await peer.arecv(timeout=10) == b"async with"
        return c, d, ep, peer
    c, d, ep, peer = asyncio.run(asyncio.wait_for(main(), 30))
    assert c.closed and d.closed and ep.closed and peer.closed
    del client, server, ep, peer
    assert thread_count() == threads0
    assert fd_count() == fds0


@pytest.mark.timeout(60)
def test_unclosed_objects_give_resource_warnings(backend_name):
    import gc
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        a = fabric.Fabric(backend_name, **small_options())
        client, server = connect_pair(a)
        lst = a.listen()
        del client, server, lst, a
        gc.collect()
    texts = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert any("fabric.Endpoint" in t for t in texts), texts
    assert any("fabric.Listener" in t for t in texts), texts
    assert any("fabric.Fabric" in t for t in texts), texts


@pytest.mark.timeout(120)
def test_the_cycle_collector_frees_a_busy_fabric_safely(backend_name):
    # Fabrics in reference cycles through their Worker (as tracebacks, event
    # loops and callbacks make them), collected with endpoints open and the
    # progress thread running. The collector used to clear the Worker first,
    # releasing its UCX worker under the progress thread: UCX read closed
    # descriptors, then the heap was corrupted (a crash later, anywhere).
    result = run_script("""
        import gc, sys, warnings, fabric
        warnings.simplefilter("ignore", ResourceWarning)
        for i in range(20):
            a, b = fabric.Fabric(sys.argv[1]), fabric.Fabric(sys.argv[1])
            lst = b.listen("127.0.0.1:0")
            ep = a.connect(lst.address, timeout=10)
            peer = lst.accept(timeout=10)
            ep.send(b"x" * 100000)
            assert len(peer.recv(timeout=10)) == 100000
            for f in (a, b):
                f._worker.aio_waiters = [f._worker, f]
            del a, b, lst, ep, peer
            gc.collect()
        print("done")
    """, backend_name, timeout=100)
    assert result.returncode == 0 and result.stdout.strip() == "done", (result.returncode, result.stderr[-3000:])
    assert "Bad file descriptor" not in result.stderr and "ERROR" not in result.stderr, result.stderr[-3000:]


# -------------------------------------------------------------------- fork

@pytest.mark.timeout(60)
def test_forked_child_gets_a_clear_error_and_can_make_its_own_fabric(backend_name):
    """A forked child cannot use what it inherited (clear FabricError, the
    parent keeps working) and may create a Fabric of its own: of the same
    backend, except ucx (UCX's helper threads do not survive a fork: a
    clear BackendUnavailable instead), and tcp in every case."""
    code = """
    import os, sys, fabric
    fab = fabric.Fabric(sys.argv[1])
    lst = fab.listen()
    address = lst.address
    ep = fab.connect(address, timeout=10); peer = lst.accept(timeout=10)
    report_fab = fabric.Fabric("tcp")
    report_lst = report_fab.listen()
    report_address = report_lst.address
    pid = os.fork()
    if pid == 0:
        import faulthandler
        faulthandler.dump_traceback_later(15, exit=True)     # a hang says where
        problems = []
        for what, call in [("send", lambda: ep.send(b"child")), ("recv", lambda: peer.recv(timeout=0)),
                           ("listen", fab.listen), ("accept", lambda: lst.accept(timeout=0)),
                           ("address", lambda: lst.address), ("close", fab.close)]:
            try:
                call()
                problems.append(what + " worked in the child")
            except fabric.FabricError as e:
                if "another process" not in str(e):
                    problems.append(what + ": " + str(e))
        try:
            own = fabric.Fabric(sys.argv[1])
            mine = own.connect(address, timeout=10)
            mine.send(b"own fabric works")
            mine.close()
            own.close()
        except fabric.BackendUnavailable as e:
            if sys.argv[1] != "ucx" or "fork" not in str(e):
                problems.append("own fabric: " + str(e))
        rep = fabric.Fabric("tcp")
        out = rep.connect(report_address, timeout=10)
        out.send(repr(problems).encode())
        out.close()
        rep.close()
        os._exit(0)
    if sys.argv[1] != "ucx":
        conn = lst.accept(timeout=20)
        assert conn.recv(timeout=20) == b"own fabric works"
    report = report_lst.accept(timeout=20).recv(timeout=20)
    assert bytes(report) == b"[]", bytes(report)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    ep.send(b"parent still fine"); assert peer.recv(timeout=10) == b"parent still fine"
    fab.close()
    report_fab.close()
    print("ok")
    """
    r = run_script(code, backend_name, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.stdout, r.stderr)


# ------------------------------------------------- no method crashes, ever

AUDIT = r"""
import asyncio, json, sys, fabric
from fabric.protocol.engine import Worker

OPTS = dict(eager_limit=4096, chunk_size=16384, credits=8, send_buffers=4, recv_budget=1 << 20)
ALLOWED = (fabric.FabricError, TypeError, ValueError, BufferError)
report = {}

def probe(state, obj, calls):
    for name, call in calls:
        try:
            call(obj)
            outcome = "ok"
        except ALLOWED as e:
            outcome = type(e).__name__
        except BaseException as e:
            outcome = "BAD " + repr(e)
        report[f"{state}.{name}"] = outcome

def run_async(coro):
    return asyncio.run(asyncio.wait_for(coro, 5))

EP_CALLS = [
    ("local_address", lambda e: e.local_address), ("peer_address", lambda e: e.peer_address),
    ("closed", lambda e: e.closed), ("eager_limit", lambda e: e.eager_limit), ("stats", lambda e: e.stats()),
    ("protocol_for_1M", lambda e: e.protocol_for(1 << 20)), ("protocol_for_0", lambda e: e.protocol_for(0)),
    ("protocol_for_neg", lambda e: e.protocol_for(-1)),
    ("send", lambda e: e.send(b"x")), ("send_big", lambda e: e.send(bytes(100000))),
    ("isend", lambda e: e.isend(b"x").wait(1)),
    ("recv", lambda e: e.recv(timeout=0)), ("recv_into", lambda e: e.recv_into(bytearray(8), timeout=0)),
    ("recv_into_ro", lambda e: e.recv_into(b"readonly", timeout=0)),
    ("recv_bad_timeout", lambda e: e.recv(timeout=-1)), ("recv_nan_timeout", lambda e: e.recv(timeout=float("nan"))),
    ("_poll", lambda e: e._poll()), ("_try_recv", lambda e: e._try_recv()),
    ("_try_recv_buf", lambda e: e._try_recv(bytearray(8))), ("_cancel_recv", lambda e: e._cancel_recv()),
    ("_state", lambda e: e._state()), ("_failure", lambda e: e._failure()),
    ("_close_begin", lambda e: e._close_begin()), ("_drained", lambda e: e._drained()),
    ("key", lambda e: e.key), ("worker", lambda e: e.worker), ("repr", repr),
    ("asend", lambda e: run_async(e.asend(b"x", timeout=0.1))),
    ("arecv", lambda e: run_async(e.arecv(timeout=0.05))),
    ("arecv_into", lambda e: run_async(e.arecv_into(bytearray(8), timeout=0.05))),
    ("aclose", lambda e: run_async(e.aclose(linger=0))),
    ("close", lambda e: e.close()), ("close_again", lambda e: e.close(linger=0)),
    ("send_after_close", lambda e: e.send(b"x")), ("stats_after_close", lambda e: e.stats()),
    ("protocol_after_close", lambda e: e.protocol_for(1 << 20)), ("repr_after_close", repr),
]
LST_CALLS = [
    ("address", lambda l: l.address), ("closed", lambda l: l.closed), ("key", lambda l: l.key),
    ("accept", lambda l: l.accept(timeout=0)), ("_try_accept", lambda l: l._try_accept()),
    ("aaccept", lambda l: run_async(l.aaccept(timeout=0.05))), ("repr", repr),
    ("close", lambda l: l.close()), ("close_again", lambda l: l.close()),
    ("accept_after_close", lambda l: l.accept(timeout=0)), ("address_after_close", lambda l: l.address),
]
REQ_CALLS = [
    ("done", lambda r: r.done()), ("wait", lambda r: r.wait(0)), ("error", lambda r: r.error),
    ("endpoint", lambda r: r.endpoint), ("nbytes", lambda r: r.nbytes), ("repr", repr),
    ("await", lambda r: run_async(r.await_done(timeout=0.05))),
]
MSG_CALLS = [
    ("len", len), ("bytes", bytes), ("memoryview", lambda m: memoryview(m).tobytes()),
    ("tobytes", lambda m: m.tobytes()), ("getitem", lambda m: m[0:1]), ("eq", lambda m: m == b""),
    ("repr", repr), ("hash", hash),
]
WORKER_CALLS = [
    ("fileno", lambda w: w.fileno()), ("notify_fileno", lambda w: w.notify_fileno()),
    ("arm", lambda w: w.arm()), ("progress", lambda w: w.progress()), ("poll_events", lambda w: w.poll_events()),
    ("loop_watch", lambda w: (w.loop_watch(True), w.loop_watch(False))),
    ("drain_notify", lambda w: w.drain_notify()), ("closed", lambda w: w.closed),
    ("_close_begin", lambda w: w._close_begin()), ("_all_drained", lambda w: w._all_drained()),
    ("listen", lambda w: w.listen("127.0.0.1", 0).close()),
    ("connect_refused", lambda w: w.connect("127.0.0.1", 1, 1)),
    ("_attach_connected_bad_fd", lambda w: w._attach_connected(-1)),
]
FABRIC_CALLS = [
    ("listen", lambda f: f.listen().close()), ("connect_bad", lambda f: f.connect("nonsense")),
    ("progress", lambda f: f.progress()), ("repr", repr), ("closed", lambda f: f.closed),
    ("listen_stream", lambda f: f.listen_stream().close()),
    ("aconnect_refused", lambda f: run_async(f.aconnect("127.0.0.1:1", timeout=1))),
    ("close", lambda f: f.close()), ("close_again", lambda f: f.close()),
    ("listen_after_close", lambda f: f.listen()), ("connect_after_close", lambda f: f.connect("127.0.0.1:1")),
    ("progress_after_close", lambda f: f.progress()),
    ("aclose_after_close", lambda f: run_async(f.aclose())),
]

backend = sys.argv[1]

def pair(fab_a, fab_b):
    lst = fab_b.listen()
    c = fab_a.connect(lst.address, timeout=10)
    s = lst.accept(timeout=10)
    lst.close()
    return c, s

# never built: constructors refuse, and __new__ gives inert objects
for cls in (fabric.Endpoint, fabric.Listener, fabric.Request, fabric.Message):
    probe("ctor", cls, [(cls.__name__, lambda c: c())])
probe("unbuilt_ep", fabric.Endpoint.__new__(fabric.Endpoint), EP_CALLS)
probe("unbuilt_lst", fabric.Listener.__new__(fabric.Listener), LST_CALLS)
probe("unbuilt_req", fabric.Request.__new__(fabric.Request), REQ_CALLS)
probe("unbuilt_msg", fabric.Message.__new__(fabric.Message), MSG_CALLS)
probe("unbuilt_worker", Worker, [("new", lambda W: W.__new__(W))])

fa, fb = fabric.Fabric(backend, **OPTS), fabric.Fabric(backend, **OPTS)
# open endpoint, then the same calls after its own close
c, s = pair(fa, fb)
probe("open_ep", c, EP_CALLS)
# the peer closed (CLOSE received)
c, s = pair(fa, fb)
c.close()
probe("peer_closed_ep", s, EP_CALLS)
# the peer vanished (its Fabric closed without waiting: connection reset)
fc = fabric.Fabric(backend, **OPTS)
c, s = pair(fc, fb)
req = s.isend(bytes(200000))
fc.close(linger=0)
probe("failed_ep", s, EP_CALLS)
probe("failed_req", req, REQ_CALLS)
# a message from a closed endpoint
c, s = pair(fa, fb)
c.send(b"message")
m = s.recv(timeout=10)
c.close(); s.close()
probe("msg", m, MSG_CALLS)
# listener open, closed
probe("lst", fb.listen(), LST_CALLS)
# a whole closed Fabric and its children
c, s = pair(fa, fb)
req = c.isend(bytes(300000))
lst = fa.listen()
fa.close(linger=0)
probe("closed_fabric_ep", c, EP_CALLS)
probe("closed_fabric_req", req, REQ_CALLS)
probe("closed_fabric_lst", lst, LST_CALLS)
probe("closed_fabric_worker", fa._worker, WORKER_CALLS)
probe("closed_fabric", fa, FABRIC_CALLS)
probe("open_worker", fb._worker, WORKER_CALLS)
probe("open_fabric", fb, FABRIC_CALLS)
print(json.dumps(report))
"""


@pytest.mark.timeout(120)
def test_no_public_method_crashes_in_any_state(backend_name):
    """Regression: Endpoint.protocol_for() after the peer closed dereferenced
    a NULL channel. Every public method and property, on objects open,
    closed, failed, in a closed Fabric or never built, returns or raises a
    fabric error (or TypeError/ValueError/BufferError for bad arguments)."""
    r = run_script(AUDIT, backend_name, timeout=100)
    assert r.returncode == 0, f"the interpreter died ({r.returncode}): {r.stderr[-3000:]}"
    report = json.loads(r.stdout.strip().splitlines()[-1])
    bad = {k: v for k, v in report.items() if v.startswith("BAD")}
    assert not bad, bad
    # a sample of the outcomes that must be errors
    assert report["ctor.Endpoint"] == "TypeError"
    assert report["peer_closed_ep.protocol_for_1M"] == "ok"
    assert report["open_ep.send_after_close"] == "ConnectionClosed"
    assert report["closed_fabric.listen_after_close"] == "ConnectionClosed"
    assert report["closed_fabric_ep.send"] == "ConnectionClosed"
    assert report["unbuilt_ep.send"] == "FabricError"
