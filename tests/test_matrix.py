"""Matrix scheduling and agent lifecycle on loopback hosts (ansible_connection: local).

Real agents, real probes, real reports; the sim tests (test_matrix_sim.py) add shaping
and MTU faults.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from itertools import chain

import pytest
from ports import free_port

from smolnet import agent_client as control
from smolnet.agent import Agent
from smolnet.matrix import directed_rounds, pair_rounds
from smoltrain.schema import check_any

SECRET = b"matrix-test-secret-0123456789"


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7])
def test_rounds_cover_every_ordered_pair_once_and_never_reuse_a_host(n):
    names = [f"h{i}" for i in range(n)]
    rounds = directed_rounds(names)
    flat = list(chain.from_iterable(rounds))
    assert sorted(flat) == sorted((a, b) for a in names for b in names if a != b)
    for r in rounds:
        used = list(chain.from_iterable(r))
        assert len(used) == len(set(used)), r
    assert len(pair_rounds(names)) == (n - 1 if n % 2 == 0 else n)
    assert len(rounds) == 2 * len(pair_rounds(names))
    seq = directed_rounds(names, sequential=True)
    assert all(len(r) == 1 for r in seq) and len(seq) == n * (n - 1)


def write_inventory(tmp_path, hosts: dict, port: int) -> str:
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET + b"\n")
    secret.chmod(0o600)
    lines = ["all:", "  children:", "    cluster:", "      hosts:"]
    for name, ip in hosts.items():
        lines.append(f"        {name}: {{cluster_ip: {ip}}}")
    lines += [
        "      vars:",
        "        ansible_connection: local",
        f"        smol_agent_port: {port}",
        f"        smol_secret_file: {secret}",
    ]
    p = tmp_path / "hosts.yml"
    p.write_text("\n".join(lines) + "\n")
    return str(p)


def smolnet(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "smolnet", *args], capture_output=True, text=True, timeout=timeout)


def port_free(ip: str, port: int) -> bool:
    s = socket.socket()
    try:
        s.settimeout(1)
        return s.connect_ex((ip, port)) != 0
    finally:
        s.close()


def test_matrix_loopback_with_unreachable_host(tmp_path):
    """ghost refuses SSH: its links are down with the reason, the rest still measured."""
    port = free_port("127.0.0.31", "127.0.0.32")
    inv = write_inventory(
        tmp_path,
        {"a": "127.0.0.31", "b": "127.0.0.32", "ghost": "127.0.0.42, ansible_connection: ssh, ansible_port: 1"},
        port,
    )
    out = tmp_path / "rep"
    p = smolnet(
        "matrix",
        "-i",
        inv,
        "--duration",
        "0.5",
        "--backend",
        "builtin",
        "--streams",
        "2",
        "--out",
        str(out),
        "--json",
        str(tmp_path / "copy.json"),
    )
    assert p.returncode == 4, p.stderr + p.stdout
    doc = json.loads((out / "links.json").read_text())
    from smolnet.report import validate_report

    assert validate_report(doc) == []
    assert (out / "links.md").exists() and (out / "links.png").stat().st_size > 0
    assert json.loads((tmp_path / "copy.json").read_text())["links"] == doc["links"]
    hosts = {h["name"]: h for h in doc["hosts"]}
    assert hosts["ghost"]["status"] == "down" and "connection refused" in hosts["ghost"]["error"]
    links = {(l["src"], l["dst"]): l for l in doc["links"]}
    assert len(links) == 6
    for pair in (("a", "ghost"), ("ghost", "a"), ("b", "ghost"), ("ghost", "b")):
        assert links[pair]["status"] == "down" and "ghost" in links[pair]["error"]
    for pair in (("a", "b"), ("b", "a")):
        l = links[pair]
        assert l["throughput_mbit"] > 10 and l["method"] == "builtin"
        assert l["rtt_us"]["p50"] > 0 and l["mtu_effective"] >= 1500
        assert l["status"] in ("ok", "degraded") and l["error"] is None
    assert "ghost: not measured" in (out / "links.md").read_text()
    # every agent the run started is gone
    assert port_free("127.0.0.31", port) and port_free("127.0.0.32", port)


def test_running_agent_is_reused_and_left_running(tmp_path):
    port = free_port("127.0.0.33", "127.0.0.34")
    inv = write_inventory(tmp_path, {"a": "127.0.0.33", "b": "127.0.0.34"}, port)
    mine = Agent("127.0.0.33", port, SECRET)
    mine.start_background()
    try:
        p = smolnet(
            "probe",
            "a",
            "b",
            "-i",
            inv,
            "--duration",
            "0.5",
            "--backend",
            "builtin",
            "--json",
            str(tmp_path / "p.json"),
        )
        assert p.returncode in (0, 4), p.stderr
        doc = json.loads((tmp_path / "p.json").read_text())
        assert [(l["src"], l["dst"]) for l in doc["links"]] == [("a", "b")]
        assert doc["links"][0]["throughput_mbit"] > 10
        assert mine.stats["accepted"] > 0  # the run used our agent ...
        assert control.call("127.0.0.33", port, SECRET, "ping")["ok"]  # ... and left it running
        assert port_free("127.0.0.34", port)  # but stopped the one it started
    finally:
        mine.stop()


def test_agent_with_another_secret_marks_host_down(tmp_path):
    port = free_port("127.0.0.35", "127.0.0.36")
    inv = write_inventory(tmp_path, {"a": "127.0.0.35", "b": "127.0.0.36"}, port)
    stranger = Agent("127.0.0.36", port, b"some-other-cluster-secret-xyz")
    stranger.start_background()
    try:
        p = smolnet("facts", "-i", inv, "--json", str(tmp_path / "f.json"))
        assert p.returncode == 4, p.stderr
        doc = json.loads((tmp_path / "f.json").read_text())
        check_any(doc)
        hosts = {h["name"]: h for h in doc["hosts"]}
        assert hosts["a"]["status"] == "ok" and hosts["a"]["facts"]["iface"] == "lo"
        assert hosts["b"]["status"] == "down" and "secret" in hosts["b"]["error"]
    finally:
        stranger.stop()


def test_ctrl_c_writes_partial_report_and_stops_agents(tmp_path):
    port = free_port("127.0.0.37", "127.0.0.38", "127.0.0.39")
    inv = write_inventory(tmp_path, {"a": "127.0.0.37", "b": "127.0.0.38", "c": "127.0.0.39"}, port)
    out = tmp_path / "rep"
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "smolnet",
            "matrix",
            "-i",
            inv,
            "--duration",
            "5",
            "--backend",
            "builtin",
            "--out",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        # readiness: every agent of the run is listening, so the run is measuring (or about to)
        while any(port_free(ip, port) for ip in ("127.0.0.37", "127.0.0.38", "127.0.0.39")):
            assert time.monotonic() < deadline and p.poll() is None, p.stderr.read() if p.poll() is not None else ""
            time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        stdout, stderr = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, stderr
    doc = json.loads((out / "links.json").read_text())
    assert doc["incomplete"] is True
    assert any(l["error"] and "interrupted" in l["error"] for l in doc["links"])
    for ip in ("127.0.0.37", "127.0.0.38", "127.0.0.39"):
        assert port_free(ip, port)


def test_bad_usage_exits_2(tmp_path):
    inv = write_inventory(tmp_path, {"a": "127.0.0.40", "b": "127.0.0.41"}, 7665)
    assert smolnet("matrix", "-i", inv, "--hosts", "a,nosuch").returncode == 2
    assert smolnet("matrix", "-i", inv, "--hosts", "a").returncode == 2
    assert smolnet("matrix", "-i", inv, "--duration", "0").returncode == 2
    assert smolnet("matrix", "-i", str(tmp_path / "missing.yml")).returncode == 2
    assert smolnet("probe", "a", "a", "-i", inv).returncode == 2


def test_host_dying_mid_run_is_down_with_reason(tmp_path):
    """c's agent (ours, reused by the run) vanishes during the throughput rounds."""
    port = free_port("127.0.0.43", "127.0.0.44", "127.0.0.45")
    inv = write_inventory(tmp_path, {"a": "127.0.0.43", "b": "127.0.0.44", "c": "127.0.0.45"}, port)
    victim = Agent("127.0.0.45", port, SECRET)
    victim.start_background()

    def kill_when_loaded():
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if victim.ops.get("sink_open", 0) + victim.ops.get("throughput", 0) >= 1:
                victim.stop()
                return
            time.sleep(0.05)

    t = threading.Thread(target=kill_when_loaded, daemon=True)
    t.start()
    try:
        out = tmp_path / "rep"
        p = smolnet(
            "matrix", "-i", inv, "--duration", "0.5", "--backend", "builtin", "--streams", "2", "--out", str(out)
        )
    finally:
        victim.stop()
    assert p.returncode == 4, p.stderr
    doc = json.loads((out / "links.json").read_text())
    assert doc["incomplete"] is False
    links = {(l["src"], l["dst"]): l for l in doc["links"]}
    assert links[("a", "b")]["throughput_mbit"] > 10 and links[("b", "a")]["throughput_mbit"] > 10
    gone = [l for k, l in links.items() if "c" in k and l["status"] == "down"]
    assert gone and all("c" in l["error"] for l in gone)
    assert any("stopped answering" in l["error"] for l in gone)
