"""The perf tool: argument handling, the JSON it writes, plots, the tuner's
decision rule, and the model tables of the deep-learning replay."""
import json
import math
import os
import sys

import pytest

from fabric.perf import cli, tune

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import models  # noqa: E402


@pytest.mark.parametrize("text,sizes", [
    ("1-16", [1, 2, 4, 8, 16]),
    ("3-16", [4, 8, 16]),
    ("1K-4K", [1024, 2048, 4096]),
    ("8,4K,1M", [8, 4096, 1 << 20]),
    ("0,1", [0, 1]),
    ("64M", [64 << 20]),
])
def test_sizes(text, sizes):
    assert cli.parse_sizes(text) == sizes


@pytest.mark.parametrize("text", ["", "16-1", "0-8", "x", "8,,y", "-5"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(ValueError):
        cli.parse_sizes(text)


def test_rpc_pairs():
    assert cli.parse_rpc(None, [8, 1024]) == [(64, 8), (64, 1024), (8, 64), (1024, 64)]
    assert cli.parse_rpc("64:1M,4K:4K", []) == [(64, 1 << 20), (4096, 4096)]
    with pytest.raises(ValueError):
        cli.parse_rpc("64-1M", [])


@pytest.mark.parametrize("argv,message", [
    (["-t", "lat,nope"], "unknown test 'nope'"),
    (["--protocol", "magic"], "unknown protocol 'magic'"),
    (["--window", "0"], "--window must be at least 1"),
    (["--scale", "0"], "--scale must be positive"),
    (["-s", "16-1"], "bad size range"),
    (["--eager-limit", "lots"], "eager_limit"),
    (["--tune", "-b", "tcp,ucx"], "--tune takes one backend"),
])
def test_bad_arguments_exit_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_protocol_knobs():
    assert cli.protocol_knobs("auto", {"chunk_size": 1 << 20}) == {"chunk_size": 1 << 20}
    assert cli.protocol_knobs("eager", {})["eager_limit"] == cli.EAGER_MAX
    assert cli.protocol_knobs("eager", {"eager_limit": 4096})["eager_limit"] == 4096
    assert cli.protocol_knobs("rendezvous", {"eager_limit": 4096})["eager_limit"] == 0


@pytest.mark.timeout(120)
def test_small_sweep_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = cli.main(["-b", "tcp", "-t", "lat,bw,rate,rpc", "-s", "8,64K", "--rpc", "64:64K",
                   "--protocol", "auto,rendezvous", "--scale", "0.01", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "tcp/auto lat" in printed and "tcp/rendezvous bw" in printed
    assert printed.splitlines()[0] == "backend: tcp (-b tcp)"
    # sizes in human units under a header with units; lat says what it measures
    lat = printed.split("tcp/auto lat: ", 1)[1].splitlines()
    assert lat[0].startswith("round-trip time in us")
    assert lat[1].split()[:3] == ["size", "(B)", "proto"] and "p50 (us)" in lat[1]
    assert [row.split()[0] for row in lat[2:4]] == ["8", "64K"]
    rpc = printed.split("tcp/auto rpc: ", 1)[1].splitlines()
    assert rpc[2].split()[:2] == ["64", "64K"]
    doc = json.loads(out.read_text())
    assert doc["tool"] == "fabric-perf" and doc["schema"] == cli.SCHEMA
    assert {"host", "cpus", "python", "platform"} <= set(doc["machine"])
    assert doc["versions"]["backends"]["tcp"]["available"] is True
    assert [r["label"] for r in doc["runs"]] == ["tcp/auto", "tcp/rendezvous"]
    auto, rndv = doc["runs"]
    assert rndv["thresholds"]["eager_limit_effective"] == 0
    assert auto["thresholds"]["eager_limit_effective"] >= 65536
    assert [r["protocol"] for r in auto["lat"]] == ["eager", "eager"]
    assert [r["protocol"] for r in rndv["lat"]] == ["rendezvous", "rendezvous"]
    for run in doc["runs"]:
        assert [r["size"] for r in run["lat"]] == [8, 65536]
        assert all(0 < r["p50_us"] <= r["p99_us"] <= r["max_us"] for r in run["lat"])
        assert all(r["MBps"] > 0 and r["iterations"] >= 8 for r in run["bw"])
        assert [r["size"] for r in run["rate"]] == [8, 65536]
        assert all(r["msgs_per_s"] > 0 and r["msgs_per_s_no_coalescing"] > 0 for r in run["rate"])
        assert [(r["request"], r["response"]) for r in run["rpc"]] == [(64, 65536)]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # plotting earlier results together, without measuring
    png2 = tmp_path / "merged.png"
    assert cli.main(["--from", str(out), str(out), "--plot", str(png2)]) == 0
    assert png2.stat().st_size > 1000


def test_from_refuses_foreign_json(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"tool": "something else"}))
    with pytest.raises(SystemExit, match="not a fabric-perf result"):
        cli.main(["--from", str(bad), "--plot", str(tmp_path / "x.png")])


def test_tuner_keeps_the_default_unless_a_candidate_clearly_wins():
    score = (lambda r: r["x"])
    # a 20% better candidate that wins every round is taken
    raw = {"default": [{"x": 100}] * 5, "fast": [{"x": 120}] * 5}
    assert tune.decide(raw, "default", score)[0] == "fast"
    # within the margin: the default stays
    raw = {"default": [{"x": 100}] * 5, "close": [{"x": 103}] * 5}
    assert tune.decide(raw, "default", score)[0] == "default"
    # a better median from one lucky round does not count
    raw = {"default": [{"x": 100}, {"x": 100}, {"x": 100}, {"x": 100}, {"x": 100}],
           "lucky": [{"x": 300}, {"x": 300}, {"x": 200}, {"x": 90}, {"x": 90}]}
    assert tune.decide(raw, "default", score)[0] == "lucky"        # wins 3 of 5 rounds, median 200
    raw["lucky"] = [{"x": 300}, {"x": 300}, {"x": 90}, {"x": 90}, {"x": 90}]
    assert tune.decide(raw, "default", score)[0] == "default"      # wins 2 of 5
    # a better average that hides a slower size is refused
    raw = {"default": [{"x": 100, "a": 50, "b": 50}] * 5, "uneven": [{"x": 130, "a": 100, "b": 30}] * 5}
    assert tune.decide(raw, "default", score)[0] == "default"
    # lower is better (latencies)
    raw = {"default": [{"x": 100}] * 3, "quick": [{"x": 50}] * 3}
    assert tune.decide(raw, "default", score, higher_is_better=False)[0] == "quick"
    raw = {"default": [{"x": 100, "a": 50}] * 3, "mixed": [{"x": 50, "a": 60}] * 3}
    assert tune.decide(raw, "default", score, higher_is_better=False)[0] == "default"


def test_tune_dry_run_needs_no_profile_and_refuses_profile_none(monkeypatch):
    monkeypatch.setenv("FABRIC_PROFILE", "none")
    with pytest.raises(SystemExit, match="FABRIC_PROFILE=none"):
        tune.main("tcp", {}, profile=None, dry_run=False)


@pytest.mark.parametrize("model", sorted(models.MODELS))
def test_model_tables_match_published_parameter_counts(model):
    assert models.parameter_count(model) == models.PUBLISHED_TOTALS[model]


def test_model_tables_have_the_published_layer_structure():
    assert len(models.tensors("resnet50")) == 161          # 53 conv + 53 bn x2 + fc x2
    assert len(models.tensors("vgg16")) == 32              # 13 conv + 3 fc, weight and bias each
    assert len(models.tensors("inception_v3")) == 378      # 94 conv + 94 bn x3 + dense x2
    biggest = max(models.tensors("vgg16"), key=lambda t: math.prod(t[1]))
    assert biggest == ("classifier.0.weight", (4096, 25088))
    assert dict(models.tensors("resnet50"))["fc.weight"] == (1000, 2048)
    assert dict(models.tensors("inception_v3"))["predictions/kernel"] == (2048, 1000)
    with pytest.raises(ValueError, match="unknown model"):
        models.tensors("alexnet")


def test_size_classes():
    assert models.size_class(4) == "<=4K"
    assert models.size_class(4096) == "<=4K"
    assert models.size_class(4097) == "4K-64K"
    assert models.size_class(1 << 20) == "64K-1M"
    assert models.size_class(400 << 20) == ">16M"


@pytest.mark.timeout(120)
def test_server_and_connect_modes(tmp_path):
    """fabric-perf --server on one side, --connect on the other (as across hosts)."""
    import subprocess
    server = subprocess.Popen([sys.executable, "-m", "fabric.perf", "--server", "127.0.0.1:0", "-b", "tcp"],
                              stdout=subprocess.PIPE, text=True)
    try:
        address = server.stdout.readline().strip()
        assert address.startswith("127.0.0.1:")
        out = tmp_path / "c.json"
        assert cli.main(["--connect", address, "-b", "tcp", "-t", "lat,rpc", "-s", "8,4K", "--rpc", "8:4K",
                         "--scale", "0.01", "--json", str(out)]) == 0
        doc = json.loads(out.read_text())
        run = doc["runs"][0]
        assert run["peer"] == address and run["spawned_peer"] is False
        assert [r["size"] for r in run["lat"]] == [8, 4096] and run["rpc"][0]["response"] == 4096
        # a second client after the first left: the server serves one at a time, then the next
        assert cli.main(["--connect", address, "-b", "tcp", "-t", "lat", "-s", "8", "--scale", "0.01"]) == 0
    finally:
        server.kill()
        server.wait()


def test_list_backends(capsys):
    import fabric
    from fabric import backends
    assert cli.main(["--list-backends"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"backends (auto picks {backends.get('auto').name})"
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines()[1:] if ln.split()[0] in backends.KNOWN}
    assert set(rows) == set(backends.KNOWN)
    for name, (ok, reason) in fabric.available_backends().items():
        assert rows[name][1] == ("yes" if ok else "no")
        assert short(reason) in " ".join(rows[name][3:])


def short(reason):
    return " ".join(reason.split()[:4])


def test_version(capsys):
    import fabric
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"fabric-perf {fabric.__version__}\n"


def test_every_knob_flag_has_help():
    from fabric.options import HELP, env_name
    actions = {a.dest: a for a in cli.build_parser()._actions}
    for k in cli.KNOB_FLAGS:
        assert actions[k].help and HELP[k] in actions[k].help and env_name(k) in actions[k].help, k
    for a in actions.values():
        assert a.help, a.dest


def test_backend_line_says_why(monkeypatch):
    from fabric import backends
    monkeypatch.delenv("FABRIC_BACKEND", raising=False)
    monkeypatch.delenv("UCX_TLS", raising=False)
    reason = cli.backend_reason(None)
    assert reason.startswith("auto: ")
    assert "skipped" not in reason              # auto tries every backend, fastest first
    if not backends.available()["verbs"][0]:
        assert "verbs unusable: " + backends.short_reason(backends.available()["verbs"][1]) in reason
    assert cli.backend_reason("auto") == reason
    assert cli.backend_reason("tcp") == "-b tcp"
    monkeypatch.setenv("FABRIC_BACKEND", "tcp")
    assert cli.backend_reason(None) == "FABRIC_BACKEND=tcp"


@pytest.mark.timeout(120)
def test_auto_run_names_its_backend_and_why_first(monkeypatch, capsys):
    from fabric import backends
    monkeypatch.delenv("FABRIC_BACKEND", raising=False)
    monkeypatch.delenv("UCX_TLS", raising=False)
    assert cli.main(["-t", "lat", "-s", "8", "--scale", "0.01"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"backend: {backends.get('auto').name} (auto: ")
    if not backends.available()["verbs"][0]:
        assert "verbs unusable" in first


def test_plot_without_matplotlib_fails_before_measuring(tmp_path, monkeypatch):
    png = tmp_path / "r.png"
    monkeypatch.setitem(sys.modules, "matplotlib", None)          # import matplotlib now raises ImportError

    def measured(*a, **kw):
        raise AssertionError("measured although the plot cannot be written")
    monkeypatch.setattr(cli, "measure_runs", measured)
    with pytest.raises(SystemExit) as exc:
        cli.main(["-b", "tcp", "-t", "lat", "-s", "8", "--plot", str(png)])
    assert "needs matplotlib" in str(exc.value.code) and "pip install matplotlib" in str(exc.value.code)
    assert not png.exists()


@pytest.mark.timeout(120)
def test_plot_without_matplotlib_in_a_fresh_process(tmp_path):
    """The same from the command line: exit 1, the reason on stderr, nothing
    measured (no backend line, no table on stdout)."""
    import subprocess
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from fabric.perf.cli import main\n"
            f"sys.exit(main(['-b', 'tcp', '-t', 'lat,bw', '-s', '8,1M', '--plot', {str(tmp_path / 'r.png')!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "fabric-perf --plot needs matplotlib" in r.stderr
    assert r.stdout == ""


def _fake_checkout(tmp_path):
    """A checkout with the real tools/perf.sh, a stub tools/setup.sh that
    logs its calls (and, like the real one, writes the stamp at its end and
    prints on stdout), a real venv whose fabric is this checkout's stub
    package, and a stub fabric-perf."""
    import subprocess
    root = tmp_path / "repo"
    (root / "tools").mkdir(parents=True)
    (root / "tools" / "perf.sh").write_text(open(os.path.join(REPO, "tools", "perf.sh")).read())
    (root / "tools" / "setup.sh").write_text(
        'cd "$(dirname "$0")/.."\necho "setup $*" >> setup.log\necho "set-up chatter on stdout"\n'
        'touch .venv/.fabric-setup-stamp\n')
    (root / "fabric").mkdir()
    (root / "fabric" / "__init__.py").write_text("")
    (root / "fabric" / "engine.pyx").write_text("# a build input\n")
    (root / "setup.py").write_text("")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / ".venv")], check=True, timeout=60)
    site = subprocess.run([str(root / ".venv" / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "fabric_checkout.pth"), "w") as f:
        f.write(str(root) + "\n")                              # as an editable install does
    perf = root / ".venv" / "bin" / "fabric-perf"
    perf.write_text('#!/bin/sh\necho "fabric-perf $*"\n')
    perf.chmod(0o755)
    return root


def _perf_sh(root, *args):
    import subprocess
    r = subprocess.run(["bash", str(root / "tools" / "perf.sh"), *args], capture_output=True, text=True,
                       timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr
    calls = (root / "setup.log").read_text().splitlines() if (root / "setup.log").exists() else []
    return r.stdout, calls


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(120)
def test_perf_sh_runs_set_up_only_when_the_build_is_stale(tmp_path):
    root = _fake_checkout(tmp_path)
    # no stamp yet: set-up runs, in the perf mode, its stdout kept out of ours
    out, calls = _perf_sh(root, "-t", "lat")
    assert calls == ["setup perf"] and out == "fabric-perf -t lat\n"
    # current: no set-up
    out, calls = _perf_sh(root, "--version")
    assert calls == ["setup perf"] and out == "fabric-perf --version\n"
    # a build input newer than the stamp: one set-up, then current again
    stamp = root / ".venv" / ".fabric-setup-stamp"

    def edit(name):
        """Files older than the stamp, the stamp older than `name` (edited now)."""
        import time
        now = time.time()
        for p in (root / "fabric" / "engine.pyx", root / "fabric" / "__init__.py", root / "setup.py"):
            os.utime(p, (now - 200, now - 200))
        os.utime(stamp, (now - 100, now - 100))
        os.utime(root / name, (now, now))
    runs = 1
    for name in ("fabric/engine.pyx", "setup.py"):
        edit(name)
        runs += 1
        assert len(_perf_sh(root)[1]) == runs, name
        assert len(_perf_sh(root)[1]) == runs, name
    # fabric no longer imports in the venv
    (root / "fabric" / "__init__.py").write_text("raise ImportError('broken build')\n")
    assert len(_perf_sh(root)[1]) == runs + 1
    (root / "fabric" / "__init__.py").write_text("")
    # an edited .py is not a build input (the install is editable)
    edit("fabric/__init__.py")
    assert len(_perf_sh(root)[1]) == runs + 1
    runs += 1
    # no stamp (a set-up that did not finish)
    stamp.unlink()
    assert len(_perf_sh(root)[1]) == runs + 1


def test_perf_and_test_set_up_modes():
    """perf.sh asks for the perf set-up, which leaves out the Soft-RoCE guest's
    packages; test.sh keeps the full one."""
    perf = open(os.path.join(REPO, "tools", "perf.sh")).read()
    test = open(os.path.join(REPO, "tools", "test.sh")).read()
    setup = open(os.path.join(REPO, "tools", "setup.sh")).read()
    assert "bash tools/setup.sh perf" in perf and "bash tools/setup.sh test" in test
    guest = setup.split('if [ "$LEAN" = 0 ] && [ "${FABRIC_SOFTROCE:-1}" != 0 ]; then', 1)[1].split("fi", 1)[0]
    assert "qemu-system-x86" in guest and "linux-image-amd64" in guest
    assert setup.rstrip().splitlines()[-1].startswith("echo") and ".fabric-setup-stamp" in setup.splitlines()[-1]


def test_perf_modules_import_without_a_cycle():
    """fabric.perf's layering: common <- measure/wire <- tune <- cli; tune
    never imports the CLI."""
    import ast
    import pathlib
    root = pathlib.Path(cli.__file__).parent
    imported = {}
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == "fabric.perf":
                    names.update(a.name for a in node.names)
                elif node.module.startswith("fabric.perf."):
                    names.add(node.module.rsplit(".", 1)[1])
        imported[path.stem] = names
    assert "cli" not in imported["tune"] and "cli" not in imported["common"], imported

    def reaches(a, b, seen=()):
        return any(n == b or (n not in seen and reaches(n, b, seen + (n,))) for n in imported.get(a, ()))
    for mod in imported:
        assert not reaches(mod, mod), f"fabric.perf.{mod} imports itself through {imported}"
