"""An HTTP/2 load generator that is not ours (h2load, nghttp2's) against
fabric.grpc's plain-TCP servers, sync and asyncio: many connections with
many streams each, every request answered by the handler with a 2xx
status, none failed (bench/h2load_grpc.py runs the full load beside grpcio)."""
import os
import shutil
import sys

import pytest

pytest.importorskip("grpc")
pytest.importorskip("grpc_tools")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import h2load_grpc  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("h2load") is None,
                                reason="h2load is not installed (apt install nghttp2-client; tools/setup.sh does)")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["fabric", "fabric-aio"])
@pytest.mark.parametrize("size", [8, 20000])
def test_h2load_many_connections_and_streams_all_answered(kind, size):
    r = h2load_grpc.run(kind, clients=40, streams=10, requests=4000, size=size, timeout=200)
    assert r["clean"], r
