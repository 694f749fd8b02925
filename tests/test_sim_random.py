"""Scenario random: seeded clusters nobody tuned on (smolnet/sim/draw.py). Unit checks of the
drawn description only; no sim is brought up here."""

from __future__ import annotations

import pytest

from smolnet.errors import UsageError
from smolnet.sim import cgroup, draw
from smolnet.sim.inventory import inventory_text
from smolnet.sim.scenarios import HostSpec, path_truth, scenario

SEEDS = range(300)


def test_the_same_seed_gives_the_same_cluster_and_others_differ():
    a = [h.to_dict() for h in scenario("random", seed=1234)]
    assert a == [h.to_dict() for h in scenario("random", seed=1234)]
    assert a == [h.to_dict() for h in draw.draw(1234)]
    assert len({str([h.to_dict() for h in draw.draw(s, cpus=2)]) for s in range(20)}) == 20

    # only the caps' scale follows the machine; everything else is the seed's
    def strip(cpus):
        machine = ("cpu_cores", "cpu_period_us")
        return [{k: v for k, v in h.to_dict().items() if k not in machine} for h in draw.draw(7, cpus)]

    assert strip(2) == strip(64)


@pytest.mark.parametrize("cpus", [1, 2, 16])
def test_every_draw_stays_in_the_ranges_real_home_gear_spans(cpus):
    seen = {"kinds": set(), "peak": set(), "blackhole": False, "hidden": set(), "periods": set(), "sizes": set()}
    for seed in SEEDS:
        hosts = draw.draw(seed, cpus)
        assert draw.HOSTS[0] <= len(hosts) <= draw.HOSTS[1]
        seen["sizes"].add(len(hosts))
        assert len({h.name for h in hosts}) == len(hosts)
        caps = [h.cpu_cores for h in hosts]
        assert sum(caps) <= 0.75 * cpus + 1e-6
        assert all(0 < c <= draw.CAP[1] for c in caps)
        for h in hosts:
            kind = h.name.rstrip("0123456789")
            seen["kinds"].add(kind)
            seen["peak"].add(h.link_peak)
            seen["hidden"].add(h.cpu_hidden)
            seen["periods"].add(h.cpu_period_us)
            if kind == "wifi":
                assert all(draw.WIFI[0] <= r <= draw.WIFI[1] for r in (h.up_mbit, h.down_mbit))
                assert h.nic_mbit in draw.WIFI_PHY and h.mtu == h.port_mtu == 1500
            elif kind == "uplink":
                assert draw.SLOW_UP[0] <= h.up_mbit <= draw.SLOW_UP[1] and h.down_mbit == 1000
            else:
                assert h.up_mbit == h.down_mbit == h.nic_mbit == {"gbe": 1000, "mgig": 2500}[kind]
            assert h.mtu in (1500, 9000) and h.port_mtu in (1500, 9000) and h.port_mtu <= h.mtu
            assert h.own_machine or not h.cpu_hidden  # a host that cannot read its cap is its own machine
            period, quota = cgroup.period_quota(h.cpu_cores, h.cpu_period_us)
            assert quota / period == pytest.approx(h.cpu_cores, rel=0.02)  # the cap the spec says, not a floor
        seen["blackhole"] |= any(path_truth(a, b)["blackhole"] for a in hosts for b in hosts if a is not b)
    assert seen["kinds"] == set(draw.LINKS) and seen["peak"] == {True, False} == seen["hidden"]
    assert seen["sizes"] == {3, 4, 5, 6} and seen["blackhole"]
    assert None in seen["periods"] and len(seen["periods"]) > 1


def test_random_validates_like_the_built_in_scenarios():
    n = len(scenario("random", seed=5))
    assert [h.up_mbit for h in scenario("random", seed=5, rate_mbit=100)] == [100] * n
    assert [h.cpu_cores for h in scenario("random", seed=5, cpu_limit="0")] == [None] * n
    for bad in (
        dict(name="random"),  # a draw has a number
        dict(name="random", seed=-1),
        dict(name="random", seed=2**32),
        dict(name="home", seed=3),
        dict(name="random", seed=5, mtu=9000),
        dict(name="random", seed=5, hosts=n + 1),  # the draw fixes the number of hosts
        dict(name="random", seed=5, cpu_limit=",".join(["0.1"] * (n + 1))),
    ):
        with pytest.raises(UsageError):
            scenario(**bad)


def test_the_inventory_and_the_description_name_the_draw(tmp_path):
    specs = scenario("random", seed=42)
    hosts = []
    for i, s in enumerate(specs, 1):
        h = s.to_dict()
        h.update(index=i, address=f"10.0.0.{i}", netns=f"smol-x-{s.name}", cgroup=None, cpuset_cgroup=None)
        hosts.append(h)
    st = {"name": "x", "scenario": "random", "seed": 42, "mode": "netns", "state_dir": str(tmp_path)}
    st.update(created="2026-12-05T00:00:00Z", hosts=hosts)
    text = inventory_text(st)
    assert text.splitlines()[0].endswith("(sim x, scenario random --seed 42, netns) at 2026-12-05T00:00:00Z.")
    for s in specs:
        assert f"{s.name}:" in text
    lines = draw.describe(specs).splitlines()
    assert len(lines) == len(specs) and all(ln.startswith(s.name + ": ") for ln, s in zip(lines, specs))
    assert isinstance(specs[0], HostSpec)


def test_sim_up_random_draws_a_fresh_seed_and_shows_it(monkeypatch, capsys, tmp_path):
    """Without --seed the command draws one and passes it on; the table's title names it (the
    sim itself is not brought up here: up and status are stood in for)."""
    from smolnet.cli import main
    from smolnet.sim import cluster

    seen = {}

    def up(**kw):
        seen.update(kw)
        specs = scenario(kw["scenario"], seed=kw["seed"])
        hosts = [dict(s.to_dict(), address=f"10.0.0.{i}", netns=None) for i, s in enumerate(specs, 1)]
        return {"name": kw["name"], "scenario": "random", "seed": kw["seed"], "mode": "loopback",
                "subnet": "10.0.0.0/24", "inventory": str(tmp_path / "i.yml"), "hosts": hosts}  # fmt: skip

    monkeypatch.setattr(cluster, "up", lambda loopback=None, **kw: up(**kw))
    monkeypatch.setattr(cluster, "status", lambda name: None)
    assert main(["sim", "up", "--scenario", "random", "--loopback"]) == 0
    assert isinstance(seen["seed"], int) and 0 <= seen["seed"] <= draw.MAX_SEED
    assert f"scenario random --seed {seen['seed']}" in " ".join(capsys.readouterr().out.split())
    assert main(["sim", "up", "--scenario", "random", "--seed", "77", "--loopback"]) == 0 and seen["seed"] == 77


def test_the_model_share_goes_on_the_host_with_the_most_cpu():
    """Uncapped beats any cap, a larger cap a smaller one, the first of equals wins; the home
    sim's share is the laptop's (0.65 of a core), not the Pi's (0.15)."""
    from smolnet.sim.inventory import share_host

    def hosts(*caps):
        return [{"name": f"h{i}", "cpu_cores": c} for i, c in enumerate(caps)]

    assert share_host(hosts(0.15, 0.25, 0.45, 0.65)) == "h3"
    assert share_host(hosts(0.5, None, 2.0, None)) == "h1"
    assert share_host(hosts(0.3, 0.3)) == "h0"
    home = [s.to_dict() for s in scenario("home")]
    assert share_host(home) == "laptop"
