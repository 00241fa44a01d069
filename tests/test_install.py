"""A user's install. tools/wheel.sh makes the release as a user gets it
(the sdist, then the wheel built from it in an isolated build environment,
which brings the libucx wheel; auditwheel repair; twine check); the wheel
goes into fresh virtual environments, with the [ucx] extra and without. With
it the ucx backend works (a round trip over UCX_TLS=tcp); without it the ucx
backend says what to install; tcp works in both; nothing goes to stdout but
what the program prints. One environment has no compiler at all: the wheel
with [ucx,grpc] installs there, and the examples, `python -m fabric info`
and a smoke subset of the suite run against it, not against this tree."""
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
        pytest.skip("needs git: tools/wheel.sh packs the files git knows")
    work = tempfile.mkdtemp(prefix="fabric-install-")
    try:
        out = os.path.join(work, "dist")
        env = {k: v for k, v in os.environ.items() if not k.startswith("FABRIC_")}
        # FABRIC_INSTALL_TEST_GLIBC=2.28 tests the zig-built manylinux_2_28 wheel instead
        glibc = os.environ.get("FABRIC_INSTALL_TEST_GLIBC")
        r = _run(["bash", os.path.join(ROOT, "tools", "wheel.sh"), *(["--glibc", glibc] if glibc else []), out],
                 env=env)
        path = r.stdout.strip().splitlines()[-1]
        assert os.path.basename(path).startswith("fabric_transport-") and "manylinux" in path, r.stdout
        if glibc:
            assert f"manylinux_{glibc.replace('.', '_')}_" in path, r.stdout
        yield work, path
    finally:
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


COMPILERS = ("cc", "gcc", "g++", "c++", "clang", "clang++", "ld", "x86_64-linux-gnu-gcc", "x86_64-linux-gnu-g++",
             "cython", "cythonize")

# The suite's files that run against the installed wheel: what a user's
# first hour touches (connections on tcp and ucx, asyncio, streams, gRPC,
# the CLI, the examples), a few minutes in all.
SMOKE = ["test_examples.py", "test_info.py", "test_stream.py", "test_endpoint.py",
         "test_asyncio.py::test_async_round_trips_all_protocols", "test_grpc.py"]


def _no_compiler_env(work):
    """PATH with every compiler shadowed by a program that fails loudly, and
    CC/CXX set to false: anything that tries to build fails the install."""
    shadow = os.path.join(work, "no-compiler")
    os.makedirs(shadow, exist_ok=True)
    for name in COMPILERS:
        with open(os.path.join(shadow, name), "w") as f:
            f.write(f"#!/bin/sh\necho 'no compiler here: {name} was called' >&2\nexit 1\n")
        os.chmod(os.path.join(shadow, name), 0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FABRIC_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PATH=shadow + os.pathsep + env.get("PATH", "/usr/bin:/bin"), CC="false", CXX="false",
               LDSHARED="false", PIP_NO_BUILD_ISOLATION="0")
    return env


@pytest.mark.timeout(1500)
def test_the_wheel_installs_without_a_compiler_and_runs_the_examples_and_a_smoke_suite(wheel):
    """A fresh venv where no compiler can run installs the wheel with
    [ucx,grpc] (binaries only), then runs every example, `python -m fabric
    info` and a smoke subset of the suite (copied out of the tree, so the
    `fabric` they import is the installed one)."""
    import json
    work, path = wheel
    env = _no_compiler_env(work)
    assert subprocess.run(["gcc", "--version"], env=env, capture_output=True).returncode != 0
    venv = os.path.join(work, "no-compiler-venv")
    _run([sys.executable, "-m", "venv", venv], env=env)
    python = os.path.join(venv, "bin", "python")
    # what the examples and the smoke tests import besides fabric's own extras
    extra = ["numpy>=1.23", "pytest>=7", "pytest-timeout>=2", "hypothesis>=6", "grpcio-tools>=1.60", "h2>=4.1",
             "hpack>=4",
             "distributed>=2026.7.1,<2026.9"]
    local_torch = [os.path.join("/opt/wheels", f) for f in sorted(os.listdir("/opt/wheels"))
                   if f.startswith("torch-2.13")] if os.path.isdir("/opt/wheels") else []
    _run([python, "-m", "pip", "install", "-q", "--only-binary=:all:", f"{path}[ucx,grpc]", *extra,
          *local_torch], env=env, cwd=work)

    # the installed fabric, not this tree's
    where = _run([python, "-c", "import fabric, json; print(json.dumps([fabric.__file__, fabric.__version__]))"],
                 env=env, cwd=work).stdout
    file, version = json.loads(where)
    assert file.startswith(venv + os.sep), file
    info = _run([python, "-m", "fabric", "info"], env=env, cwd=work).stdout
    assert version in info and "tcp" in info and "ucx" in info, info

    # the suite's smoke subset, and test_examples (every example), from a copy
    copy = os.path.join(work, "suite")
    shutil.copytree(os.path.join(ROOT, "tests"), os.path.join(copy, "tests"),
                    ignore=shutil.ignore_patterns("__pycache__", "fuzz"))
    shutil.copytree(os.path.join(ROOT, "examples"), os.path.join(copy, "examples"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("docs", "README.md"):        # test_examples checks the excerpts the docs show
        src = os.path.join(ROOT, name)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(copy, name), ignore=shutil.ignore_patterns("_build", "__pycache__"))
        elif os.path.exists(src):
            shutil.copy(src, copy)
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), copy)    # pytest's settings (timeouts, markers)
    r = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs",
                        *[os.path.join("tests", t) for t in SMOKE]],
                       env=dict(env, FABRIC_TEST_BACKENDS="tcp,ucx-tcp"), cwd=copy, capture_output=True, text=True, timeout=1200)
    failures = r.stdout[r.stdout.find("= FAILURES ="):][:6000] if "= FAILURES =" in r.stdout else ""
    tail = "\n".join(line for line in r.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))) \
        + "\n" + failures + r.stdout[-1500:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    assert " passed" in r.stdout and " failed" not in r.stdout, tail
    # every example ran (none skipped for a package the wheel's extras should bring)
    skipped = [line for line in r.stdout.splitlines() if line.startswith("SKIPPED") and "test_examples" in line]
    assert not [s for s in skipped if "not installed" in s or "needs" in s], skipped
    assert "could not import" not in r.stdout, tail        # no smoke file skipped whole
