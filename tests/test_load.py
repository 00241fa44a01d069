"""The load test's CI version (bench/load.py runs it for minutes): 256
connections between two processes, four threads each (two blocking, two
asyncio event loops), sizes 0 B to 64 MiB, every message checked for loss,
duplication, reordering and corruption; descriptors, threads, registrations
and memory back where they were at the end. FABRIC_TEST_CONNECTIONS and
FABRIC_TEST_LOAD_SECONDS scale it (the Soft-RoCE guest uses less)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import load  # noqa: E402
from conftest import VARIANTS  # noqa: E402

CONNECTIONS = min(256, int(os.environ.get("FABRIC_TEST_CONNECTIONS", "256")))
SECONDS = float(os.environ.get("FABRIC_TEST_LOAD_SECONDS", "8"))
MAX_SIZE = load.parse_size(os.environ.get("FABRIC_TEST_LOAD_MAX_SIZE", "64M"))


@pytest.mark.load
@pytest.mark.timeout(600)
def test_load_many_connections_threads_and_loops_mixed(backend_name, request):
    env = VARIANTS[request.node.callspec.params["backend_name"]][1]
    report = load.run(backend_name, connections=CONNECTIONS, threads=4, duration=SECONDS,
                      max_size=MAX_SIZE, env=env)
    assert report["violations"] == [], (report["violations"], report.get("stalls"))
    assert report["client_messages"] > CONNECTIONS and report["server_messages"] > CONNECTIONS, report
    assert report["registered_regions_at_end"] == 0, report
    before, after = report["domain_refs"]
    assert before == after, report            # every channel released its domain reference
    # growth only: the count is of this whole process, where a thread of an
    # earlier test (a collected Fabric's progress thread) may end meanwhile
    assert report["fds_growth"] <= 0 and report["threads_growth"] <= 0, report
    # (glibc keeps some freed memory in its arenas; a leak per message would be far more)
    assert report["rss_growth"] < 128 << 20, report
