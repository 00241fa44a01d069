"""What fabric-perf's measuring commands share (the CLI, the tuner, bench/):
the loopback peer process, CPU pinning, and the machine and version facts
each result records. Imports nothing else of fabric.perf."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

EAGER_MAX = 1 << 20             # --protocol eager: largest eager message (receive buffers are this big)


def pin_cpus() -> tuple[set, set] | None:
    """(this process's CPUs, the peer's CPUs) when there are at least two:
    the scheduler otherwise places client and peer on the same or different
    cores from one process pair to the next, which moves small-message
    round trips by 30% and swamps the differences being measured."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    return {cpus[0]}, {cpus[1]}


def pin_self():
    pins = pin_cpus()
    if pins:
        os.sched_setaffinity(0, pins[0])


def spawn_peer(backend: str, knobs: dict, env: dict | None = None, pin: bool = False):
    """A server process on loopback with the same knobs; returns (proc, address)."""
    from fabric.options import env_name
    cmd = [sys.executable, "-m", "fabric.perf", "--server", "127.0.0.1:0", "--backend", backend]
    env = dict(os.environ if env is None else env)
    env.update({env_name(k): str(v) for k, v in knobs.items()})    # every knob, not only those with flags
    pins = pin_cpus() if pin else None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env,
                            preexec_fn=(lambda: os.sched_setaffinity(0, pins[1])) if pins else None)
    address = proc.stdout.readline().strip()
    if not address:
        proc.wait()
        raise SystemExit(f"fabric-perf: the loopback peer ({backend}) did not start")
    return proc, address


def machine_info() -> dict:
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "machine": platform.machine()}


def versions() -> dict:
    import fabric
    return {"fabric": fabric.__version__, "python": platform.python_version(),
            "backends": {name: {"available": ok, "detail": why}
                         for name, (ok, why) in fabric.available_backends().items()}}
