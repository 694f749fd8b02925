"""The `fastpair` sim scenario as a description (no sim is brought up here): which hosts, their
shaped rates, and the truth each path carries, which a mesh's placement is checked against."""

from __future__ import annotations

import pytest

from smolnet.errors import UsageError
from smolnet.sim.scenarios import SCENARIOS, path_truth, scenario


def test_fastpair_hosts_and_paths():
    assert "fastpair" in SCENARIOS
    hosts = {h.name: h for h in scenario("fastpair")}
    assert list(hosts) == ["fast1", "fast2", "gbe", "slowup"]
    rate = {(a, b): path_truth(hosts[a], hosts[b])["rate_mbit"] for a in hosts for b in hosts if a != b}
    assert rate[("fast1", "fast2")] == rate[("fast2", "fast1")] == 10_000  # the one fast pair
    assert all(r == 1000 for (a, b), r in rate.items() if {a, b} != {"fast1", "fast2"} and a != "slowup")
    assert all(r == 300 for (a, _), r in rate.items() if a == "slowup")  # its uplink only
    assert all(h.nic_mbit == h.down_mbit for h in hosts.values())
    caps = {h.cpu_cores for h in hosts.values()}
    assert len(caps) == 1 and 0 < caps.pop() <= 0.3  # alike: the links, not the CPUs, make the difference
    assert not any(path_truth(a, b)["blackhole"] for a in hosts.values() for b in hosts.values())


def test_fastpair_takes_no_size_or_mtu():
    with pytest.raises(UsageError, match="has 4 hosts"):
        scenario("fastpair", hosts=3)
    with pytest.raises(UsageError, match="--mtu applies"):
        scenario("fastpair", mtu=9000)
    assert {h.up_mbit for h in scenario("fastpair", rate_mbit=500)} == {500}
