"""Backend selection and the reasons given for unavailable backends."""
import pytest

import fabric
from fabric import backends


def test_auto_picks_a_usable_backend(monkeypatch):
    monkeypatch.delenv("FABRIC_BACKEND", raising=False)
    fab = fabric.Fabric()
    assert fab.name in backends.KNOWN


def test_environment_variable_selects(monkeypatch):
    monkeypatch.setenv("FABRIC_BACKEND", "tcp")
    assert fabric.Fabric().name == "tcp"


def test_unknown_backend_lists_what_exists():
    with pytest.raises(fabric.BackendUnavailable) as info:
        fabric.Fabric("carrier-pigeon")
    text = str(info.value)
    assert "carrier-pigeon" in text and "tcp: available" in text


@pytest.mark.parametrize("name", ["ucx", "verbs", "softroce"])
def test_unavailable_backends_say_why(name):
    key = "verbs" if name == "softroce" else name
    ok, reason = backends.available()[key]
    if ok:
        pytest.skip(f"{name} is available here")
    with pytest.raises(fabric.BackendUnavailable) as info:
        fabric.Fabric(name)
    assert reason in str(info.value) and "tcp: available" in str(info.value)


def test_address_parsing():
    from fabric.address import parse
    assert parse("127.0.0.1:5") == ("127.0.0.1", 5)
    assert parse("[::1]:80") == ("::1", 80)
    assert parse("tcp://h:1", "tcp") == ("h", 1)
    for bad in ["nohost", "::1:80", "h:99999", "[::1]80"]:
        with pytest.raises(ValueError):
            parse(bad)
    with pytest.raises(ValueError, match="names backend"):
        parse("ucx://h:1", "tcp")


def test_auto_prefers_ucx_only_when_configured(monkeypatch):
    from fabric.backends import auto_order
    monkeypatch.delenv("UCX_TLS", raising=False)
    assert auto_order() == ("verbs", "tcp")
    monkeypatch.setenv("UCX_TLS", "sm")
    assert auto_order() == ("verbs", "ucx", "tcp")


@pytest.mark.parametrize("ucx_tls", [None, "tcp"])
def test_explain_auto_agrees_with_get(monkeypatch, ucx_tls):
    from fabric import backends
    if ucx_tls:
        monkeypatch.setenv("UCX_TLS", ucx_tls)
    else:
        monkeypatch.delenv("UCX_TLS", raising=False)
    picked, steps = backends.explain_auto()
    assert picked == backends.get("auto").name
    assert sorted(name for name, _, _ in steps) == sorted(backends.KNOWN)
    assert [name for name, _, _ in steps][:len(backends.auto_order())] == list(backends.auto_order())
    statuses = dict((name, status) for name, status, _ in steps)
    assert statuses[picked] == "picked"
    assert (statuses["ucx"] == "skipped") == (ucx_tls is None)
    for name, status, why in steps:
        if status == "unusable":
            assert why == backends.available()[name][1]
            assert f"{name} unusable: {backends.short_reason(why)}" in backends.auto_reasons()
    assert backends.auto_summary().startswith(f"auto picks {picked}")
