"""Short, seeded fuzzing runs of fabric's decoders (atheris on a copy of
fabric built with clang's sanitizer coverage and AddressSanitizer, see
tools/fuzz.py): the frame decoder, the tcp fabric's byte parser, a whole
endpoint's handshake and frame handling, the connection preamble with
its authentication, and fabric.grpc's HPACK decoder and HTTP/2 core. Any crash, sanitizer report,
unexpected exception or memory beyond the configured bounds fails the run.
The long run is `python tools/fuzz.py all --time 600` (bench/RESULTS.md)."""
from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import fuzz  # noqa: E402

# runs per target: a few seconds each on this machine
RUNS = {"frame": 150000, "tcp": 40000, "handshake": 20000, "auth": 20000, "hpack": 40000, "h2": 30000}
# coverage edges the committed corpus reaches (measured: 281, 188, 512, 239, 358, 2093;
# the Python harness alone has a few dozen): the instrumented copy is in use
MIN_EDGES = {"frame": 200, "tcp": 130, "handshake": 350, "auth": 180, "hpack": 280, "h2": 1500}


@pytest.fixture(scope="module")
def instrumented():
    why = fuzz.why_unavailable()
    if why:
        pytest.skip(f"native fuzzing unavailable: {why}")
    fuzz.build()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("target", fuzz.TARGETS)
def test_fuzz_target_short_seeded_run(instrumented, target, tmp_path):
    rc, out = fuzz.run(target, seconds=60, runs=RUNS[target], seed=1, corpus=str(tmp_path), quiet=True)
    assert rc == 0, out[-6000:]
    executed = re.search(r"stat::number_of_executed_units:\s*(\d+)", out)
    assert executed and int(executed.group(1)) >= RUNS[target] // 2, out[-3000:]
    cov = re.findall(r"cov: (\d+)", out)
    assert cov and int(cov[-1]) >= MIN_EDGES[target], out[-3000:]
