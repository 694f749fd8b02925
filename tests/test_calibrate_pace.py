"""The pace a host's busy thread runs at and the throttle cycle behind it (calibration/pace.py),
and the training step timed in CPU seconds at that pace (probe.train_seconds)."""

from __future__ import annotations

import pytest

from smoltrain.calibration import pace


def _marks(period, quota, n, jitter=()):
    """A thread that runs `quota` CPU seconds then waits out the rest of each `period`."""
    out, cpu = [], 0.0
    for k in range(1, n + 1):
        cpu += quota
        out.append((k * period + (jitter[k % len(jitter)] if jitter else 0.0), cpu))
    return out


def test_a_regular_throttle_gives_the_period_and_the_quota_a_period():
    marks = _marks(0.1, 0.02, 6)
    got = pace.from_marks((0.0, 0.0), (0.6, 0.12), marks)
    assert got.pace == pytest.approx(5.0)
    assert got.period_s == pytest.approx(0.1) and got.quota_s == pytest.approx(0.02)
    assert got.cycle() == {"quota_s": pytest.approx(0.02), "period_s": pytest.approx(0.1)}


def test_a_long_period_shows_through_short_stalls_between_its_throttles():
    """A 100 ms period at 0.2 cores: a 70-80 ms throttle a period, with 1-9 ms stalls between
    (as spun under such a cgroup here); the long gaps alone keep the period."""
    marks, cpu = [], 0.0
    for k in range(5):
        t = 0.1 * (k + 1)
        for dt, gap in ((0.012 + 0.003 * k, 0.002 + 0.0015 * k), (0.021, 0.004)):
            cpu += 0.004
            marks.append((t - 0.1 + dt, cpu, gap))
        cpu += 0.012
        marks.append((t, cpu, 0.072 + 0.002 * k))
    got = pace.from_marks((0.0, 0.0), (0.5, 0.1), marks)
    assert got.pace == pytest.approx(5.0)
    assert got.period_s == pytest.approx(0.1) and got.quota_s == pytest.approx(0.02)
    bare = pace.from_marks((0.0, 0.0), (0.5, 0.1), [m[:2] for m in marks])  # every gap alike
    assert bare.cycle() is None


def test_irregular_gaps_or_none_give_a_pace_and_no_cycle():
    """Other work taking turns leaves gaps at no one spacing; an uncapped thread, none."""
    uneven = [(0.01, 0.005), (0.05, 0.03), (0.06, 0.035), (0.2, 0.1), (0.23, 0.11)]
    got = pace.from_marks((0.0, 0.0), (0.3, 0.15), uneven)
    assert got.pace == pytest.approx(2.0) and got.cycle() is None
    assert pace.from_marks((0.0, 0.0), (0.5, 0.5), []) == pace.Pace(1.0)
    assert pace.from_marks((0.0, 0.0), (0.5, 0.6), []).pace == 1.0  # never below 1


def test_a_paced_host_times_its_training_step_in_cpu_seconds(monkeypatch):
    """On a host held back a step is timed in CPU seconds, the median step after a warm-up:
    here every read of the CPU clock advances it 10 ms, and one step's forward and backward
    takes 30 ms more (a stall, as a first full garbage collection makes)."""
    import torch

    from smoltrain.calibration import probe

    cpu = [0.0]
    step = [0]

    def fake_cpu():
        cpu[0] += 0.010
        return cpu[0]

    monkeypatch.setattr(probe.time, "process_time", fake_cpu)
    torch.set_num_threads(1)
    real_ce = torch.nn.functional.cross_entropy

    def ce(*a, **k):
        step[0] += 1
        if step[0] == 3:
            cpu[0] += 0.030  # one stalled step
        return real_ce(*a, **k)

    monkeypatch.setattr(torch.nn.functional, "cross_entropy", ce)
    opt: list = []
    sec = probe.train_seconds(torch, "tiny", 2, 16, 0.05, opt, "cpu", paced=True)
    # a step reads the clock at its start, after backward and at its end: 20 ms, 10 of them the update
    assert sec == pytest.approx(0.020)
    assert opt == [pytest.approx(0.010)]
    assert step[0] >= 1 + probe.TRAIN_STEPS_MIN


def test_cpu_seconds_become_wall_seconds_at_the_pace():
    """The probe measures messages, layers, the engine and a held-back host's steps in CPU
    seconds and turns them into wall seconds at the median of its three pace windows."""
    from smoltrain.calibration.probe import at_pace

    steps = [{"seconds": 0.02, "optimizer_seconds": 0.005}]
    got = at_pace(4.0, {"message_s": 1e-4, "bytes_s": 8e8}, {"fp32": {"1": 1e-5, "4": 2e-5}}, 1e-3, steps)
    assert got["comm_cpu"] == {"message_s": pytest.approx(4e-4), "bytes_s": pytest.approx(2e8)}
    assert got["decode_layer_s"] == {"fp32": {"1": pytest.approx(4e-5), "4": pytest.approx(8e-5)}}
    assert got["decode_engine_s"] == pytest.approx(4e-3)
    assert steps == [{"seconds": pytest.approx(0.08), "optimizer_seconds": pytest.approx(0.02)}]
    assert at_pace(2.0, None, {}, None, [])["comm_cpu"] is None
