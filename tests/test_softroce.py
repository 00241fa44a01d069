"""The Soft-RoCE harness (tools/softroce.py): a guest with an active rxe0.
The verbs endpoint suite (issue 4) will run through it."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT

HARNESS = os.path.join(ROOT, "tools", "softroce.py")


def harness_ready():
    r = subprocess.run([sys.executable, HARNESS, "--check"], capture_output=True, text=True)
    return r.returncode == 0, (r.stdout + r.stderr).strip()


@pytest.mark.timeout(300)
def test_guest_has_an_active_rxe_device_and_reports_exit_codes():
    if os.environ.get("FABRIC_IN_SOFTROCE_GUEST"):
        pytest.skip("already inside the Soft-RoCE guest (no nested QEMU)")
    ok, why = harness_ready()
    if not ok:
        pytest.skip(f"Soft-RoCE guest cannot run here: {why}")
    script = ("test \"$(cat /sys/class/infiniband/rxe0/ports/1/state)\" = '4: ACTIVE' || exit 11; "
              "grep -q 'ffff:c000:0201' /sys/class/infiniband/rxe0/ports/1/gids/1 || exit 12; "
              "test \"$(pwd)\" = " + repr(ROOT) + " || exit 13; "
              "ibv_devinfo -d rxe0 | grep -q PORT_ACTIVE || exit 14; "
              f"{sys.executable} -c 'import fabric' || exit 15; "
              "exit 42")
    r = subprocess.run([sys.executable, HARNESS, "--timeout", "240", "--", "sh", "-c", script],
                       cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert r.returncode == 42, f"guest said {r.returncode}:\n{r.stdout}\n{r.stderr}"
    assert "rxe0 ACTIVE" in r.stdout
