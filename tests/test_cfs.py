"""The CFS model of a chain (planner/cfs.py): hand-computed periods, and the three regimes a
stage on a quota host meets (its work fits the quota, outlasts it, or the host is paced)."""

from __future__ import annotations

import pytest

from smoltrain.planner import cfs

MS = 1e-3


def test_a_quota_host_runs_at_full_speed_until_its_quota_is_spent_then_waits_for_the_next_period():
    c = cfs.Cpu(pace=4.0, quota_s=2.5 * MS, period_s=10 * MS)
    # 8 ms of CPU: 2.5 in each of three periods, then 0.5 in the fourth
    assert c.run(0.0, 8 * MS) == pytest.approx((0.0, 30.5 * MS))
    # the fourth period has 2 ms left: 1 ms more runs at once, begun when the host is free
    assert c.run(0.0, 1 * MS) == pytest.approx((30.5 * MS, 31.5 * MS))
    # an idle host starts the next period on a whole quota
    assert c.run(52 * MS, 2 * MS) == pytest.approx((52 * MS, 54 * MS))
    # no quota: the pace; a quota of a period or more: full speed
    assert cfs.Cpu(pace=4.0).run(0.0, 1 * MS) == pytest.approx((0.0, 4 * MS))
    assert cfs.Cpu(quota_s=20 * MS, period_s=10 * MS).run(0.0, 30 * MS) == pytest.approx((0.0, 30 * MS))


def test_a_period_edge_opens_the_next_period_whatever_the_rounding():
    c = cfs.Cpu(quota_s=1 * MS, period_s=3 * MS, phase_s=0.1)
    start, end = c.run(0.1 + 20 * MS, 5 * MS)  # a quota ends on an edge, then one a period
    assert end == pytest.approx(start + 11 * MS)  # 20-21, 21-22, 24-25, 27-28, 30-31


def _inputs(cpu, work, other, wire=1 * MS):
    stages = [cfs.Stage(work, 0.0, [0.0, 0.0], [0.0, 0.0]), cfs.Stage(other, 0.0, [0.0, 0.0], [0.0, 0.0])]
    return stages, [cpu, cfs.Cpu()], [wire], [wire], 1


def _two(cpu, work, other, wire=1 * MS):
    return cfs.chain(*_inputs(cpu, work, other, wire))


def test_a_stage_whose_work_fits_its_quota_runs_at_full_speed():
    """12 ms of CPU a step of 58 against 46 ms every 100 ms (the drawn mp run's 100 ms host)."""
    got = _two(cfs.Cpu(pace=2.17, quota_s=46 * MS, period_s=100 * MS), 12 * MS, 44 * MS)
    assert got.compute_s == pytest.approx([12 * MS, 44 * MS])
    assert got.step_s == pytest.approx(56 * MS + 2 * MS)  # both stages at full speed, two hops
    # the same stage beside a short one: over a period it would need more than its quota
    busy = _two(cfs.Cpu(pace=2.17, quota_s=46 * MS, period_s=100 * MS), 12 * MS, 4 * MS)
    assert busy.compute_s[0] > 13 * MS and busy.step_s >= 12 * MS * 2.17 * 0.98


def test_a_stage_whose_bursts_outlast_short_periods_runs_at_the_pace():
    got = _two(cfs.Cpu(pace=4.0, quota_s=0.25 * MS, period_s=1 * MS), 20 * MS, 20 * MS)
    assert got.compute_s[0] == pytest.approx(80 * MS, rel=0.03)
    assert got.step_s == pytest.approx(80 * MS + 20 * MS + 2 * MS, rel=0.03)


def test_a_paced_host_without_a_cycle_runs_at_its_pace_and_the_schedule_is_gpipe():
    """No quota anywhere: one microbatch is timing.pipeline's chain exactly; four microbatches
    laid out one by one end no later than its slot-based bound."""
    from smoltrain.planner.timing import pipeline

    stages = [cfs.Stage(w * MS, 1 * MS, [0.0, 0.0], [0.0, 0.0]) for w in (6, 9, 3)]
    cpus = [cfs.Cpu(pace=2.0), cfs.Cpu(), cfs.Cpu(pace=3.0)]
    walls, updates = [14 * MS, 10 * MS, 12 * MS], [2 * MS, 1 * MS, 3 * MS]  # (work + update) x pace
    hops = [1 * MS, 2 * MS]
    for m in (1, 4):
        got = cfs.chain(stages, cpus, hops, hops, m)
        assert got.compute_s == pytest.approx(walls) and got.update_s == pytest.approx(updates)
        critical, comm = pipeline(walls, hops, hops, m, True, updates)
        assert got.step_s == pytest.approx(critical + comm) if m == 1 else got.step_s <= critical + comm


def test_a_burst_after_the_host_sat_idle_pays_its_wake_and_one_right_after_does_not():
    """calibrate's burst_wake_s (at full speed): charged on the work that follows a wait of
    WAKE_IDLE_S or more since the host's last burst ended, never on work begun at once, so a
    stage waiting on its neighbours pays it once a wait, in its compute."""
    c = cfs.Cpu(wake_s=0.5 * MS)
    assert not c.idle(0.0)  # the first burst: nothing before it
    assert c.run(0.0, 1 * MS, c.idle(0.0)) == pytest.approx((0.0, 1 * MS))
    assert not c.idle(1 * MS) and not c.idle(1 * MS + cfs.WAKE_IDLE_S * 0.9)
    assert c.idle(10 * MS)
    assert c.run(10 * MS, 1 * MS, c.idle(10 * MS)) == pytest.approx((10 * MS, 11.5 * MS))  # after a wait: 1.5 ms
    # in a two-stage chain the second stage sleeps while the first works: each of its forward
    # and backward bursts starts after a wait, so its compute grows by its wakes
    base = _two(cfs.Cpu(), 1 * MS, 1 * MS, wire=5 * MS).compute_s[1]
    woken = cfs.chain(
        [cfs.Stage(1 * MS, 0.0, [0.0, 0.0], [0.0, 0.0]), cfs.Stage(1 * MS, 0.0, [0.0, 0.0], [0.0, 0.0])],
        [cfs.Cpu(), cfs.Cpu(wake_s=0.5 * MS)],
        [5 * MS],
        [5 * MS],
        1,
    ).compute_s[1]
    assert woken > base


def test_a_chain_laid_out_again_is_remembered_by_its_inputs_and_any_change_lays_it_out_anew():
    """The mesh search asks for the same chain many times: the second answer is the first's
    (and a caller changing it changes neither), and a change to any input is a new layout."""
    cfs._MEMO.clear()
    cpu = cfs.Cpu(pace=4.0, quota_s=2.5 * MS, period_s=10 * MS)
    first = _two(cpu, 12 * MS, 4 * MS)
    first.compute_s[0] = -1.0
    again = _two(cfs.Cpu(pace=4.0, quota_s=2.5 * MS, period_s=10 * MS), 12 * MS, 4 * MS)
    assert len(cfs._MEMO) == 1 and again.compute_s[0] > 0
    assert again == cfs._chain(*_inputs(cpu, 12 * MS, 4 * MS))
    for other in (
        _two(cfs.Cpu(pace=4.0, quota_s=2.5 * MS, period_s=5 * MS), 12 * MS, 4 * MS),  # the period
        _two(cfs.Cpu(pace=4.0, quota_s=2.5 * MS, period_s=10 * MS, wake_s=1 * MS), 12 * MS, 4 * MS),  # the wake
        _two(cpu, 12 * MS, 4 * MS, wire=2 * MS),  # the wire
        _two(cpu, 13 * MS, 4 * MS),  # the work
    ):
        assert other.step_s != again.step_s
    assert len(cfs._MEMO) == 5
