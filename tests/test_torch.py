"""fabric as a torch.distributed backend (fabric.torch), on every fabric.

Each test starts WORLD processes of tests/torch_ranks.py (env:// init, or
tcp:// and file://), one scenario each: the collectives against gloo and
a reference, point to point with tags, DDP against gloo, a rank killed
mid-collective, a timeout, destroy_process_group() cleaning up."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import unused_port

torch = pytest.importorskip("torch", reason="torch is not installed (tools/setup.sh installs it only from a "
                                            "local CPU wheel; pip install fabric-transport[torch])")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
IN_GUEST = os.environ.get("FABRIC_TEST_BACKENDS") == "verbs"
# how long a job may take before the test calls it a hang (the guest runs Python ~20x slower)
HANG = 1500 if IN_GUEST else 300


def run_ranks(backend_name, scenario, world, init="env", tmp_path=None, expect_exit=None, env=None):
    # torch's store binds the port itself, after we chose it: if something
    # took it in between, choose again (the fabric is not involved yet).
    for attempt in range(3):
        try:
            return _run_ranks_once(backend_name, scenario, world, init, tmp_path, expect_exit, env)
        except StorePortTaken:
            if attempt == 2:
                raise


class StorePortTaken(AssertionError):
    pass


def store_port_taken(err):
    return "failed to listen" in err and "EADDRINUSE" in err


def _run_ranks_once(backend_name, scenario, world, init, tmp_path, expect_exit, env):
    port = unused_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
               FABRIC_BACKEND=backend_name, OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    if init == "tcp":
        env["FABRIC_TEST_INIT"] = f"tcp://127.0.0.1:{port}"
    elif init == "file":
        env["FABRIC_TEST_INIT"] = f"file://{tmp_path / 'rendezvous'}"
    elif init == "ipv6":
        env["MASTER_ADDR"] = "::1"          # the store and fabric's listeners on IPv6
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "torch_ranks.py"), scenario],
                              env=dict(env, RANK=str(r)), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True) for r in range(world)]
    outputs = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=HANG)
            outputs.append((p.returncode, err))
            if store_port_taken(err):
                break           # rank 0 holds the store: the others would wait a minute for it
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    bad = [(r, code, err) for r, (code, err) in enumerate(outputs)
           if code != (expect_exit(r) if expect_exit else 0)]
    if outputs and store_port_taken(outputs[0][1]):
        raise StorePortTaken(f"torch's store could not bind port {port}")
    assert not bad, "\n".join(f"rank {r} exited {code}:\n{err[-4000:]}" for r, code, err in bad)
    return [err for _, err in outputs]


# Under TCG each rank takes half a minute to start: the guest runs the
# collectives (fewer dtypes), p2p, DDP, a timeout and destroy in one job,
# and a killed rank.
GUEST_RUNS_IT = "the Soft-RoCE guest runs this scenario within test_collectives_match_gloo_and_the_reference"


@pytest.mark.timeout(HANG + 60)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_collectives_match_gloo_and_the_reference(backend_name, world, request):
    if IN_GUEST:
        if world > 2:
            pytest.skip("the guest runs world size 2 (each rank takes half a minute to start under TCG)")
        run_ranks(backend_name, "collectives+p2p+ddp+timeout+destroy", world,
                  env={"FABRIC_TEST_TORCH_LIGHT": "1"})
        return
    if world > 2 and request.node.callspec.params.get("backend_name") == "ucx-tcp":
        pytest.skip("world sizes 3 and 4 run on tcp and ucx-sm; ucx over its tcp lanes runs 2")
    run_ranks(backend_name, "collectives", world)


@pytest.mark.timeout(HANG + 60)
def test_point_to_point_with_tags_and_batches(backend_name):
    if IN_GUEST:
        pytest.skip(GUEST_RUNS_IT)
    run_ranks(backend_name, "p2p", 3)


@pytest.mark.timeout(HANG + 60)
@pytest.mark.parametrize("init", ["tcp", "file", "ipv6"])
def test_other_init_methods(backend_name, init, tmp_path):
    if IN_GUEST:
        pytest.skip("init methods do not depend on the fabric: the host runs them")
    run_ranks(backend_name, "p2p", 2, init=init, tmp_path=tmp_path)


@pytest.mark.timeout(HANG + 60)
def test_fabric_as_the_default_group(backend_name):
    if IN_GUEST:
        pytest.skip("the host runs it: what the world group adds is torch's side, not the fabric's")
    run_ranks(backend_name, "default", 2)


@pytest.mark.timeout(HANG + 60)
def test_the_group_authenticates_its_connections_with_the_environment_key(backend_name):
    """FABRIC_AUTH_KEY on every rank: the mesh is built by authenticated
    connections (tests/test_auth.py tests the refusals themselves)."""
    if IN_GUEST:
        pytest.skip("tests/test_auth.py runs the authentication on verbs in the guest")
    run_ranks(backend_name, "default", 2, env={"FABRIC_AUTH_KEY": "the ranks of this job share this key"})


# serial: sixteen processes starting torch hold both cores for half a minute,
# long enough to starve another test's timers in the parallel part
@pytest.mark.serial
@pytest.mark.timeout(HANG + 60)
def test_sixteen_ranks_connect_and_reduce(backend_name, request):
    """A mesh of 120 connections, 15 readers per rank, on the 2-core VM."""
    if IN_GUEST:
        pytest.skip("the guest runs world size 2 (each rank takes half a minute to start under TCG)")
    if request.node.callspec.params.get("backend_name") == "ucx-tcp":
        pytest.skip("sixteen ranks run on tcp and ucx-sm")
    run_ranks(backend_name, "default", 16)


@pytest.mark.timeout(HANG + 60)
def test_ddp_trains_as_on_gloo(backend_name):
    if IN_GUEST:
        pytest.skip(GUEST_RUNS_IT)
    run_ranks(backend_name, "ddp", 2)


@pytest.mark.timeout(HANG + 60)
def test_a_killed_rank_fails_the_others_naming_it(backend_name):
    world = 2 if IN_GUEST else 3
    errs = run_ranks(backend_name, "kill", world)
    assert all("failed after" in e for e in errs[:world - 1]), errs


@pytest.mark.timeout(HANG + 60)
def test_a_missing_rank_times_out(backend_name):
    if IN_GUEST:
        pytest.skip(GUEST_RUNS_IT)
    run_ranks(backend_name, "timeout", 2)


@pytest.mark.timeout(HANG + 60)
def test_a_rank_leaving_right_after_its_sends_loses_none(backend_name):
    if IN_GUEST:
        pytest.skip("the host runs it: fabric.torch's shutdown, on tcp and ucx (tests/test_faults.py checks "
                    "the same delivery on verbs in the guest)")
    run_ranks(backend_name, "leave", 2)


@pytest.mark.timeout(HANG + 60)
def test_destroy_process_group_leaves_nothing(backend_name):
    if IN_GUEST:
        pytest.skip(GUEST_RUNS_IT)
    run_ranks(backend_name, "destroy", 2)


@pytest.mark.timeout(60)
def test_the_ring_threshold_follows_the_fabrics_capabilities():
    """all_reduce's ring/doubling switch comes from what a fabric can do, not
    its name: a fabric whose pulls the peer's CPU serves (tcp) takes the ring
    sooner at two ranks; one-sided or native transfers keep doubling longer."""
    import fabric
    from fabric import torch as fabric_torch

    tcp = fabric.Fabric("tcp")
    try:
        caps = tcp.backend.capabilities
    finally:
        tcp.close()
    assert fabric_torch._ring_min_for(caps, 2) == fabric_torch.RING_MIN_SERVED_PAIR
    assert fabric_torch._ring_min_for(caps, 4) == fabric_torch.RING_MIN
    assert fabric_torch._ring_min_for(("native_read", "native_write", "ordered_write"), 2) == fabric_torch.RING_MIN
    assert fabric_torch._ring_min_for(("native_read", "reads_served"), 2) == fabric_torch.RING_MIN
