"""The matrix on the sim: shaped truths, the silent jumbo mismatch, a slow uplink, a host
that does not exist, and MTU exactness on the mtu-lab switch.

Needs root and network namespaces; skips cleanly without them. Sims "m1" (home) and
"m2" (mtu-lab) use their own subnets and are always torn down.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import yaml

pytestmark = pytest.mark.sim

from need import sim_up  # noqa: E402

from smolnet.sim import cluster as sim  # noqa: E402
from smolnet.sim.scenarios import HostSpec  # noqa: E402

LOW, HIGH = 0.85, 1.10  # shaped goodput, tests; bench/bench_probe.py measures the 5 % bar
MTU_TOLERANCE = 8


def _spec(h: dict) -> HostSpec:
    return HostSpec(**{f.name: h[f.name] for f in dataclasses.fields(HostSpec)})


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    d = tmp_path_factory.mktemp("m1")
    inv = d / "m1.yml"
    st = sim_up(sim, name="m1", scenario="home", subnet="10.213.11.0/24", inventory=str(inv))
    try:
        yield st, inv
    finally:
        sim.down(name="m1")


@pytest.fixture(scope="module")
def home_report(home, tmp_path_factory):
    """One matrix run over the home scenario plus `ghost`, an inventory host with no machine."""
    st, inv = home
    doc = yaml.safe_load(inv.read_text())
    hosts = doc["all"]["children"]["cluster"]["hosts"]
    hosts["ghost"] = dict(hosts["pi5"], ansible_host="10.213.11.50", cluster_ip="10.213.11.50")
    ghost_inv = inv.with_name("m1-ghost.yml")
    ghost_inv.write_text(yaml.safe_dump(doc, sort_keys=False))
    out = tmp_path_factory.mktemp("m1rep")
    p = subprocess.run(
        [sys.executable, "-m", "smolnet", "matrix", "-i", str(ghost_inv), "--duration", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    report = json.loads((out / "links.json").read_text())
    return st, p, report, out


def test_home_matrix_exit_and_schema(home_report):
    from smolnet.report import validate_report

    _, p, rep, out = home_report
    assert p.returncode == 4, p.stderr[-2000:]
    assert validate_report(rep) == []
    assert (out / "links.png").stat().st_size > 10_000
    md = (out / "links.md").read_text()
    assert "macmini <-> laptop: both ends are set to 9000 but the path carries 1500" in md


def test_home_shaped_goodput_matches_truth(home, home_report):
    """Sender-paced directions within tolerance of the shaped truth.

    The matrix runs two tests at once on a CPU shared with the rest of CI; a direction
    that misses (low or high) is re-measured alone (at most twice) before it counts as a
    failure, so load spikes do not flake while a wrong count (sender side, warm-up, units)
    still fails.
    """
    from smolnet import inventory, secret
    from smolnet.matrix import AgentPool, default_secret_path
    from smolnet.probes.request import probe_throughput

    st, _, rep, _ = home_report
    specs = {h["name"]: _spec(h) for h in st["hosts"]}
    links = {(l["src"], l["dst"]): l for l in rep["links"]}
    checked, retry = 0, []
    for (a, b), l in links.items():
        if a not in specs or b not in specs:
            continue
        truth = sim.path_truth(specs[a], specs[b])
        if truth["blackhole"]:
            continue
        # Only sender-paced directions: where a faster sender overruns a slower switch port,
        # the sim's short tbf queue drops and TCP's result swings (see BENCHMARKS.md).
        if specs[a].up_mbit > specs[b].down_mbit:
            continue
        # A load spike can stretch or shrink a short measurement window either way, so a
        # miss on either side is re-measured alone; a consistent miss still fails below.
        if not LOW * truth["goodput_mbit"] <= l["throughput_mbit"] <= HIGH * truth["goodput_mbit"]:
            retry.append((a, b, truth["goodput_mbit"]))
        assert abs(l["mtu_effective"] - truth["mtu_effective"]) <= MTU_TOLERANCE, (a, b, l["mtu_effective"])
        assert l["rtt_us"]["p50"] > 0 and l["error"] is None
        checked += 1
    assert checked >= 7
    if not retry:
        return
    hosts = inventory.load_inventory(home[1]).hosts
    pool = AgentPool(secret.ensure_secret(default_secret_path(hosts)))
    try:
        pool.ensure_all(hosts)
        for a, b, want in retry:
            got = []
            for _ in range(2):
                x = probe_throughput(pool.endpoints[a], pool.endpoints[b], pool.secret, 2.0)["throughput_mbit"]
                got.append(x)
                if LOW * want <= x <= HIGH * want:
                    break
            else:
                pytest.fail(f"{a} -> {b}: {got} Mbit/s, shaped truth {want:.1f}")
    finally:
        pool.stop_all()


def test_home_faults_flagged(home_report):
    _, _, rep, _ = home_report
    links = {(l["src"], l["dst"]): l for l in rep["links"]}
    for pair in (("macmini", "laptop"), ("laptop", "macmini")):
        l = links[pair]
        assert l["status"] != "ok" and {"mtu-mismatch", "mtu-blackhole"} & set(l["warnings"]), l
        assert l["mtu_configured"] == 9000 and l["mtu_effective"] <= 1500 + MTU_TOLERANCE
    for dst in ("pi5", "laptop"):
        l = links[("jetson", dst)]
        assert "asymmetric" in l["warnings"] and l["status"] == "degraded", l
        assert "asymmetric" not in links[(dst, "jetson")]["warnings"]


def test_home_ghost_down_rest_measured(home_report):
    _, _, rep, _ = home_report
    hosts = {h["name"]: h for h in rep["hosts"]}
    assert hosts["ghost"]["status"] == "down" and hosts["ghost"]["error"]
    assert all(hosts[n]["status"] == "ok" for n in ("pi5", "jetson", "macmini", "laptop"))
    for l in rep["links"]:
        if "ghost" in (l["src"], l["dst"]):
            assert l["status"] == "down" and "ghost" in l["error"]
        elif {l["src"], l["dst"]} != {"macmini", "laptop"}:
            assert l["throughput_mbit"] > 100


def test_mtu_lab_effective_mtu_exact(tmp_path):
    from smolnet import inventory, secret
    from smolnet.matrix import AgentPool, default_secret_path
    from smolnet.probes.request import probe_pmtu

    inv = tmp_path / "m2.yml"
    st = sim_up(sim, name="m2", scenario="mtu-lab", subnet="10.213.12.0/24", inventory=str(inv))
    try:
        hosts = inventory.load_inventory(inv).hosts
        pool = AgentPool(secret.ensure_secret(default_secret_path(hosts)))
        try:
            pool.ensure_all(hosts)
            assert not pool.errors, pool.errors
            specs = {h["name"]: _spec(h) for h in st["hosts"]}
            cases = [
                ("j1", "j2"),
                ("j2", "j1"),  # matching jumbo
                ("j1", "jm"),
                ("jm", "j1"),  # jumbo host behind a 1500 switch port
                ("j1", "s1"),
                ("s1", "j1"),
            ]  # one end at 1500
            for a, b in cases:
                got = probe_pmtu(pool.endpoints[a], pool.endpoints[b], pool.secret)
                want = sim.path_truth(specs[a], specs[b])["mtu_effective"]
                assert got["error"] is None and abs(got["mtu_effective"] - want) <= MTU_TOLERANCE, (a, b, got, want)
        finally:
            pool.stop_all()
    finally:
        sim.down(name="m2")
