"""A user's install: `pip wheel` of this checkout with build isolation (the
build backend brings the libucx wheel into the build environment), then the
wheel in fresh virtual environments, with the [ucx] extra and without. With
it the ucx backend works (a round trip over UCX_TLS=tcp); without it the ucx
backend says what to install; tcp works in both; nothing goes to stdout but
what the program prints."""
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from conftest import unused_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = [pytest.mark.timeout(900)]

PROGRAM = r"""
import json, sys, fabric
avail = fabric.available_backends()
out = {"backends": {k: list(v) for k, v in avail.items()}}
for name in ("tcp", "ucx"):
    if not avail[name][0]:
        continue
    fab = fabric.Fabric(name)
    lst = fab.listen("127.0.0.1:0")
    ep = fab.connect(lst.address, timeout=20)
    peer = lst.accept(timeout=20)
    ep.send(b"x" * 100000)
    out[name] = len(peer.recv(timeout=20))
    fab.close()
print(json.dumps(out))
"""


def _run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=800, **kw)
    if r.returncode != 0:
        raise AssertionError(f"{cmd} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


@pytest.fixture(scope="module")
def wheel():
    if shutil.which("git") is None:
        pytest.skip("needs git to copy the checkout")
    work = tempfile.mkdtemp(prefix="fabric-install-")
    src = os.path.join(work, "src")
    # the committed tree plus uncommitted changes, without build products
    _run(["git", "-C", ROOT, "worktree", "add", "--detach", "-f", src, "HEAD"])
    try:
        diff = _run(["git", "-C", ROOT, "diff", "HEAD", "--binary"]).stdout
        if diff.strip():
            subprocess.run(["git", "-C", src, "apply", "--whitespace=nowarn", "-"], input=diff, text=True,
                           check=True, capture_output=True)
        out = os.path.join(work, "dist")
        env = {k: v for k, v in os.environ.items() if not k.startswith("FABRIC_")}
        _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", out, src], env=env)
        wheels = [os.path.join(out, f) for f in os.listdir(out) if f.endswith(".whl")]
        assert len(wheels) == 1, wheels
        yield work, wheels[0]
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", src], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


def _venv_with(work, name, *requirements):
    venv = os.path.join(work, name)
    _run([sys.executable, "-m", "venv", venv])
    python = os.path.join(venv, "bin", "python")
    _run([python, "-m", "pip", "install", "-q", *requirements])
    return python


def test_the_wheel_with_the_ucx_extra_runs_ucx(wheel):
    work, path = wheel
    python = _venv_with(work, "with-ucx", f"{path}[ucx]")
    env = dict(os.environ, UCX_TLS="tcp")
    r = _run([python, "-c", PROGRAM], env=env, cwd=work)
    import json
    out = json.loads(r.stdout)                    # only the program's line: nothing else on stdout
    assert out["tcp"] == 100000
    assert out["backends"]["ucx"][0], out["backends"]["ucx"]
    assert out["ucx"] == 100000


def test_the_wheel_without_the_extra_says_what_ucx_needs(wheel):
    work, path = wheel
    python = _venv_with(work, "plain", path)
    r = _run([python, "-c", PROGRAM], cwd=work)
    import json
    out = json.loads(r.stdout)
    assert out["tcp"] == 100000
    ok, reason = out["backends"]["ucx"]
    # no UCX at all, or (where Debian's libucx is installed) a UCX of another version
    assert not ok and "fabric-transport[ucx]" in reason, reason


DASK_PROGRAM = r"""
import json
from importlib.metadata import entry_points
names = sorted(e.name for e in entry_points(group="distributed.comm.backends"))
out = {"schemes": names}
try:
    from distributed import Client, LocalCluster
except ImportError:
    out["cluster"] = None
else:
    with LocalCluster(protocol="fabric+tcp://", n_workers=1, processes=False, dashboard_address=None,
                      silence_logs=40) as cluster, Client(cluster) as client:
        out["cluster"] = client.submit(sum, [1, 2, 3]).result()
        out["address"] = cluster.scheduler_address.split("://")[0]
print(json.dumps(out))
"""


def test_the_wheel_names_its_dask_schemes_and_the_dask_extra_runs_a_cluster(wheel):
    """Installed from the wheel, Dask finds fabric's schemes by entry points
    alone; with [dask] a cluster runs on fabric+tcp://."""
    import json
    work, path = wheel
    plain = _venv_with(work, "plain-dask", path)
    out = json.loads(_run([plain, "-c", DASK_PROGRAM], cwd=work).stdout)
    assert out == {"schemes": ["fabric", "fabric+tcp", "fabric+ucx", "fabric+verbs"], "cluster": None}
    with_dask = _venv_with(work, "with-dask", f"{path}[dask]")
    out = json.loads(_run([with_dask, "-c", DASK_PROGRAM], cwd=work).stdout)
    assert out["cluster"] == 6 and out["address"] == "fabric+tcp", out


TORCH_PROGRAM = r"""
import datetime, json, os, sys
import torch, torch.distributed as dist
import fabric.torch  # registers "fabric"
rank = int(os.environ["RANK"])
dist.init_process_group("fabric", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
t = torch.full((300000,), float(rank + 1))
dist.all_reduce(t)
out = {"backend": dist.get_backend(), "sum": float(t[0]), "torch": torch.__version__}
dist.destroy_process_group()
if rank == 0:
    print(json.dumps(out))
"""


def test_the_torch_extra_installs_a_tested_torch_and_runs_a_group(wheel):
    """With [torch], pip resolves a torch the backend is tested with (here the
    local CPU wheel) and two ranks all-reduce over init_process_group("fabric")."""
    import json
    local = "/opt/wheels"
    if not (os.path.isdir(local) and any(f.startswith("torch-2.13") for f in os.listdir(local))):
        pytest.skip("no local CPU wheel of torch 2.13 (/opt/wheels): PyPI's default torch is a 3 GB CUDA download")
    work, path = wheel
    python = _venv_with(work, "with-torch", f"{path}[torch]")
    port = unused_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), FABRIC_BACKEND="tcp",
               OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([python, "-c", TORCH_PROGRAM], env=dict(env, RANK=str(r)), cwd=work,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert outs[1][0] == "", outs[1]                  # nothing on stdout but what rank 0 prints
    out = json.loads(outs[0][0])
    assert out == {"backend": "fabric", "sum": 3.0, "torch": out["torch"]} and out["torch"].startswith("2.13"), out
