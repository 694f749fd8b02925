"""Per-rank timings: they add up to the step time, and compare names what missed."""

from __future__ import annotations

import json

import pytest

from smoltrain.run.timings import rank_timings


def test_rank_timings_add_up_to_the_step():
    parts = {0: (0.30, 0.05), 1: (0.28, 0.20), 2: (0.10, 0.02)}
    step = max(s for s, _ in parts.values())
    rows = rank_timings(parts, step)
    assert [r["rank"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["compute_s"] + r["comm_s"] + r["wait_s"] == pytest.approx(step)
        assert min(r.values()) >= 0
    assert [r["compute_s"] for r in rows] == pytest.approx([0.25, 0.08, 0.08])
    assert all(r["comm_s"] == pytest.approx(0.02) for r in rows)


def test_pipeline_stages_charge_communication_beyond_their_schedule():
    """mp, 3 stages computing 0.1, 0.2 and 0.3 s one after another in a 0.7 s step: 0.1 s is
    communication. Every stage also waited inside its receives (the last one for 0.3 s of
    its predecessors' forward), so the least communication time of any rank, the rule for
    side-by-side ranks, would call 0.3 s communication."""
    parts = {0: (0.70, 0.60), 1: (0.62, 0.42), 2: (0.65, 0.35)}
    rows = rank_timings(parts, 0.70, stages_m=1)
    assert [r["compute_s"] for r in rows] == pytest.approx([0.1, 0.2, 0.3])
    assert all(r["comm_s"] == pytest.approx(0.1) for r in rows)
    assert [r["wait_s"] for r in rows] == pytest.approx([0.5, 0.4, 0.3])
    assert rank_timings(parts, 0.70)[0]["comm_s"] == pytest.approx(0.35)
    # pp, 4 microbatches: the critical path is each stage's first slot plus 3 slots of the slowest
    pp = rank_timings(parts, 0.70, stages_m=4)
    critical = (0.1 + 0.2 + 0.3) / 4 + 3 * 0.3 / 4
    assert all(r["comm_s"] == pytest.approx(0.70 - critical) for r in pp)
    for r in rows + pp:
        assert r["compute_s"] + r["comm_s"] + r["wait_s"] == pytest.approx(0.70)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["dp", "pp"])
def test_run_records_per_rank_timings_that_add_up(tmp_path, strategy):
    from smoltrain.cli import main

    out = tmp_path / "run.json"
    assert (
        main(
            [
                "run",
                "--strategy",
                strategy,
                "--local",
                "2",
                "--steps",
                "3",
                "--batch",
                "4",
                "--seq",
                "32",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    from smoltrain.planner.timing import pipeline

    doc = json.loads(out.read_text())
    m = doc["config"]["microbatches"]
    for s in doc["steps"]:
        assert [r["rank"] for r in s["ranks"]] == [0, 1]
        assert all(r["compute_s"] > 0 and r["wait_s"] >= 0 for r in s["ranks"])
        assert len({r["comm_s"] for r in s["ranks"]}) == 1  # one figure of the step, as planned
        comm = s["ranks"][0]["comm_s"]
        if strategy == "pp":  # stages: what the step holds beyond their compute on the schedule
            critical, _ = pipeline([r["compute_s"] for r in s["ranks"]], [0.0], [0.0], m, True)
            assert comm == pytest.approx(max(0.0, s["step_s"] - critical), rel=1e-6, abs=1e-9)
        else:  # side by side: the slowest rank's own step is the step, its compute its own step less
            # its own communication (the least of the ranks' or the most, s["comm_s"])
            assert comm <= s["comm_s"]
            own = [r["compute_s"] + c for r in s["ranks"] for c in (comm, s["comm_s"])]
            assert any(x == pytest.approx(s["step_s"], rel=1e-6) for x in own)


def test_compare_names_the_rank_and_part_that_missed():
    from smoltrain.models.spec import get_model
    from smoltrain.planner.compare import compare
    from smoltrain.planner.links import from_class
    from smoltrain.planner.plan import make_plan, resolve_ranks

    plan = make_plan("dp", get_model("tiny"), 2, ranks=resolve_ranks(2), lm=from_class("1gbe"), single=False)
    c0, c1, comm = plan["ranks"][0]["compute_s"], plan["ranks"][1]["compute_s"], plan["comm_s_per_step"]
    step = {
        "step_s": 3 * c0 + comm,
        "comm_s": comm,
        "tokens": 512,
        "ranks": [
            {"rank": 0, "compute_s": 3 * c0, "comm_s": comm, "wait_s": 0.0},
            {"rank": 1, "compute_s": c1, "comm_s": comm, "wait_s": 2 * c0},
        ],
    }
    run = {"config": {}, "bytes": [], "steps": [dict(step, step=k) for k in range(3)]}
    cmp = compare(plan, run)
    assert [r["compute_s"]["ratio"] for r in cmp["ranks"]] == pytest.approx([3.0, 1.0])
    assert cmp["missed"] == ["compute on rank 0 (rank0) x3.00"]
