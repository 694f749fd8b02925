"""calibration.wire_probe: a ring over the hosts' own addresses measures each host's message cost."""

from __future__ import annotations

import subprocess
import sys

from smolnet.inventory import Host
from smoltrain.calibration.wire_probe import apply
from smoltrain.comm.group import free_port_base

LOOPBACK = {"message_s": 1.0, "bytes_s": 1.0}  # far from any real figure: a kept one shows


def _hosts(n: int, python: str = sys.executable) -> list[Host]:
    return [Host(f"h{i}", "127.0.0.1", "127.0.0.1", local=True, python=python) for i in range(n)]


def _doc(hosts) -> dict:
    return {"hosts": [{"name": h.name, "status": "ok", "error": None, "comm_cpu": dict(LOOPBACK)} for h in hosts]}


def test_a_ring_of_three_hosts_replaces_each_loopback_figure():
    hosts, said = _hosts(3), []
    doc = _doc(hosts)
    apply(hosts, doc, lambda n, w: said.append((n, w)), port=free_port_base(3))
    for d in doc["hosts"]:
        assert d["comm_cpu_loopback"] == LOOPBACK
        assert 0 < d["comm_cpu"]["message_s"] < 0.1  # a loopback all-reduce step: microseconds, not a second
        assert d["comm_cpu"]["bytes_s"] == LOOPBACK["bytes_s"]  # a CPU's copy rate: the loopback figure
    assert "wire_probe" in doc["settings"]["comm_cpu"]
    assert sorted(n for n, _ in said) == ["h0", "h1", "h2"]


def test_a_failed_ring_keeps_the_loopback_figures_and_says_why():
    hosts, said = _hosts(2, python="/bin/false"), []
    doc = _doc(hosts)
    apply(hosts, doc, lambda n, w: said.append(w), port=free_port_base(2))
    assert [d["comm_cpu"] for d in doc["hosts"]] == [LOOPBACK, LOOPBACK]
    assert "comm_cpu_loopback" not in doc["hosts"][0]
    assert len(said) == 1 and "loopback figures kept" in said[0]


def test_one_host_is_not_a_ring():
    hosts = _hosts(1)
    doc = _doc(hosts)
    apply(hosts, doc)
    assert doc["hosts"][0]["comm_cpu"] == LOOPBACK and "settings" not in doc


def test_bad_input_is_one_line_and_exit_2():
    argv = ["--rank", "0", "--addrs", "127.0.0.1", "--port", "1"]
    p = subprocess.run(
        [sys.executable, "-m", "smoltrain.calibration.wire_probe", *argv],
        input=b"",
        capture_output=True,
        timeout=60,
    )
    assert p.returncode == 2
    assert len(p.stderr.decode().strip().splitlines()) == 1
