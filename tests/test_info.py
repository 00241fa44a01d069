"""`python -m fabric info`: the report's contents, knob sources, RDMA
discovery on a made-up sysfs tree, and a clean stdout."""
import json
import os
import subprocess
import sys

import pytest

import fabric
from fabric import backends, info, options

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = {"fabric", "backends", "auto", "default", "ucx", "rdma", "knobs"}


def run_fabric(args, tmp_path, extra_env=None):
    """python -m fabric ARGS in a clean environment: no FABRIC_* knob
    variables, an absent profile; returns the CompletedProcess."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FABRIC_", "UCX_"))}
    env["FABRIC_PROFILE"] = str(tmp_path / "absent-profile.json")
    env["PYTHONPATH"] = ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    env.update(extra_env or {})
    return subprocess.run([sys.executable, "-m", "fabric"] + list(args), capture_output=True, text=True,
                          timeout=90, env=env, cwd=str(tmp_path))


def info_json(tmp_path, *args, **env):
    r = run_fabric(["info", "--json", *args], tmp_path, env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)          # the whole of stdout is the one JSON document


def test_json_lists_every_backend_with_a_reason_and_autos_choice(tmp_path):
    doc = info_json(tmp_path)
    assert KEYS <= set(doc)
    assert doc["fabric"]["version"] == fabric.__version__
    assert set(doc["backends"]) == set(backends.KNOWN)
    for name, row in doc["backends"].items():
        assert isinstance(row["usable"], bool), name
        assert row["reason"].strip(), name
        assert row["auto"] in ("picked", "unusable", "unneeded", "skipped"), name
    # the same answers as the registry in this (equally configured) process
    if not os.environ.get("UCX_TLS"):          # the child runs without it
        assert doc["auto"]["order"] == list(backends.auto_order())
        assert doc["auto"]["picks"] == backends.get("auto").name
        assert doc["backends"][doc["auto"]["picks"]]["auto"] == "picked"
        assert doc["backends"]["ucx"]["auto"] != "skipped"      # tried with or without UCX_TLS
    for name, (ok, reason) in backends.available().items():
        assert doc["backends"][name]["usable"] == ok
    assert doc["default"] == {"backend": "auto", "source": "auto"}
    assert set(doc["knobs"]["values"]) == set(options.KNOBS)
    assert doc["knobs"]["backend"] == doc["auto"]["picks"]
    assert {row["source"] for row in doc["knobs"]["values"].values()} <= {"default", "backend"}
    assert doc["knobs"]["profile"]["in_use"] is False and doc["knobs"]["profile"]["exists"] is False


def test_ucx_asking_auto_with_ucx_tls(tmp_path):
    doc = info_json(tmp_path, UCX_TLS="tcp")
    assert doc["auto"]["order"] == ["verbs", "ucx", "tcp"]
    assert doc["backends"]["ucx"]["auto"] != "skipped"
    assert doc["ucx"]["env"] == {"UCX_TLS": "tcp"}
    assert "UCX_TLS=tcp" in run_fabric(["info"], tmp_path, {"UCX_TLS": "tcp"}).stdout


def test_knob_sources_follow_env_profile_and_arguments(tmp_path):
    doc = info_json(tmp_path, "-b", "tcp", FABRIC_CHUNK_SIZE="1M")
    values = doc["knobs"]["values"]
    assert values["chunk_size"]["value"] == 1 << 20 and values["chunk_size"]["source"] == "env"
    assert values["chunk_size"]["env_value"] == "1M"
    assert values["credits"]["source"] != "env"
    # without the variable the same knob comes from a default
    assert info_json(tmp_path, "-b", "tcp")["knobs"]["values"]["chunk_size"]["source"] in ("default", "backend")
    # a profile entry for the backend, then a keyword argument over it
    profile = tmp_path / "tuning.json"
    options.write_profile("tcp", {"eager_limit": 12288}, path=str(profile))
    doc = info_json(tmp_path, "-b", "tcp", "-o", "credits=7", FABRIC_PROFILE=str(profile))
    values = doc["knobs"]["values"]
    assert values["eager_limit"]["value"] == 12288 and values["eager_limit"]["source"] == "profile"
    assert values["credits"]["value"] == 7 and values["credits"]["source"] == "argument"
    assert doc["knobs"]["profile"]["in_use"] is True and doc["knobs"]["profile"]["path"] == str(profile)
    assert info_json(tmp_path, "-b", "tcp", FABRIC_PROFILE="none")["knobs"]["profile"]["disabled"] is True
    # the text report says the same
    text = run_fabric(["info", "-b", "tcp"], tmp_path, {"FABRIC_CHUNK_SIZE": "1M"}).stdout
    line = next(ln for ln in text.splitlines() if ln.split()[:1] == ["chunk_size"])
    assert line.split()[1] == "1M" and "env FABRIC_CHUNK_SIZE=1M" in line


def test_a_bad_knob_is_reported_not_raised(tmp_path):
    doc = info_json(tmp_path, "-b", "tcp", FABRIC_CREDITS="lots")
    assert "credits" in doc["knobs"]["error"]


def test_text_report_is_aligned_and_names_everything(tmp_path):
    r = run_fabric(["info"], tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"fabric {fabric.__version__}")
    for section in ("backends (auto picks", "ucx", "rdma", "knobs for "):
        assert any(ln.startswith(section) for ln in lines), section
    start = next(i for i, ln in enumerate(lines) if ln.startswith("backends (auto picks"))
    table = lines[start + 1:lines.index("", start)]
    rows = {ln.split()[0]: ln for ln in table if ln.split()[0] in backends.KNOWN}
    assert set(rows) == set(backends.KNOWN)
    for name, (ok, _) in backends.available().items():
        assert rows[name].split()[1] == ("yes" if ok else "no")
    # one column each: the usable and auto columns start at the same place in every row
    assert len({ln.index(ln.split()[1]) for ln in rows.values()}) == 1
    knob_rows = [ln for ln in lines if ln.split()[:1] and ln.split()[0] in options.KNOBS]
    assert len(knob_rows) == len(options.KNOBS)
    # values right-aligned in one column (knob names have no digits to confuse index())
    assert len({ln.index(ln.split()[1]) + len(ln.split()[1]) for ln in knob_rows}) == 1
    if not os.path.exists("/sys/class/infiniband"):
        assert "  no RDMA devices (no /sys/class/infiniband)" in lines
    # which HTTP/2 core fabric.grpc runs on
    grpc_at = lines.index("grpc")
    assert lines[grpc_at + 1].startswith("  HTTP/2 core: fabric's own, in C")


def test_stdout_carries_only_the_report(tmp_path):
    """UCX and its ucx_info print to stdout unless told otherwise: neither may
    reach ours (verbose UCX logging and an unknown UCX variable to provoke them)."""
    noisy = {"UCX_LOG_LEVEL": "info", "UCX_WARN_UNUSED_ENV_VARS": "y", "UCX_NO_SUCH_SETTING": "1", "UCX_TLS": "tcp"}
    r = run_fabric(["info", "--json"], tmp_path, noisy)
    assert r.returncode == 0, r.stderr
    json.loads(r.stdout)
    r = run_fabric(["info"], tmp_path, noisy)
    assert r.returncode == 0, r.stderr
    for bad in ("UCX  WARN", "UCX  INFO", "Memory domain", "Transport:"):
        assert bad not in r.stdout
    assert not any(ln.startswith("#") for ln in r.stdout.splitlines())


def test_usage_goes_to_stderr(tmp_path):
    r = run_fabric([], tmp_path)
    assert r.returncode == 2 and r.stdout == "" and "info" in r.stderr
    r = run_fabric(["nonsense"], tmp_path)
    assert r.returncode == 2 and r.stdout == "" and "unknown command" in r.stderr


def test_ucx_versions_and_transports():
    data = info.gather_ucx(dict(os.environ))
    ok, reason = backends.available()["ucx"]
    assert data["usable"] == ok and data["reason"] == reason
    if data["compiled"] is None:
        assert data.get("error") or not ok
        return
    built, loaded = backends.load_module("ucx").runtime_version()
    assert data["compiled"] == "%d.%d" % built and data["loaded"] == "%d.%d" % loaded
    assert data["library"] and os.path.exists(data["library"])
    ui = data["ucx_info"]
    if ui["path"] is None:
        assert "not found" in ui["error"]
    else:
        assert ui["error"] is None, ui["error"]
        assert {"transport": "tcp", "device": "lo"} in ui["transports"]


def test_ucx_info_parsing():
    text = ("#\n# Memory domain: self\n#     Component: self\n#      Transport: self\n#         Device: memory\n"
            "#           Type: loopback\n# Memory domain: tcp\n#      Transport: tcp\n#         Device: eth0\n"
            "#         Device: lo\n#      Transport: sysv\n#         Device: memory\n")
    assert info.parse_ucx_info(text) == [{"transport": "self", "device": "memory"},
                                         {"transport": "tcp", "device": "eth0"},
                                         {"transport": "tcp", "device": "lo"},
                                         {"transport": "sysv", "device": "memory"}]


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


@pytest.fixture
def sysfs(tmp_path):
    """A made-up /sys/class/infiniband: a RoCE device with v1 and v2 GIDs,
    link-local and IPv4-mapped, and an InfiniBand device whose port is down."""
    root = tmp_path / "infiniband"
    port = root / "roce0" / "ports" / "1"
    (root / "roce0" / "device").mkdir(parents=True)
    _write(root / "roce0" / "node_type", "1: CA")
    _write(port / "state", "4: ACTIVE")
    _write(port / "link_layer", "Ethernet")
    gids = [("fe80:0000:0000:0000:0202:c9ff:fe00:0001", "IB/RoCE v1"),
            ("fe80:0000:0000:0000:0202:c9ff:fe00:0001", "RoCE v2"),
            ("0000:0000:0000:0000:0000:ffff:c000:0201", "IB/RoCE v1"),
            ("0000:0000:0000:0000:0000:ffff:c000:0201", "RoCE v2"),
            (info.ZERO_GID, None)]
    for i, (gid, kind) in enumerate(gids):
        _write(port / "gids" / str(i), gid)
        if kind:
            _write(port / "gid_attrs" / "types" / str(i), kind)
            _write(port / "gid_attrs" / "ndevs" / str(i), "lo")
    (root / "ib0" / "device").mkdir(parents=True)
    _write(root / "ib0" / "ports" / "1" / "state", "1: DOWN")
    _write(root / "ib0" / "ports" / "1" / "link_layer", "InfiniBand")
    _write(root / "ib0" / "ports" / "1" / "gids" / "0", "fe80:0000:0000:0000:0000:0000:0000:0009")
    return root


def _verbs_built():
    try:
        import fabric.backends.verbs  # noqa: F401
        return True
    except ImportError:
        return False


@pytest.mark.parametrize("env, want_gid", [({}, 3), ({"FABRIC_VERBS_GID_INDEX": "1"}, 1)])
def test_rdma_devices_ports_gids_and_the_verbs_choice(sysfs, env, want_gid):
    data = info.gather_rdma(str(sysfs), env=env)
    assert data["message"] is None
    devs = {d["name"]: d for d in data["devices"]}
    assert set(devs) == {"ib0", "roce0"}
    port = devs["roce0"]["ports"][0]
    assert port["state"] == "ACTIVE" and port["link_layer"] == "Ethernet" and port["gid_table_size"] == 5
    assert [g["index"] for g in port["gids"]] == [0, 1, 2, 3]           # the empty entry is left out
    assert [g["type"] for g in port["gids"]] == ["IB/RoCE v1", "RoCE v2", "IB/RoCE v1", "RoCE v2"]
    assert port["gids"][3]["ipv4"] == "192.0.2.1" and port["gids"][1]["ipv4"] is None
    assert devs["ib0"]["ports"][0]["state"] == "DOWN"
    choice = data["choice"]
    if not _verbs_built():
        assert "not built" in choice["error"] and "RoCE v2" in choice["rule"]
        return
    assert (choice["device"], choice["port"], choice["gid_index"]) == ("roce0", 1, want_gid)
    assert [g["index"] for g in port["gids"] if g["chosen"]] == [want_gid]
    assert ("FABRIC_VERBS_GID_INDEX=1" in choice["why"]) == bool(env)
    assert "IPv4-mapped" in choice["why"] or env


def test_rdma_choice_failure_names_what_was_tried(sysfs):
    if not _verbs_built():
        pytest.skip("the verbs backend is not built here")
    data = info.gather_rdma(str(sysfs), env={"FABRIC_VERBS_DEVICE": "ib0"})
    assert "ib0 port 1: state" in data["choice"]["error"]
    assert not any(g["chosen"] for d in data["devices"] for p in d["ports"] for g in p["gids"])


def test_no_rdma_devices(tmp_path):
    data = info.gather_rdma(str(tmp_path / "absent"), env={})
    assert data["devices"] == [] and data["message"] == f"no RDMA devices (no {tmp_path / 'absent'})"
    (tmp_path / "empty").mkdir()
    assert "is empty" in info.gather_rdma(str(tmp_path / "empty"), env={})["message"]


def test_text_report_marks_the_chosen_gid(sysfs, tmp_path):
    r = run_fabric(["info", "--sysfs", str(sysfs)], tmp_path)
    assert r.returncode == 0, r.stderr
    marked = [ln for ln in r.stdout.splitlines() if "<- verbs uses this" in ln]
    if _verbs_built():
        assert len(marked) == 1 and marked[0].split()[:2] == ["gid", "3"] and "RoCE v2" in marked[0]
        assert "verbs uses roce0 port 1 GID 3" in r.stdout
    else:
        assert marked == [] and "not built" in r.stdout


@pytest.mark.parametrize("n, text", [(0, "0"), (8, "8"), (1000, "1000"), (1536, "1536"), (65536, "64K"),
                                     (69632, "68K"), (16 << 20, "16M"), (3 << 30, "3G"), (1 << 40, "1T")])
def test_human_size(n, text):
    assert info.human_size(n) == text


def _fake_ucx_info(tmp_path, body):
    path = tmp_path / "bin" / "ucx_info"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def test_ucx_info_absent_failing_or_chatty(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(info, "_ucx_info_candidates", lambda libdir: [])
    got = info.run_ucx_info(None)
    assert got["path"] is None and got["transports"] == [] and "ucx_info not found" in got["error"]
    failing = _fake_ucx_info(tmp_path / "a", "echo 'cannot open libuct' >&2; exit 3\n")
    monkeypatch.setattr(info, "_ucx_info_candidates", lambda libdir: [(failing, None)])
    got = info.run_ucx_info(None)
    assert got["transports"] == [] and "exit 3" in got["error"] and "cannot open libuct" in got["error"]
    chatty = _fake_ucx_info(tmp_path / "b", "echo '#      Transport: tcp'; echo '#         Device: lo'\n"
                                            "echo '[1] UCX  WARN  something' >&2\n")
    monkeypatch.setattr(info, "_ucx_info_candidates", lambda libdir: [(chatty, str(tmp_path / "lib"))])
    got = info.run_ucx_info(None)
    assert got["error"] is None and got["transports"] == [{"transport": "tcp", "device": "lo"}]
    out, err = capfd.readouterr()
    assert out == "" and err == ""          # its stdout and stderr were captured, not passed through


def test_protocols_lists_each_size_range_once(tmp_path):
    tables = json.loads(run_fabric(["info", "--protocols", "--json", "-b", "tcp", "-o", "eager_limit=1000"],
                                   tmp_path).stdout)
    (t,) = tables
    rows = t["rows"]
    assert rows[0]["from"] == 0 and rows[-1]["to"] is None
    for a, b in zip(rows, rows[1:]):          # contiguous, no overlap
        assert b["from"] == a["to"] + 1
    assert [r["protocol"] for r in rows] == ["eager", "rendezvous"] and rows[0]["to"] == 1000
    text = run_fabric(["info", "--protocols"], tmp_path).stdout
    for name, (ok, _) in backends.available().items():
        assert (name in text) == ok
    if backends.available()["ucx"][0]:
        assert "error mode PEER" in text and "error mode NONE" in text
