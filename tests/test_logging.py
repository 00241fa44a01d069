"""fabric logs through the `logging` module (logger "fabric"): the backend
and why, connections opened and closed, peer failures; silent unless the
application configures logging."""
import logging
import os
import subprocess
import sys

import pytest

import fabric
from conftest import ROOT

PEER = ("import fabric, sys, time\n"
        "f = fabric.Fabric(sys.argv[2]); e = f.connect(sys.argv[1], timeout=10)\n"
        "print('connected', flush=True); time.sleep(60)\n")


def dying_peer(address, backend="tcp"):
    proc = subprocess.Popen([sys.executable, "-c", PEER, address, backend], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    return proc


@pytest.mark.timeout(60)
def test_backend_choice_connections_and_failures_are_logged(caplog):
    caplog.set_level(logging.DEBUG, logger="fabric")
    with fabric.Fabric("tcp") as fab:
        assert any(r.levelno == logging.INFO and "Fabric on tcp" in r.getMessage() and "asked for tcp" in r.getMessage()
                   for r in caplog.records)
        lst = fab.listen()
        peer = dying_peer(lst.address)
        try:
            ep = lst.accept(timeout=20)
            assert peer.stdout.readline().strip() == "connected"
            opened = [r for r in caplog.records if "opened" in r.getMessage()]
            assert opened and opened[-1].levelno == logging.DEBUG and ep.peer_address in opened[-1].getMessage()
            peer.kill()
            peer.wait()
            for _ in range(2):        # two failed operations, one log line
                with pytest.raises(fabric.ConnectionLost):
                    ep.recv(timeout=10)
            failed = [r for r in caplog.records if "failed" in r.getMessage()]
            assert len(failed) == 1 and failed[0].levelno == logging.INFO, [r.getMessage() for r in failed]
            ep.close()
            assert any("closed" in r.getMessage() for r in caplog.records)
        finally:
            peer.kill()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["tcp", "ucx"])
def test_a_peer_that_closes_is_logged_as_closed_not_failed(caplog, backend):
    if not fabric.available_backends()[backend][0]:
        pytest.skip(f"{backend} unavailable: {fabric.available_backends()[backend][1]}")
    caplog.set_level(logging.DEBUG, logger="fabric")
    with fabric.Fabric(backend) as fab:
        lst = fab.listen()
        client = fab.connect(lst.address, timeout=10)
        server = lst.accept(timeout=10)
        client.close()
        with pytest.raises(fabric.ConnectionClosed):
            server.recv(timeout=10)
        messages = [(r.levelno, r.getMessage()) for r in caplog.records]
        assert not [m for m in messages if "failed" in m[1]], messages
        if backend == "tcp":      # (ucx's survivor may settle the endpoint after recv() returned)
            assert any(level == logging.DEBUG and "closed by the peer" in m for level, m in messages), messages
        server.close()


@pytest.mark.timeout(60)
def test_auto_says_why_it_chose_its_backend(caplog, monkeypatch):
    monkeypatch.delenv("FABRIC_BACKEND", raising=False)
    caplog.set_level(logging.INFO, logger="fabric")
    fab = fabric.Fabric()
    try:
        text = " ".join(r.getMessage() for r in caplog.records)
        assert f"Fabric on {fab.name} (auto:" in text and "verbs" in text, text
        assert fab.backend_reason.startswith("auto:")
    finally:
        fab.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["tcp", "auto"])
def test_silent_without_logging_configuration(backend):
    code = ("import fabric, subprocess, sys\n"
            f"f = fabric.Fabric({backend!r}); l = f.listen()\n"
            f"p = subprocess.Popen([sys.executable, '-c', {PEER!r}, l.address, {backend!r}], stdout=subprocess.DEVNULL)\n"
            "ep = l.accept(timeout=20); p.kill(); p.wait()\n"
            "try:\n    ep.recv(timeout=10)\nexcept fabric.ConnectionLost:\n    pass\n"
            "ep.close(); f.close()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stderr
    assert done.stdout == "", done.stdout
    # (UCX's own warnings about a killed peer, if any, go to stderr: not ours)
    if backend == "tcp":
        assert done.stderr == "", done.stderr
