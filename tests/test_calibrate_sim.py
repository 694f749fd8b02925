"""Calibration on CPU-capped sim hosts reads each host's cap and the period it is enforced over.

Whether the measured figures rank the hosts in the order of their caps is a comparison of
measured times, which a busy machine can reorder: bench/bench_compute.py checks it (its
calibration check, a row of BENCHMARKS.md's summary), not the tests. What this test holds is read
from cgroup files, so it runs in `make test`'s parallel phase (the capped probe mostly waits on
its quota there)."""

from __future__ import annotations

import pytest

from smolnet.sim import cluster as sim

NAME, SUBNET = "ccal", "10.42.1.0/24"


@pytest.mark.sim
@pytest.mark.slow
def test_calibration_reads_each_capped_hosts_cap(tmp_path):
    from need import need_cgroup

    need_cgroup()
    from smolnet.inventory import load_inventory
    from smoltrain.calibration.cluster import calibrate_hosts

    sim.down(NAME)
    # 0.3 cores: a CFS period longer than the 5 ms default (8.3 ms), without the tenfold slower run of 0.1
    st = sim.up(
        name=NAME, scenario="uniform", hosts=2, subnet=SUBNET, inventory=str(tmp_path / "sim.yml"), cpu_limit="0.3,0.9"
    )
    try:
        # the shortest windows the probe allows (--quick): the cap is read, not measured, and
        # each second of the probe's CPU is 3.3 s on the slow host
        doc = calibrate_hosts(load_inventory(st["inventory"]).hosts, "tiny", 0.25, quick=True)
    finally:
        sim.down(NAME)
    slow, fast = doc["hosts"]  # rank order only: on a busy machine an uncapped share shrinks
    assert slow["status"] == fast["status"] == "ok", doc
    from smolnet.sim.cgroup import period_quota

    (p_slow, q_slow), (p_fast, q_fast) = period_quota(0.3), period_quota(0.9)  # the cap the quota rounds to
    assert [slow["cpu_limit_cores"], fast["cpu_limit_cores"]] == pytest.approx([q_slow / p_slow, q_fast / p_fast])
    assert [slow["cpu_period_s"], fast["cpu_period_s"]] == pytest.approx([period_quota(c)[0] / 1e6 for c in (0.3, 0.9)])
    assert slow["machine_id"] == fast["machine_id"]
    # caps each host reads, 1.2 cores and a thread each: together on 2 CPUs or more, unless other
    # work kept the machine busy beyond the headroom just before (calibration.together)
    (m,) = doc["machines"]
    assert m["hosts"] == ["node1", "node2"], m
    if not m["together"]:  # only the other work read just before may keep them apart
        assert "caps sum to 1.20 cores, over" in m["why"] and "other work" in m["why"], m
    assert all(h["flops"]["fp32"] > 0 and h["train_step"][-1]["seconds"] > 0 for h in (slow, fast))
