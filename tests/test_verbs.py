"""verbs-specific behaviour: device, port and GID choice (with a fake sysfs
tree anywhere; against the real rxe0 inside the Soft-RoCE guest)."""
import os

import pytest

from fabric import backends

verbs = pytest.importorskip("fabric.backends.verbs",
                            reason="the verbs backend is not built here (no infiniband/verbs.h)")


def fake_device(root, dev, ports):
    """ports: {port: (state, link, [(gid, type), ...])}"""
    for port, (state, link, gids) in ports.items():
        base = root / dev / "ports" / str(port)
        (base / "gids").mkdir(parents=True)
        (base / "gid_attrs" / "types").mkdir(parents=True)
        (base / "state").write_text(state + "\n")
        (base / "link_layer").write_text(link + "\n")
        for i, (gid, gtype) in enumerate(gids):
            (base / "gids" / str(i)).write_text(gid + "\n")
            (base / "gid_attrs" / "types" / str(i)).write_text(gtype + "\n")


V4 = "0000:0000:0000:0000:0000:ffff:c000:0201"
LINK_LOCAL = "fe80:0000:0000:0000:b464:d5ff:fe62:c3d8"


def test_picks_first_active_port_and_roce_v2_ipv4_gid(tmp_path):
    fake_device(tmp_path, "mlx5_0", {1: ("1: DOWN", "Ethernet", [(LINK_LOCAL, "IB/RoCE v1")])})
    fake_device(tmp_path, "rxe0", {1: ("4: ACTIVE", "Ethernet",
                                       [(LINK_LOCAL, "IB/RoCE v1"), (LINK_LOCAL, "RoCE v2"), (V4, "IB/RoCE v1"), (V4, "RoCE v2")])})
    assert verbs.select_device(env={}, root=str(tmp_path)) == ("rxe0", 1, 3, "Ethernet")


def test_infiniband_port_uses_gid_0(tmp_path):
    fake_device(tmp_path, "mlx5_0", {1: ("4: ACTIVE", "InfiniBand", [(LINK_LOCAL, "IB/RoCE v1")])})
    assert verbs.select_device(env={}, root=str(tmp_path)) == ("mlx5_0", 1, 0, "InfiniBand")


def test_overrides_and_a_clear_error_naming_what_was_tried(tmp_path):
    fake_device(tmp_path, "rxe0", {1: ("4: ACTIVE", "Ethernet", [(LINK_LOCAL, "RoCE v2")])})
    with pytest.raises(LookupError) as info:
        verbs.select_device(env={}, root=str(tmp_path))
    assert "rxe0 port 1" in str(info.value) and "FABRIC_VERBS_GID_INDEX" in str(info.value)
    assert verbs.select_device(env={"FABRIC_VERBS_GID_INDEX": "0"}, root=str(tmp_path)) == ("rxe0", 1, 0, "Ethernet")
    with pytest.raises(LookupError, match="no device matched"):
        verbs.select_device(env={"FABRIC_VERBS_DEVICE": "mlx9"}, root=str(tmp_path))
    with pytest.raises(LookupError, match="no RDMA device"):
        verbs.select_device(env={}, root=str(tmp_path / "absent"))


def test_real_device_choice_inside_the_guest():
    if not os.environ.get("FABRIC_IN_SOFTROCE_GUEST"):
        pytest.skip("runs inside the Soft-RoCE guest (tools/softroce.py), where rxe0 exists")
    dev, port, gid, link = verbs.select_device()
    assert (dev, port, link) == ("rxe0", 1, "Ethernet")
    with open(f"/sys/class/infiniband/rxe0/ports/1/gids/{gid}") as f:
        assert f.read().strip().endswith("c000:0201")     # 192.0.2.1, RoCE v2
    assert backends.available()["verbs"][0]


def test_discovery_agrees_with_pyverbs_inside_the_guest():
    """Debian's pyverbs (an independent binding of rdma-core) as an oracle for
    the device, port state, MTU and GID fabric chooses."""
    if not os.environ.get("FABRIC_IN_SOFTROCE_GUEST"):
        pytest.skip("runs inside the Soft-RoCE guest (tools/softroce.py), where rxe0 exists")
    import sys
    if "/usr/lib/python3/dist-packages" not in sys.path:
        sys.path.append("/usr/lib/python3/dist-packages")     # Debian's python3-pyverbs (same 3.11 ABI)
    pyverbs_device = pytest.importorskip("pyverbs.device", reason="Debian's python3-pyverbs is not installed")
    dev, port, gid_index, link = verbs.select_device()
    ctx = pyverbs_device.Context(name=dev)
    attr = ctx.query_port(port)
    assert attr.state == 4                                  # IBV_PORT_ACTIVE
    with open(f"/sys/class/infiniband/{dev}/ports/{port}/gids/{gid_index}") as f:
        assert str(ctx.query_gid(port, gid_index)) == f.read().strip()
    assert str(ctx.query_gid(port, gid_index)).startswith("0000:0000:0000:0000:0000:ffff:")
    # the path MTU fabric negotiates is the port's active MTU (9000-byte netdev: 4096)
    assert attr.active_mtu == 5
