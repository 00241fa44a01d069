"""Knobs: precedence, validation, tuning profiles."""
import json
import warnings

import pytest

import fabric
from fabric import options


def test_precedence_defaults_profile_env_kwargs(tmp_path, monkeypatch):
    profile = tmp_path / "tuning.json"
    options.write_profile("tcp", {"eager_limit": 12345, "chunk_size": "1M"}, path=str(profile))
    monkeypatch.setenv("FABRIC_PROFILE", str(profile))
    monkeypatch.setenv("FABRIC_CHUNK_SIZE", "2M")
    opts = options.resolve("tcp", {"eager_limit": 1, "credits": 16}, {"credits": 64})
    assert opts["eager_limit"] == 12345          # profile beats backend default
    assert opts["chunk_size"] == 2 << 20         # environment beats profile
    assert opts["credits"] == 64                 # keyword beats all


def test_fabric_uses_resolved_options(monkeypatch):
    monkeypatch.setenv("FABRIC_PROFILE", "none")
    monkeypatch.setenv("FABRIC_EAGER_LIMIT", "8K")
    fab = fabric.Fabric("tcp", credits=12)
    assert fab.options["eager_limit"] == 8192 and fab.options["credits"] == 12


@pytest.mark.parametrize("name, value", [("eager_limit", "lots"), ("credits", 1), ("chunk_size", 10),
                                         ("spin_us", -1)])
def test_invalid_values_name_the_knob(name, value):
    with pytest.raises(ValueError, match=name):
        options.parse_value(name, value)


def test_unknown_option_is_refused():
    with pytest.raises(ValueError, match="unknown fabric option"):
        fabric.Fabric("tcp", eager_limt=5)


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": "something-else"}),
                                     json.dumps({"format": "fabric-tuning", "version": 99}),
                                     json.dumps({"format": "fabric-tuning", "version": 1,
                                                 "backends": {"tcp": {"options": {"credits": "x"}}}})])
def test_corrupt_or_foreign_profile_warns_and_falls_back(tmp_path, content):
    path = tmp_path / "tuning.json"
    path.write_text(content)
    with pytest.warns(RuntimeWarning, match="ignoring fabric tuning profile"):
        assert options.read_profile("tcp", str(path)) == {}


def test_missing_profile_is_silent(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert options.read_profile("tcp", str(tmp_path / "absent.json")) == {}


def test_write_profile_keeps_other_backends(tmp_path):
    path = str(tmp_path / "p.json")
    options.write_profile("tcp", {"eager_limit": 100}, path=path)
    options.write_profile("ucx", {"eager_limit": 200}, path=path)
    assert options.read_profile("tcp", path) == {"eager_limit": 100}
    assert options.read_profile("ucx", path) == {"eager_limit": 200}


def test_sources_name_the_layer_each_value_came_from(tmp_path, monkeypatch):
    profile = tmp_path / "tuning.json"
    options.write_profile("tcp", {"eager_limit": 12345, "chunk_size": "1M"}, path=str(profile))
    monkeypatch.setenv("FABRIC_PROFILE", str(profile))
    monkeypatch.setenv("FABRIC_CHUNK_SIZE", "2M")
    backend_defaults, overrides = {"eager_limit": 1, "credits": 16, "send_buffers": 3}, {"credits": 64}
    got = options.resolve_sources("tcp", backend_defaults, overrides)
    assert got["eager_limit"] == (12345, "profile")
    assert got["chunk_size"] == (2 << 20, "env")
    assert got["credits"] == (64, "argument")
    assert got["send_buffers"] == (3, "backend")
    assert got["spin_us"] == (options.COMMON_DEFAULTS["spin_us"], "default")
    assert set(got) == set(options.KNOBS)
    assert {source for _, source in got.values()} <= set(options.SOURCES)
    # the same values, in the same order, as resolve()
    assert {k: v for k, (v, _) in got.items()} == options.resolve("tcp", backend_defaults, overrides)
    assert list(got) == list(options.resolve("tcp", backend_defaults, overrides))
    monkeypatch.setenv("FABRIC_CREDITS", "many")
    with pytest.raises(ValueError, match="credits"):
        options.resolve_sources("tcp", {}, {})


def test_every_knob_has_a_one_line_help():
    assert set(options.HELP) == set(options.KNOBS)
    assert all(text and "\n" not in text for text in options.HELP.values())
