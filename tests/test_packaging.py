"""What a built fabric depends on, read from its ELF files: the verbs backend
neither links libibverbs nor leaves an ibv_ symbol for the dynamic linker (it
dlopens the host's at run time, so a wheel runs where rdma-core is absent);
no extension records a path of the build machine in its RUNPATH; and the
release's version is the same in pyproject.toml, fabric.__version__ and the
top of CHANGELOG.md."""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess

import pytest

import fabric

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.dirname(os.path.abspath(fabric.__file__))
EXTENSIONS = sorted(glob.glob(os.path.join(PACKAGE, "**", "*.so"), recursive=True))

pytestmark = pytest.mark.timeout(60)


def _readelf(*args):
    if shutil.which("readelf") is None:
        pytest.skip("readelf (binutils) is not installed")
    return subprocess.run(["readelf", *args], capture_output=True, text=True, check=True).stdout


def _dynamic(path):
    """(NEEDED sonames, RUNPATH and RPATH entries) of one ELF file."""
    needed, paths = [], []
    for line in _readelf("-d", path).splitlines():
        m = re.search(r"\((NEEDED|RUNPATH|RPATH)\).*\[(.*)\]", line)
        if m and m.group(1) == "NEEDED":
            needed.append(m.group(2))
        elif m:
            paths.extend(m.group(2).split(":"))
    return needed, paths


def test_the_build_has_extensions_to_check():
    names = {os.path.basename(p).split(".")[0] for p in EXTENSIONS}
    assert {"engine", "tcp", "interface"} <= names, names


def test_verbs_loads_libibverbs_at_run_time_only():
    verbs = [p for p in EXTENSIONS if os.path.basename(p).startswith("verbs.")]
    if not verbs:
        pytest.skip("the verbs backend is not built here")
    needed, _ = _dynamic(verbs[0])
    assert not [n for n in needed if "ibverbs" in n or "rdma" in n], needed
    undefined = [line.split()[7].split("@")[0] for line in _readelf("--dyn-syms", "-W", verbs[0]).splitlines()
                 if " UND " in line and len(line.split()) > 7]
    assert not [s for s in undefined if s.startswith("ibv_")], undefined
    assert any(s.startswith(("dlopen", "dlvsym")) for s in undefined), undefined


@pytest.mark.parametrize("path", EXTENSIONS, ids=lambda p: os.path.relpath(p, PACKAGE))
def test_no_extension_records_a_path_of_the_build_machine(path):
    _, paths = _dynamic(path)
    # the only RUNPATH allowed is relative to the extension: the libucx wheel's
    assert all(p.startswith("$ORIGIN") for p in paths), paths


def test_the_version_agrees_everywhere():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:      # (tomllib is 3.11's)
        version = re.search(r'^version = "([^"]+)"', f.read(), re.M).group(1)
    assert fabric.__version__ == version
    with open(os.path.join(ROOT, "CHANGELOG.md")) as f:
        headings = [line for line in f if line.startswith("## ")]
    assert headings and headings[0].split()[1] == version, headings[:1]


NO_VERBS_PROGRAM = r"""
import json, fabric
ok, reason = fabric.available_backends()["verbs"]
try:
    fabric.Fabric("verbs")
    raised = None
except fabric.BackendUnavailable as e:
    raised = str(e)
fab = fabric.Fabric("tcp")
lst = fab.listen("127.0.0.1:0")
ep = fab.connect(lst.address, timeout=10)
peer = lst.accept(timeout=10)
ep.send(b"x" * 300000)
got = len(peer.recv(timeout=10))
fab.close()
print(json.dumps({"ok": ok, "reason": reason, "raised": raised, "tcp": got}))
"""


def test_a_host_without_libibverbs_gets_a_reason_and_the_other_backends():
    """rdma-core absent: in a private mount namespace libibverbs.so.1 is
    hidden; the same build imports, verbs says why it is unavailable, tcp
    works."""
    import json
    import sys
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("hiding libibverbs needs root and unshare(1) (a private mount namespace)")
    found = subprocess.run(["sh", "-c", "ldconfig -p | sed -n 's/.*libibverbs.so.1 .*=> //p' | head -n 1"],
                           capture_output=True, text=True).stdout.strip()
    if not found:               # rdma-core not installed: the host is already the case
        script = ""
    else:
        real = os.path.realpath(found)
        script = f"mount --bind /dev/null {real} && "
    r = subprocess.run(["unshare", "-m", "sh", "-c", script + 'exec "$0" -c "$1"', sys.executable,
                        NO_VERBS_PROGRAM], capture_output=True, text=True, timeout=50, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["tcp"] == 300000
    assert not out["ok"] and "libibverbs" in out["reason"] and "rdma-core" in out["reason"], out
    assert out["raised"] and "libibverbs" in out["raised"], out


def test_verbs_uses_the_hosts_libibverbs_and_its_providers():
    """Where an RDMA device exists (the Soft-RoCE guest), the verbs backend
    runs on the host's libibverbs, whose provider driver (librxe) it loads:
    a copy inside the package would find no providers."""
    ok, reason = fabric.available_backends()["verbs"]
    if not ok:
        pytest.skip(f"verbs unavailable here: {reason}")
    with fabric.Fabric("verbs") as fab:
        lst = fab.listen("127.0.0.1:0")
        ep = fab.connect(lst.address, timeout=30)
        peer = lst.accept(timeout=30)
        ep.send(b"v" * 100000)
        assert len(peer.recv(timeout=30)) == 100000
        with open("/proc/self/maps") as f:
            loaded = {line.split()[-1] for line in f if "libibverbs" in line}
    assert loaded and not [p for p in loaded if p.startswith(PACKAGE)], loaded
    assert any("rdmav" in os.path.basename(p) for p in loaded), loaded
