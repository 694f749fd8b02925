"""calibration.together: which hosts of one machine calibrate probes at the same time, from the
caps the sim's scenarios really set (the quota each rounds to, as a host reads it back)."""

from __future__ import annotations

import os

import pytest

from smolnet.inventory import Host
from smolnet.sim.cgroup import period_quota
from smolnet.sim.scenarios import HIDDEN, HOME_CPU
from smoltrain.calibration.cluster import _machines
from smoltrain.calibration.together import HEADROOM_CORES, lanes, machine_busy, parse


def _read(cores: float) -> float:
    """The cap a host reads back for `cores`: its quota over its period."""
    period, quota = period_quota(cores)
    return quota / period


def _facts(caps: dict[str, float | None], threads: int = 1) -> dict[str, dict]:
    """Each host as host_facts() reads it, with its probe's threads (the sim's smol_threads)."""
    return {
        n: {"cpu_limit_cores": c, "cpu_cgroups": [f"0:{i}"] if c else [], "threads": threads}
        for i, (n, c) in enumerate(caps.items())
    }


HOME = dict(zip(("pi5", "jetson", "macmini", "laptop"), HOME_CPU))


def test_home_hosts_are_probed_two_at_a_time_where_each_probe_thread_has_a_cpu():
    """The caps fit 2 CPUs less the headroom (1.5 cores), but four one-thread probes on two
    CPUs wait on each other within a quota period: on the sim the laptop's training step read
    1.2-1.4x slower all together (BENCHMARKS.md). Two at a time each thread has a CPU and the
    two largest caps (laptop and macmini, 1.1 cores) fit. On 4 CPUs all run together."""
    home = _facts({n: _read(c) for n, c in HOME.items()})
    k, why = lanes(home, 2, 0.1)
    assert k == 2 and why.startswith("2 at a time") and "3 probe threads, more than 2 CPUs" in why
    k, why = lanes(home, 4, 0.1)
    assert k == 4 and why.startswith("together") and "1.50 cores" in why
    # two threads a probe: two of them fill 4 CPUs
    assert lanes(_facts({n: _read(c) for n, c in HOME.items()}, threads=2), 4, 0.1)[0] == 2
    # the two-host sim of test_calibrate_sim (0.3 and 0.9 cores, a thread each) fits 2 CPUs
    assert lanes(_facts({"node1": _read(0.3), "node2": _read(0.9)}), 2, 0.1)[0] == 2
    # a probe whose threads are not known (no smol_threads) runs one per CPU it may use
    two = _facts({"node1": _read(0.3), "node2": _read(0.9)})
    k, why = lanes({n: {**f, "threads": None, "cores": 2} for n, f in two.items()}, 2, 0.1)
    assert k == 1 and why == "one after another: 4 probe threads, more than 2 CPUs"


def test_the_largest_caps_decide_how_many_run_at_once():
    """Any of the hosts may be running beside any other, so the busiest k must fit."""
    caps = _facts({"a": 0.9, "b": 0.7, "c": 0.2, "d": 0.1})
    k, why = lanes(caps, 4, 0.0)  # room 3.5: threads allow 4, caps 1.9 for all four
    assert k == 4
    k, why = lanes(caps, 4, 2.2)  # other work 2.2: room 1.8, the three largest fit (1.8), four do not
    assert k == 3 and why.startswith("3 at a time") and "caps sum to 1.90 cores" in why
    k, why = lanes(caps, 4, 2.5)  # room 1.5: 0.9 + 0.7 is over
    assert k == 1 and "caps sum to 1.60 cores, over 4 CPUs less 2.50" in why


def test_a_host_without_a_readable_cap_keeps_its_machine_one_after_another():
    caps = {n: _read(c) for n, c in HOME.items()} | {"laptop": None}
    k, why = lanes(_facts(caps), 8, 0.0)
    assert k == 1 and "laptop" in why
    # the hidden scenario: every cap above the host's cgroup namespace, none readable
    k, why = lanes(_facts({n: None for n, _, _ in HIDDEN}), 2, 0.0)
    assert k == 1 and all(n in why for n, _, _ in HIDDEN)


def test_caps_that_overcommit_the_machine_less_its_headroom_are_not_probed_together():
    two = {"a": _read(0.9), "b": _read(0.9)}  # 1.8 cores: over 2 CPUs less half a core
    assert sum(two.values()) > 2 - HEADROOM_CORES
    k, why = lanes(_facts(two), 2, 0.0)
    assert k == 1 and "caps sum to 1.80 cores, over 2 CPUs" in why
    assert lanes(_facts(two), 3, 0.0)[0] == 2


def test_other_work_on_the_machine_takes_room_beyond_the_headroom():
    """A cap is an upper bound: where other work keeps the CPUs busy, hosts probed at once
    take each other's share. Other work under the headroom is covered by it."""
    two = _facts({"node1": _read(0.3), "node2": _read(0.9)})
    k, why = lanes(two, 2, 1.97)  # both CPUs of this machine busy with other jobs (/proc/stat)
    assert k == 1 and "other work 1.97" in why
    assert lanes(two, 2, 0.45)[0] == 2
    assert lanes(two, 2, None)[0] == 1  # unknown: one after another
    assert 0.0 <= machine_busy(0.05) <= os.cpu_count()  # read for real


def test_hosts_under_one_capped_cgroup_share_its_cap():
    """Two hosts in one container read the same cap; they would split it, not each have it."""
    one = {"cpu_limit_cores": 0.5, "cpu_cgroups": ["0:7"]}
    facts = {"a": one, "b": one}
    k, why = lanes(facts, 8, 0.0)
    assert k == 1 and "a and b share one CPU cap" in why
    assert lanes({"a": facts["a"]}, 8, 0.0) == (1, "alone on its machine")


def test_the_report_names_each_machines_hosts_and_sequential_overrides():
    facts = {n: ("m1", f) for n, f in _facts({n: _read(c) for n, c in HOME.items()}).items()}
    facts = {
        n: (mid, {**f, "cpus": 4, "busy_cpus": b}) for (n, (mid, f)), b in zip(facts.items(), (1.0, 0.2, 0.9, 0.3))
    }
    facts["far"] = ("m2", {"cpus": 4, "cpu_limit_cores": None})

    # gone: no facts (it failed); a thread each (the sim's smol_threads)
    hosts = [Host(name=n, address="127.0.0.1", cluster_ip="127.0.0.1", threads=1) for n in (*HOME, "far", "gone")]
    (home, far) = _machines(hosts, facts, sequential=False)
    assert (
        home["hosts"] == list(HOME)
        and home["together"]
        and far
        == {
            "machine_id": "m2",
            "hosts": ["far"],
            "together": False,
            "lanes": 1,
            "why": "alone on its machine",
        }
    )
    (home, _) = _machines(hosts, facts, sequential=True)
    assert not home["together"] and home["lanes"] == 1 and "--sequential" in home["why"]


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


def test_two_lanes_probe_the_tightest_cap_first_and_never_one_host_twice_at_once(monkeypatch):
    """The home sim's four hosts on 2 CPUs, two lanes (test above): the pi5 (tightest cap, the
    longest probe) starts first, beside the jetson (a barrier both must reach, so one lane alone
    would fail here); a host's rounds run in order and never overlap, and never more than two
    probes run at once."""
    import threading

    from smoltrain.calibration import cluster

    caps = {n: _read(c) for n, c in HOME.items()}
    monkeypatch.setattr(
        cluster,
        "_host_facts",
        lambda h: ("m1", {"cpus": 2, "busy_cpus": 0.1, "cpu_limit_cores": caps[h.name], "cpu_cgroups": [h.name]}),
    )
    both = threading.Barrier(2, timeout=30)
    lock, running, events = threading.Lock(), set(), []

    def probe(h, model, seconds):
        with lock:
            assert h.name not in running and len(running) < 2
            running.add(h.name)
            events.append(h.name)
            first = len(events) <= 2
        if first:
            both.wait()
        with lock:
            running.discard(h.name)
        return {"name": h.name, "status": "ok", "flops": {"fp32": 1.0}, "mem_bw_bytes_s": 1.0, "usable_memory_bytes": 1}

    hosts = [Host(name=n, address="127.0.0.1", cluster_ip="127.0.0.1", threads=1) for n in HOME]
    said: list[tuple[str, str]] = []
    doc = cluster.calibrate_hosts(hosts, "tiny", 0.05, probe=probe, repeats=3, progress=lambda *a: said.append(a))
    (m,) = doc["machines"]
    assert m["lanes"] == 2 and not m["together"] and m["why"].startswith("2 at a time")
    assert events[:2] == ["pi5", "jetson"] and sorted(events) == sorted(list(HOME) * 3)
    assert all(h["status"] == "ok" and h["repeats"] == 3 for h in doc["hosts"])
    for n in HOME:
        assert [w for who, w in said if who == n and w.startswith("measuring")] == [
            f"measuring ({r} of 3)" for r in (1, 2, 3)
        ]
