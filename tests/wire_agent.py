"""The other host's half of the wire suite (tools/softroce.py --guests 2).

    python tests/wire_agent.py serve          # in one guest: wait for orders
    python tests/wire_agent.py quit           # from the other: end it

The tests run in one guest; whatever they need on the other host (a peer
process of tests/peers.py, a Dask worker, `tc` on its NIC) they ask this agent
for over a plain TCP connection to FABRIC_PEER_ADDR:AGENT_PORT. Each request
is one JSON line on its own connection:

- {"op": "spawn", "argv": [...], "env": {...}}: start a process (cwd: the
  repository). The agent answers {"pid": N}, then one {"out": line} per line
  the process prints and {"exit": code, "err": stderr} when it ends. The
  connection carries {"signal": N} the other way; closing it kills the
  process, so a test that dies leaves nothing running.
- {"op": "run", "argv": [...], "timeout": s}: run to completion; answers
  {"exit": code, "out": ..., "err": ...} (timeout: exit 124).
- {"op": "quit"}: the agent answers {"ok": true} and exits 0.

The environment a spawned process gets is the agent's, without its FABRIC_*
and UCX_* variables, plus the request's env (the test's FABRIC_* and UCX_*
settings), plus this host's own FABRIC_GUEST_ADDR / FABRIC_PEER_ADDR and
FABRIC_TEST_HOST (the address tests/peers.py listens on).
"""
from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time

AGENT_PORT = 7700
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OWN_KEYS = ("FABRIC_GUEST_ADDR", "FABRIC_PEER_ADDR", "FABRIC_IN_SOFTROCE_GUEST")


def send_json(conn: socket.socket, lock: threading.Lock, doc: dict) -> None:
    data = (json.dumps(doc) + "\n").encode()
    with lock:
        try:
            conn.sendall(data)
        except OSError:
            pass                      # the test went away; the process is killed below


def child_env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FABRIC_", "UCX_"))}
    env.update({k: str(v) for k, v in extra.items() if k not in OWN_KEYS})
    env.update({k: os.environ[k] for k in OWN_KEYS if k in os.environ})
    env["FABRIC_TEST_HOST"] = os.environ.get("FABRIC_GUEST_ADDR", "127.0.0.1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def spawn(conn: socket.socket, reader, req: dict) -> None:
    lock = threading.Lock()
    proc = subprocess.Popen(req["argv"], cwd=ROOT, env=child_env(req.get("env", {})),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    send_json(conn, lock, {"pid": proc.pid})
    err = bytearray()
    drain = threading.Thread(target=lambda: err.extend(proc.stderr.read()), daemon=True)
    drain.start()

    def orders():
        # signals from the test; its end (EOF or a reset) kills the process
        for line in reader:
            try:
                sig = int(json.loads(line)["signal"])
            except (ValueError, KeyError, TypeError):
                continue
            if proc.poll() is None:
                proc.send_signal(sig)
        if proc.poll() is None:
            proc.kill()

    threading.Thread(target=orders, daemon=True).start()
    for line in proc.stdout:
        send_json(conn, lock, {"out": line.decode(errors="replace").rstrip("\n")})
    code = proc.wait()
    drain.join(10)
    send_json(conn, lock, {"exit": code, "err": err.decode(errors="replace")[-20000:]})


def run(conn: socket.socket, req: dict) -> None:
    try:
        r = subprocess.run(req["argv"], cwd=ROOT, env=child_env(req.get("env", {})), capture_output=True,
                           text=True, timeout=float(req.get("timeout", 60)), stdin=subprocess.DEVNULL)
        doc = {"exit": r.returncode, "out": r.stdout, "err": r.stderr}
    except subprocess.TimeoutExpired as e:
        doc = {"exit": 124, "out": str(e.stdout or ""), "err": str(e.stderr or "")}
    except OSError as e:
        doc = {"exit": 127, "out": "", "err": str(e)}
    send_json(conn, threading.Lock(), doc)


def serve_one(conn: socket.socket, done: threading.Event) -> None:
    with conn:
        reader = conn.makefile("rb")
        line = reader.readline()
        try:
            req = json.loads(line)
            op = req["op"]
        except (ValueError, KeyError, TypeError):
            return
        if op == "spawn":
            spawn(conn, reader, req)
        elif op == "run":
            run(conn, req)
        elif op == "quit":
            send_json(conn, threading.Lock(), {"ok": True})
            done.set()


def serve() -> int:
    host = os.environ.get("FABRIC_GUEST_ADDR", "127.0.0.1")
    lst = socket.create_server((host, int(os.environ.get("FABRIC_WIRE_AGENT_PORT", AGENT_PORT))))
    lst.settimeout(0.5)
    done = threading.Event()
    print(f"wire agent on {host}:{lst.getsockname()[1]}", flush=True)
    while not done.is_set():
        try:
            conn, _ = lst.accept()
        except socket.timeout:
            continue
        conn.settimeout(None)
        threading.Thread(target=serve_one, args=(conn, done), daemon=True).start()
    print("wire agent done", flush=True)
    return 0


def quit_agent() -> int:
    """Tell the agent on FABRIC_PEER_ADDR to end (0 once it said so)."""
    host = os.environ["FABRIC_PEER_ADDR"]
    port = int(os.environ.get("FABRIC_WIRE_AGENT_PORT", AGENT_PORT))
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(b'{"op": "quit"}\n')
        return 0 if json.loads(s.makefile("rb").readline()).get("ok") else 1


# -- the tests' side -------------------------------------------------------

def agent_address() -> tuple[str, int] | None:
    """(host, port) of the agent when the tests run across the wire
    (FABRIC_WIRE_AGENT=host[:port]), else None."""
    spec = os.environ.get("FABRIC_WIRE_AGENT", "")
    if not spec:
        return None
    host, _, port = spec.rpartition(":") if ":" in spec else (spec, "", str(AGENT_PORT))
    return host, int(port)


def forwarded_env(extra: dict | None = None) -> dict:
    """The settings a peer on the other host must share with this test."""
    env = {k: v for k, v in os.environ.items() if k.startswith(("FABRIC_", "UCX_"))}
    env.update(extra or {})
    return env


def _connect(address: tuple[str, int]) -> socket.socket:
    """A connection to the agent; it may still be starting (the other guest
    boots in parallel), so refusals are retried for two minutes."""
    deadline = time.monotonic() + 120
    while True:
        try:
            return socket.create_connection(address, timeout=30)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


class _Stream:
    """proc.stdout / proc.stderr of a RemoteProcess."""

    def __init__(self, proc: "RemoteProcess", err: bool):
        self.proc, self.err = proc, err

    def readline(self) -> str:
        return "" if self.err else self.proc.read_line(None) + "\n"

    def read(self) -> str:
        if self.err:
            self.proc.wait(30)
            return self.proc.err
        return self.proc.communicate(30)[0]

    def close(self) -> None:
        pass


class RemoteProcess:
    """A process the agent started on the other host, shaped like the
    subprocess.Popen the tests use: pid, poll, wait, kill, send_signal,
    returncode, communicate, stdout.readline (text)."""

    def __init__(self, argv: list[str], env: dict | None = None, address: tuple[str, int] | None = None):
        address = address or agent_address()
        if address is None:
            raise RuntimeError("FABRIC_WIRE_AGENT is not set: no agent on another host")
        self.sock = _connect(address)
        self.sock.settimeout(None)
        self.sock.sendall((json.dumps({"op": "spawn", "argv": argv, "env": forwarded_env(env)}) + "\n").encode())
        reader = self.sock.makefile("rb")
        self.pid = json.loads(reader.readline())["pid"]
        self.returncode: int | None = None
        self.err = ""
        self._lines: queue.Queue = queue.Queue()
        self._exited = threading.Event()
        self.stdout, self.stderr = _Stream(self, False), _Stream(self, True)
        threading.Thread(target=self._relay, args=(reader,), daemon=True).start()

    def _relay(self, reader) -> None:
        try:
            for line in reader:
                doc = json.loads(line)
                if "out" in doc:
                    self._lines.put(doc["out"])
                elif "exit" in doc:
                    self.returncode, self.err = doc["exit"], doc["err"]
                    break
        except (OSError, ValueError):
            pass
        if self.returncode is None:
            self.returncode, self.err = -1, "the wire agent's connection ended"
        self._exited.set()
        self._lines.put(None)

    def read_line(self, timeout: float | None) -> str:
        """The next line the process printed; "" once it ended or none came in time."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            return ""
        if line is None:
            self._lines.put(None)          # every later call sees the end too
            return ""
        return line

    def poll(self) -> int | None:
        return self.returncode if self._exited.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"remote pid {self.pid}", timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        try:
            self.sock.sendall((json.dumps({"signal": int(sig)}) + "\n").encode())
        except OSError:
            pass

    def kill(self) -> None:
        self.send_signal(9)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        lines = []
        while True:
            try:
                line = self._lines.get_nowait()
            except queue.Empty:
                break
            if line is None:
                self._lines.put(None)
                break
            lines.append(line)
        return "".join(line + "\n" for line in lines), self.err

    def close(self) -> None:
        if self.poll() is None:
            self.kill()
            self._exited.wait(30)
        self.sock.close()


def run_remote(argv: list[str], timeout: float = 60, address: tuple[str, int] | None = None) -> tuple[int, str, str]:
    """Run argv to completion on the other host: (exit code, stdout, stderr)."""
    address = address or agent_address()
    with _connect(address) as s:
        s.settimeout(timeout + 30)
        s.sendall((json.dumps({"op": "run", "argv": argv, "timeout": timeout}) + "\n").encode())
        doc = json.loads(s.makefile("rb").readline())
    return doc["exit"], doc["out"], doc["err"]


if __name__ == "__main__":
    sys.exit({"serve": serve, "quit": quit_agent}[sys.argv[1]]())
