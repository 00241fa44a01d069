"""Reproduce a stall of fabric.grpc.aio over fabric+tcp seen in bench runs
(open, session 5): about one client in 10-15 stops in its first few thousand
unary calls. The server's engine reports the connection "closed by peer" (it
received a CLOSE frame) while the client's endpoint is open and still
sending; with coalescing off too. Each round starts a bench server
(bench/grpc_aio_compare.py --serve aio+tcp) and a client; on a stall it prints
both sides' state (the server's through SIGUSR1) and stops.

    python tools/grpc_aio_stall.py
"""
import subprocess, sys, os
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for i in range(25):
    srv = subprocess.Popen([sys.executable, f"{ROOT}/bench/grpc_aio_compare.py", "--serve", "aio+tcp"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(os.path.join(ROOT, "build", "stall-server.log"), "w"), text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    port = int(srv.stdout.readline())
    code = f"""
import sys, asyncio, json, time
sys.path.insert(0, '{ROOT}/bench')
import grpc_aio_compare as g
import fabric.grpc.aio as faio
made = []
orig = faio.insecure_channel
def rec(*a, **k):
    ch = orig(*a, **k); made.append(ch); return ch
faio.insecure_channel = rec
stage = []
async def main():
    t = asyncio.ensure_future(g.client('aio+tcp', {port}))
    done, _ = await asyncio.wait([t], timeout=40)
    if t in done:
        return t.result()
    ch = made[0]; c = ch._conn
    print("HANG; calls", len(ch._calls), "conn dead", c.dead, "h2 calls", len(c.calls), "outbound open", c.h2.open_outbound_streams,
          "remote max", c.h2.remote_settings.max_concurrent_streams, "conn window", c.h2.outbound_flow_control_window,
          "window waiters", len(c.window_signal.waiters), "tq", len(c.transport.queue), c.transport.queued, c.transport.room.is_set(), c.transport.task.done(), file=sys.stderr)
    for sid, s in list(c.calls.items())[:5]:
        print(" stream", sid, "ended", s.ended, "msgs", len(s.messages), "headers", s.headers is not None, "reset", s.reset_code, "fail", s.failure, "localclosed", s.local_closed, "window", c.h2.local_flow_control_window(sid) if sid in c.h2.streams else None, "waiters", len(s.signal.waiters), file=sys.stderr)
    ep = c.transport.stream.endpoint
    print("EP stats", ep.stats(), file=sys.stderr)
    st = ep.worker._debug_state()
    print("WORKER", {{k: v for k, v in st.items() if k != "endpoints"}}, file=sys.stderr)
    print("EPS", st["endpoints"], file=sys.stderr)
    for task in list(asyncio.all_tasks())[:0]:
        task.print_stack(limit=6, file=sys.stderr)
    sys.exit(3)
print(json.dumps(asyncio.run(main())))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    print(i, out.returncode, out.stdout.strip()[-200:], flush=True)
    if out.returncode != 0:
        import signal, time
        srv.send_signal(signal.SIGUSR1); time.sleep(1)
        print("SERVER:", "\n".join(l for l in open(os.path.join(ROOT, "build", "stall-server.log")).read().splitlines() if not l.startswith("I1201"))[-5000:])
        print("\n".join(l for l in out.stderr.splitlines() if not l.startswith("I1201"))[-6000:], flush=True)
        srv.stdin.close(); srv.wait(10)
        break
    srv.stdin.close(); srv.wait(10)
