"""calibration.together: which hosts of one machine calibrate probes at the same time, from the
caps the sim's scenarios really set (the quota each rounds to, as a host reads it back)."""

from __future__ import annotations

import pytest

from smolnet.inventory import Host
from smolnet.sim.cgroup import period_quota
from smolnet.sim.scenarios import HIDDEN, HOME_CPU
from smoltrain.calibration.cluster import _machines
from smoltrain.calibration.together import HEADROOM_CORES, decide, parse


def _read(cores: float) -> float:
    """The cap a host reads back for `cores`: its quota over its period."""
    period, quota = period_quota(cores)
    return quota / period


def _facts(caps: dict[str, float | None]) -> dict[str, dict]:
    return {n: {"cpu_limit_cores": c, "cpu_cgroups": [f"0:{i}"] if c else []} for i, (n, c) in enumerate(caps.items())}


HOME = dict(zip(("pi5", "jetson", "macmini", "laptop"), HOME_CPU))


def test_the_home_hosts_fit_two_cpus_and_are_probed_together():
    ok, why = decide(_facts({n: _read(c) for n, c in HOME.items()}), 2)
    assert ok and "1.50 cores" in why
    # on one CPU the sim scales the caps to 3/4 of it (scenarios._fit): no room left for the headroom
    ok, why = decide(_facts({n: _read(c * 0.75 / sum(HOME_CPU)) for n, c in HOME.items()}), 1)
    assert not ok and "over 1 CPUs" in why


def test_a_host_without_a_readable_cap_keeps_its_machine_one_after_another():
    caps = {n: _read(c) for n, c in HOME.items()} | {"laptop": None}
    ok, why = decide(_facts(caps), 8)
    assert not ok and "laptop" in why
    # the hidden scenario: every cap above the host's cgroup namespace, none readable
    ok, why = decide(_facts({n: None for n, _, _ in HIDDEN}), 2)
    assert not ok and all(n in why for n, _, _ in HIDDEN)


def test_caps_that_overcommit_the_machine_less_its_headroom_are_not_probed_together():
    four = {f"h{i}": _read(0.45) for i in range(4)}  # 1.8 cores: over 2 CPUs less half a core
    assert sum(four.values()) > 2 - HEADROOM_CORES
    assert not decide(_facts(four), 2)[0]
    assert decide(_facts(four), 3)[0]


def test_hosts_under_one_capped_cgroup_share_its_cap():
    """Two hosts in one container read the same cap; they would split it, not each have it."""
    one = {"cpu_limit_cores": 0.5, "cpu_cgroups": ["0:7"]}
    facts = {"a": one, "b": one}
    ok, why = decide(facts, 8)
    assert not ok and "a and b share one CPU cap" in why
    assert not decide({"a": facts["a"]}, 8)[0]  # one host: nothing to measure it with


def test_the_report_names_each_machines_hosts_and_sequential_overrides():
    facts = {n: ("m1", f) for n, f in _facts({n: _read(c) for n, c in HOME.items()}).items()}
    facts = {n: (mid, {**f, "cpus": 2}) for n, (mid, f) in facts.items()}
    facts["far"] = ("m2", {"cpus": 4, "cpu_limit_cores": None})

    # gone: no facts (it failed)
    hosts = [Host(name=n, address="127.0.0.1", cluster_ip="127.0.0.1") for n in (*HOME, "far", "gone")]
    (home, far) = _machines(hosts, facts, sequential=False)
    assert (
        home["hosts"] == list(HOME)
        and home["together"]
        and far
        == {
            "machine_id": "m2",
            "hosts": ["far"],
            "together": False,
            "why": "alone on its machine",
        }
    )
    (home, _) = _machines(hosts, facts, sequential=True)
    assert not home["together"] and "--sequential" in home["why"]


@pytest.mark.parametrize(
    "out, want",
    [
        ('abc-1\n{"cpus": 2, "cpu_limit_cores": 0.25, "cpu_cgroups": ["0:9"]}\n', ("abc-1", 0.25)),
        ("abc-1\n", ("abc-1", None)),  # the host's Python could not say: the cap is unknown
        ("abc-1\nTraceback (most recent call last)\n", ("abc-1", None)),
        ("", ("", None)),
    ],
)
def test_one_round_trip_gives_the_machine_id_and_the_cap(out, want):
    mid, facts = parse(out)
    assert (mid, facts.get("cpu_limit_cores")) == want
