"""Every test sits in one tier, and no skip can hide a regression."""

from __future__ import annotations

import re
from pathlib import Path

import need
import pytest
from conftest import FILE_TIER, LOCAL_PLAYBOOKS, NOT_QUIET, QUIET, SIM_FILES, TIER_NAMES, TIERS

HERE = Path(__file__).resolve().parent
# The only skips allowed outside tests/need.py: a parametrisation that does not apply.
ALLOWED_SKIPS = {
    ("test_comm.py", "only the socket backend sees its own framing"),
    # a machine with one CPU cannot give two hosts a core each; no install fixes that
    ("test_sim_hidden.py", "one CPU: the cores scenario has a single host"),
}


def test_every_test_file_is_in_exactly_one_tier():
    files = sorted(p.name for p in HERE.glob("test_*.py"))
    listed = [f for fs in TIERS.values() for f in fs]
    assert sorted(set(listed)) == sorted(listed), "a file is in two tiers"
    assert sorted(set(files) - set(FILE_TIER)) == [], "files without a tier"
    assert sorted(set(FILE_TIER) - set(files)) == [], "tiers name files that do not exist"
    assert set(TIERS) == set(TIER_NAMES)
    assert sorted(QUIET - set(files)) == [], "QUIET names files that do not exist"
    for node in NOT_QUIET:  # a test of a QUIET file, defined there
        f, test = node.split("::")
        assert f in QUIET and f"\ndef {test}(" in (HERE / f).read_text(), node


def test_every_collected_test_has_a_tier(request):
    """Read off this session's own items (`make test`: every test), not a second collection of
    the whole suite (6 s); a file without a tier stops any collection (conftest)."""
    items = request.session.items
    assert request.node in items
    assert [i.nodeid for i in items if not any(i.get_closest_marker(t) for t in TIER_NAMES)] == []
    # a sim or provision test runs on the pytest-xdist worker that runs every sim (conftest.SIM_FILES),
    # unless its playbooks run only against this machine (conftest.LOCAL_PLAYBOOKS)
    sims = {i.path.name for i in items if i.get_closest_marker("sim") or i.get_closest_marker("provision")}
    assert sorted(sims - SIM_FILES - LOCAL_PLAYBOOKS) == [], "sim tests outside conftest.SIM_FILES"
    assert LOCAL_PLAYBOOKS.issubset(TIERS["provision"]) and not LOCAL_PLAYBOOKS & SIM_FILES


def test_no_skip_can_hide_a_regression():
    found = []
    for path in sorted(HERE.glob("*.py")):
        if path.name in ("need.py", "test_tiers.py"):
            continue
        text = path.read_text()
        assert "importorskip" not in text, f"{path.name}: importorskip turns an import crash into a skip"
        assert "skipif(" not in text, f"{path.name}: use tests/need.py (skip only without root)"
        for m in re.finditer(r"pytest\.skip\(\s*\"([^\"]*)\"", text):
            found.append((path.name, m.group(1)))
        for _ in re.finditer(r"pytest\.skip\((?!\s*\")", text):
            pytest.fail(f"{path.name}: pytest.skip with a computed reason; use tests/need.py")
    assert set(found) <= ALLOWED_SKIPS, set(found) - ALLOWED_SKIPS


def _unavailable(monkeypatch, euid):
    from smolnet.sim import net

    monkeypatch.setattr(net, "unavailable_reason", lambda: "tc is not installed")
    monkeypatch.setattr(need.os, "geteuid", lambda: euid)


def test_a_sim_that_cannot_run_fails_as_root(monkeypatch):
    _unavailable(monkeypatch, 0)
    with pytest.raises(pytest.fail.Exception, match="tc is not installed.*make system-deps"):
        need.need_sim()


def test_a_sim_that_cannot_run_skips_without_root(monkeypatch):
    _unavailable(monkeypatch, 1000)
    with pytest.raises(pytest.skip.Exception, match="tc is not installed"):
        need.need_sim()


def test_a_missing_tool_fails_as_root_and_skips_otherwise(monkeypatch):
    monkeypatch.setattr(need.shutil, "which", lambda name: None)
    monkeypatch.setattr(need.os, "geteuid", lambda: 0)
    with pytest.raises(pytest.fail.Exception, match="iperf3 is not installed"):
        need.need_tool("iperf3")
    monkeypatch.setattr(need.os, "geteuid", lambda: 1000)
    with pytest.raises(pytest.skip.Exception):
        need.need_tool("iperf3")


def test_ports_are_free_on_every_address():
    import socket

    from ports import free_port

    port = free_port("127.0.0.1", "127.0.0.2")
    for addr in ("127.0.0.1", "127.0.0.2"):
        with socket.socket() as s:
            s.bind((addr, port))
