"""The programs in examples/, run as a user would: each by itself (`python
examples/X.py`, which starts its own peer on loopback) must terminate, exit 0
and print its success line. Examples on the default fabric run with
FABRIC_BACKEND=tcp, and once more with `--backend ucx` where ucx is usable
(skipped with the registry's reason elsewhere). An example that needs an
optional package is skipped, naming the package.

The docs (docs/guides/*.rst) show these files through literalinclude, and
the README's tour is an excerpt of examples/hello.py: both are checked here
too, so what a reader copies is what ran."""
from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from fabric import backends

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
GUIDES = os.path.join(ROOT, "docs", "guides")
README = os.path.join(ROOT, "README.md")


@dataclass
class Case:
    success: str                                     # the line it prints on success (a regex, whole line)
    needs: list[str] = field(default_factory=list)   # importable modules besides fabric
    commands: list[str] = field(default_factory=list)  # programs on PATH
    extra: list[str] = field(default_factory=list)   # other lines it must print (regexes, whole lines)
    default_fabric: bool = True                      # opens Fabric(None): FABRIC_BACKEND=tcp applies
    backends: list[str] = field(default_factory=lambda: ["ucx"])  # also run with --backend NAME
    timeout: int = 90                                # seconds, for the whole program


CASES = {
    # the large message goes by fabric's rendezvous, or by UCX's own protocol on ucx ("native")
    "hello.py": Case(r"hello: eager, gathered and (?:rendezvous|native) messages over (\w+): OK"),
    "numpy_arrays.py": Case(r"numpy_arrays: 5 arrays of \(512, 1024\) float64 received over (\w+) "
                            r"into one preallocated array: OK", needs=["numpy"]),
    "asyncio_echo.py": Case(r"asyncio_echo: 3 clients x 5 messages echoed over (\w+): OK"),
    "byte_stream.py": Case(r"byte_stream: 1048576 bytes in \d+ writes over (\w+), checked by the server's "
                           r"SHA-256: OK"),
    "torch_tensors.py": Case(r"torch_tensors: 3 tensors received over (\w+) into tensors allocated from "
                             r"their headers: OK", needs=["torch"], timeout=150),
    "grpc_helloworld.py": Case(r"grpc_helloworld: SayHello over (\S+?)(?: \(plain TCP\))?: OK",
                               needs=["grpc", "grpc_tools"], default_fabric=False,
                               extra=[r"Greeter client received: Hello, fabric!"]),
    "tls_tcp.py": Case(r"tls_tcp: 600000 bytes over TLS; an untrusting client refused \(AuthenticationError\): OK",
                       needs=["fabric.backends.tls"], commands=["openssl"], default_fabric=False, backends=[]),
    "dask_cluster.py": Case(r"dask_cluster: a 32 MiB array moved between 2 workers over (fabric\+\w+://): OK",
                            needs=["distributed", "numpy"], default_fabric=False, timeout=150),
    "torch_allreduce.py": Case(r"torch_allreduce: all_reduce, send/recv and barrier on 2 ranks over (\w+): OK",
                               needs=["torch"], timeout=150),
}
# what --backend NAME makes an example print where the success line names the fabric
SHOWN_AS = {"grpc_helloworld.py": "fabric+{}://127.0.0.1:", "dask_cluster.py": "fabric+{}://"}


def run(args, timeout, env=None):
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env["PYTHONPATH"] = ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
    try:
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                              cwd=ROOT, env=full_env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{args[0]} did not finish within {timeout} s:\n{e.stdout}\n{e.stderr}")


def skip_unless_runnable(case: Case, example: str) -> None:
    for module in case.needs:
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:
            found = False
        if not found:
            pytest.skip(f"{example} needs {module}, which is not installed")
    for command in case.commands:
        if shutil.which(command) is None:
            pytest.skip(f"{example} needs the {command} command, which is not on PATH")


def variants():
    for example, case in sorted(CASES.items()):
        yield pytest.param(example, None, id=f"{example[:-3]}-default")
        for backend in case.backends:
            yield pytest.param(example, backend, id=f"{example[:-3]}-{backend}")


def test_every_example_is_tested():
    assert sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py")) == sorted(CASES)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("example, backend", list(variants()))
def test_example_runs_and_succeeds(example, backend):
    case = CASES[example]
    skip_unless_runnable(case, example)
    if backend is not None:
        ok, reason = backends.available()[backend]
        if not ok:
            pytest.skip(f"backend {backend} unavailable here: {reason}")
    env = {}
    if case.default_fabric and backend is None:
        env["FABRIC_BACKEND"] = "tcp"
    args = [os.path.join(EXAMPLES, example)] + (["--backend", backend] if backend else [])
    r = run(args, timeout=case.timeout, env=env)
    assert r.returncode == 0, f"{example} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    found = re.search("^" + case.success + "$", r.stdout, re.M)
    assert found, f"{example}: no success line:\n{r.stdout}\n{r.stderr}"
    for line in case.extra:
        assert re.search("^" + line + "$", r.stdout, re.M), f"{example}: no line {line!r}:\n{r.stdout}"
    lines = [line for line in r.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 + len(case.extra), f"{example} printed more than expected:\n{r.stdout}"
    if found.groups():
        shown = found.group(1)
        if backend is not None:
            assert shown.startswith(SHOWN_AS.get(example, "{}").format(backend)), shown
        elif case.default_fabric:
            assert shown == "tcp", f"{example} ignored FABRIC_BACKEND=tcp: {shown}"
    assert "Traceback" not in r.stderr, r.stderr
    assert "ResourceWarning" not in r.stderr, r.stderr


def test_the_readme_tour_is_an_excerpt_of_hello_py():
    """Every line of the README's python block is a line of examples/hello.py
    (indentation aside), in the same order: the tour is code that ran."""
    with open(README, encoding="utf-8") as f:
        readme = f.read()
    blocks = re.findall(r"^```python\n(.*?)^```", readme, re.S | re.M)
    assert blocks, "README.md has no python block"
    with open(os.path.join(EXAMPLES, "hello.py"), encoding="utf-8") as f:
        example = [line.strip() for line in f]
    for block in blocks:
        at = 0
        for line in (ln.strip() for ln in block.splitlines()):
            if not line:
                continue
            assert line in example[at:], f"README line not in examples/hello.py (in order): {line!r}"
            at = example.index(line, at) + 1


def test_the_guides_include_only_examples_that_exist():
    """A literalinclude of the guides names a file of examples/ that this
    module runs (a renamed example would otherwise break the docs' build
    only)."""
    included = set()
    for guide in glob.glob(os.path.join(GUIDES, "*.rst")):
        with open(guide, encoding="utf-8") as f:
            for path in re.findall(r"^\.\. literalinclude:: (\S+)", f.read(), re.M):
                assert path.startswith("../../examples/"), f"{guide}: includes {path}, not an example"
                included.add(os.path.basename(path))
    if not included:
        pytest.skip("no guide includes an example yet")
    assert included <= set(CASES), included - set(CASES)
