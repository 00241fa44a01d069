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
