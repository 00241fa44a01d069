"""The programs in examples/ and the README's "Use" snippet, run as a user
would: each example by itself (`python examples/X.py`, which starts its own
peer on loopback) must exit 0 and print its success line, on the default
backend and on ucx (skipped with the registry's reason where ucx is
unusable)."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from fabric import backends

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
README = os.path.join(ROOT, "README.md")

# example -> (the line it prints on success, the modules it needs besides fabric)
CASES = {
    "numpy_arrays.py": (r"numpy_arrays: 5 arrays of \(512, 1024\) float64 received over \w+ .*: OK", ["numpy"]),
    "torch_tensors.py": (r"torch_tensors: 3 tensors received over \w+ .*: OK", []),
    "asyncio_echo.py": (r"asyncio_echo: 3 clients x 5 messages echoed over \w+: OK", []),
    "grpc_helloworld.py": (r"grpc_helloworld: SayHello over \S+.*: OK", ["grpc", "grpc_tools", "h2"]),
    "byte_stream.py": (r"byte_stream: 1048576 bytes in \d+ writes over \w+, checked .*: OK", []),
}
# what each prints besides, with the backend the run asked for
EXTRA = {"grpc_helloworld.py": r"^Greeter client received: Hello, fabric!$"}


def run(args, timeout=150, env=None):
    full_env = dict(os.environ, **(env or {}))
    full_env["PYTHONPATH"] = ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=full_env)


def test_every_example_is_tested():
    assert sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py")) == sorted(CASES)


# torch takes seconds to import in each of the two processes
@pytest.mark.timeout(200)
@pytest.mark.parametrize("backend", [None, "ucx"], ids=["default", "ucx"])
@pytest.mark.parametrize("example", sorted(CASES))
def test_example_runs_and_succeeds(example, backend):
    pattern, needs = CASES[example]
    for module in needs:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{example} needs {module}, which is not installed")
    if backend is not None:
        ok, reason = backends.available()[backend]
        if not ok:
            pytest.skip(f"backend {backend} unavailable here: {reason}")
    args = [os.path.join(EXAMPLES, example)] + (["--backend", backend] if backend else [])
    r = run(args)
    assert r.returncode == 0, f"{example} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    if example == "torch_tensors.py" and importlib.util.find_spec("torch") is None:
        assert re.search(r"^torch_tensors: skipped, torch is not importable", r.stdout, re.M), r.stdout
        pytest.skip("torch is not installed (the example said so and exited 0)")
    assert re.search("^" + pattern + "$", r.stdout, re.M), f"no success line:\n{r.stdout}\n{r.stderr}"
    if example in EXTRA:
        assert re.search(EXTRA[example], r.stdout, re.M), r.stdout
    if backend is not None and example != "grpc_helloworld.py":
        assert f"over {backend}" in r.stdout
    if backend is not None and example == "grpc_helloworld.py":
        assert f"over fabric+{backend}://" in r.stdout
    assert "Traceback" not in r.stderr, r.stderr


def readme_use_snippet() -> str:
    """The python block of the README's "Use" section."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    _, found, rest = text.partition("\n## Use\n")
    assert found, "README.md has no '## Use' section"
    section = rest.split("\n## ", 1)[0]
    block = re.search(r"^```python\n(.*?)^```", section, re.S | re.M)
    assert block, "README.md's Use section has no python block"
    return block.group(1)


# What the snippet leaves to the reader, and nothing else.
PREAMBLE = '''\
import numpy as np
header = np.arange(4, dtype=np.int64)                        # small: sent eagerly
tensor = np.ones((64, 64), dtype=np.float32)
numpy_array = np.empty(header.nbytes + tensor.nbytes, dtype=np.uint8)   # room for [header, tensor]
big_array = np.arange(1 << 20, dtype=np.float64)           # 8 MiB: by rendezvous
buf = bytearray(1 << 16)
'''

# Whether it did what its comments say.
CHECKS = '''
import asyncio as _asyncio
assert bytes(msg) == b"hello", msg
assert n == header.nbytes + tensor.nbytes, n
assert numpy_array.tobytes() == header.tobytes() + tensor.tobytes()
assert req.done() and req.nbytes == big_array.nbytes
assert big == big_array.tobytes()
assert _asyncio.iscoroutinefunction(main)
assert fab.closed
print("README Use snippet: OK")
'''


@pytest.mark.timeout(120)
def test_readme_use_snippet_runs_as_written(tmp_path):
    snippet = readme_use_snippet()
    if importlib.util.find_spec("numpy") is None:
        pytest.skip("the preamble makes numpy arrays; numpy is not installed")
    if 'Fabric("ucx")' in snippet:     # (a backend that may be missing)
        ok, reason = backends.available()["ucx"]
        if not ok:
            pytest.skip(f"the snippet opens a ucx Fabric, and ucx is unavailable here: {reason}")
    script = tmp_path / "readme_use.py"
    script.write_text(PREAMBLE + "\n# --- README.md, section Use, as written\n" + snippet + CHECKS)
    r = run([str(script)], timeout=100)
    assert r.returncode == 0, f"the README's Use snippet failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    assert "README Use snippet: OK" in r.stdout
    assert "ResourceWarning" not in r.stderr, r.stderr
