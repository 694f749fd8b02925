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
    # each rank's own: its step beyond the slowest compute (0.25), at most its own time in calls
    assert [r["comm_s"] for r in rows] == pytest.approx([0.05, 0.03, 0.0])
    assert [(r["own_step_s"], r["own_comm_s"]) for r in rows] == [parts[k] for k in (0, 1, 2)]


def test_a_rank_whose_messages_take_longer_gets_its_own_communication_figure():
    """dp, 3 ranks computing 0.2 s each; rank 2 sits behind a slow uplink and its step ends 0.15 s
    after the compute, the others' 0.05 s after it: no longer one number for every rank."""
    parts = {0: (0.25, 0.05), 1: (0.25, 0.05), 2: (0.35, 0.15)}
    rows = rank_timings(parts, 0.35)
    assert [r["comm_s"] for r in rows] == pytest.approx([0.05, 0.05, 0.15])
    assert [r["wait_s"] for r in rows] == pytest.approx([0.10, 0.10, 0.0])


def test_a_wait_a_rank_timed_apart_is_neither_its_compute_nor_its_communication():
    """diloco's outer step: ranks 0 and 2 sat 5 s and 3 s at the roster's sync for rank 1, then
    all-reduced for 2 s side by side with it; their own compute was 1 s, rank 1's 1.5 s. The
    waits land in wait_s, and each all-reduce is the rank's own communication."""
    parts = {0: (8.0, 2.0, 5.0), 1: (3.5, 2.0, 0.001), 2: (6.0, 2.0, 3.0)}
    rows = rank_timings(parts, 8.0)
    assert [r["compute_s"] for r in rows] == pytest.approx([1.0, 1.499, 1.0])
    assert [r["comm_s"] for r in rows] == pytest.approx([2.0, 2.0, 2.0])
    assert [r["wait_s"] for r in rows] == pytest.approx([5.0, 4.501, 5.0])
    assert [r["own_wait_s"] for r in rows] == [5.0, 0.001, 3.0]
    for r in rows:
        assert r["compute_s"] + r["comm_s"] + r["wait_s"] == pytest.approx(8.0)


def test_pipeline_stages_update_side_by_side_not_in_series():
    """mp, 4 stages of 0.02 s compute each, 0.005 s of it the stage's own optimizer update (timed
    apart). Forward and backward run in series (0.06 s); each stage updates once its own
    backward is done, while the stages before it still run theirs, so only the first stage's
    update (0.005 s) follows the chain: 0.065 s of compute critical path, not the 0.08 s of the
    four computes in series, which left no communication to any rank of a 0.07 s step (the
    demo's run-mp.json: comm 0.00 on every rank in 15 of 18 steps)."""
    from smoltrain.planner.timing import pipeline

    assert pipeline([0.02] * 4, [0.0] * 3, [0.0] * 3, 1, True, [0.005] * 4)[0] == pytest.approx(0.065)
    assert pipeline([0.02] * 4, [0.0] * 3, [0.0] * 3, 1, True)[0] == pytest.approx(0.08)  # no updates apart
    # a last stage whose update outlasts the backward still to run before it: it ends the step
    # (0.06 s of work; stage 3's last backward ends 3 x 0.01 s before stage 0's, then 0.05 s of update)
    assert pipeline([0.02, 0.02, 0.02, 0.065], [0.0] * 3, [0.0] * 3, 1, True, [0.005] * 3 + [0.05])[0] == (
        pytest.approx(0.06 + 0.05 - 0.03)
    )
    parts = {r: (0.07, 0.05, 0.0, 0.005) for r in range(4)}
    rows = rank_timings(parts, 0.07, stages_m=1)
    assert [r["compute_s"] for r in rows] == pytest.approx([0.02] * 4)
    assert [r["comm_s"] for r in rows] == pytest.approx([0.005] * 4)
    assert [r["own_update_s"] for r in rows] == [0.005] * 4
    before = rank_timings({r: v[:3] for r, v in parts.items()}, 0.07, stages_m=1)  # updates not apart
    assert [r["comm_s"] for r in before] == pytest.approx([0.0] * 4)


def test_pipeline_stages_charge_communication_beyond_their_schedule():
    """mp, 3 stages computing 0.1, 0.2 and 0.3 s one after another in a 0.7 s step: 0.1 s is
    communication. Every stage also waited inside its receives (the last one for 0.3 s of
    its predecessors' forward), so the least communication time of any rank, the rule for
    side-by-side ranks, would call 0.3 s communication. The stages' own steps (0.62-0.70 s)
    start and end at their own places in the cycle: the step's 0.1 s beyond the 0.6 s schedule
    is every stage's, where their own steps would give 0.1, 0.02 and 0.05."""
    parts = {0: (0.70, 0.60), 1: (0.62, 0.42), 2: (0.65, 0.35)}
    rows = rank_timings(parts, 0.70, stages_m=1)
    assert [r["compute_s"] for r in rows] == pytest.approx([0.1, 0.2, 0.3])
    assert [r["comm_s"] for r in rows] == pytest.approx([0.1, 0.1, 0.1])
    assert [r["wait_s"] for r in rows] == pytest.approx([0.5, 0.4, 0.3])
    short = rank_timings({0: (0.70, 0.60), 1: (0.27, 0.07), 2: (0.65, 0.35)}, 0.70, stages_m=1)
    assert short[1]["comm_s"] == pytest.approx(0.07)  # never more than the stage's own time in calls
    assert rank_timings(parts, 0.70)[0]["comm_s"] == pytest.approx(0.4)  # side by side: beyond the 0.3 s slowest
    # pp, 4 microbatches: the critical path is each stage's first slot plus 3 slots of the slowest
    pp = rank_timings(parts, 0.70, stages_m=4)
    critical = (0.1 + 0.2 + 0.3) / 4 + 3 * 0.3 / 4
    assert [r["comm_s"] for r in pp] == pytest.approx([min(c, 0.70 - critical) for _, c in parts.values()])
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
        # the slowest rank's own step is the step; each rank's compute is its own step less its calls
        assert max(r["own_step_s"] for r in s["ranks"]) == pytest.approx(s["step_s"], rel=1e-6)
        assert max(r["own_comm_s"] for r in s["ranks"]) == pytest.approx(s["comm_s"], rel=1e-6)
        computes = [r["compute_s"] for r in s["ranks"]]
        if strategy == "pp":  # stages: the step beyond their compute on the schedule
            updates = [r["own_update_s"] for r in s["ranks"]]  # each stage times its update apart
            assert all(0 < u < c for u, c in zip(updates, computes)), updates
            critical, _ = pipeline(computes, [0.0], [0.0], m, True, updates)
        else:  # side by side: beyond the slowest rank's compute
            critical = max(computes)
        for r in s["ranks"]:
            assert r["compute_s"] == pytest.approx(r["own_step_s"] - r["own_comm_s"], rel=1e-6, abs=1e-9)
            own = s["step_s"] if strategy == "pp" else r["own_step_s"]  # a stage: the step's
            want = min(r["own_comm_s"], max(0.0, own - critical), s["step_s"] - r["compute_s"])
            assert r["comm_s"] == pytest.approx(want, rel=1e-6, abs=1e-9) and r["comm_s"] <= s["comm_s"] + 1e-9


def test_compare_names_the_rank_and_part_that_missed():
    from smoltrain.models.spec import get_model
    from smoltrain.planner.compare import compare
    from smoltrain.planner.links import from_class
    from smoltrain.planner.plan import make_plan
    from smoltrain.planner.ranks import resolve_ranks

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


def test_compare_judges_each_ranks_own_communication(tmp_path):
    """A recorded run (a small run report written here) whose rank 1 sat behind a slow link: its
    communication is its own figure, three times the plan's, and the compare marks that term
    outside 25% while rank 0's terms and both computes stay within."""
    from smoltrain.models.spec import get_model
    from smoltrain.planner.compare import compare, read_run
    from smoltrain.planner.links import from_class
    from smoltrain.planner.plan import make_plan
    from smoltrain.planner.ranks import resolve_ranks

    plan = make_plan("dp", get_model("tiny"), 2, ranks=resolve_ranks(2), lm=from_class("1gbe"), single=False)
    c = [r["compute_s"] for r in plan["ranks"]]
    comm, slowest = plan["comm_s_per_step"], max(c)
    assert comm > 0.05 * plan["step_s"]  # large enough to be judged
    parts = {0: (slowest + comm, slowest + comm - c[0]), 1: (slowest + 3 * comm, slowest + 3 * comm - c[1])}
    step = slowest + 3 * comm
    steps = [
        {
            "step": k,
            "loss": 1.0,
            "step_s": step,
            "comm_s": parts[1][1],
            "tokens": 512,
            "ranks": rank_timings(parts, step),
        }
        for k in range(6)
    ]
    doc = {"schema": "smoltrain.run/1", "strategy": "dp", "backend": "socket", "world_size": 2, "events": []}
    doc.update(config={"strategy": "dp", "model": "tiny", "world_size": 2}, steps=steps, bytes=[])
    doc.update(final_loss=1.0, tokens_per_s=512 / step)
    (tmp_path / "run.json").write_text(json.dumps(doc))
    cmp = compare(plan, read_run(str(tmp_path / "run.json")))
    r0, r1 = cmp["ranks"]
    assert r0["comm_s"]["measured"] == pytest.approx(comm) and r1["comm_s"]["measured"] == pytest.approx(3 * comm)
    assert r1["comm_s"]["ratio"] == pytest.approx(3.0) and r1["comm_s"]["verdict"] == "outside"
    assert r0["comm_s"]["verdict"] == "within" and r0["verdict"] == "within" and r1["verdict"] == "outside"
    assert [r["compute_s"]["verdict"] for r in cmp["ranks"]] == ["within", "within"]
    assert cmp["missed"] == ["comm on rank 1 (rank1) x3.00"] == cmp["outside"]


def test_a_run_of_a_json_shape_is_compared_with_the_shape_its_report_records(tmp_path):
    """The report names a JSON shape's model by its stem, which no lookup finds: compare plans
    the shape the report records (a built-in stays its name, a checkpoint its folder)."""
    import json

    from smoltrain.models.spec import get_model
    from smoltrain.planner.compare import run_model

    f = tmp_path / "l2h64.json"
    shape = {"vocab": 256, "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 4, "ffn": 256, "ctx": 64}
    f.write_text(json.dumps(shape))
    spec = get_model(str(f))
    got = run_model({"model": spec.name, "model_spec": spec.to_dict()})
    assert got == spec
    assert run_model({"model": "tiny", "model_spec": get_model("tiny").to_dict()}) == "tiny"
    assert run_model({"model": "x", "model_spec": {"source": "/m/x", "name": "x"}}) == "/m/x"


def test_an_amortised_plan_is_compared_with_the_mean_of_its_steps():
    """diloco's plan charges every step 1/H of the outer all-reduce: the measured side is the
    mean of the steps (three inner steps at no comm and one outer step), not their median (0)."""
    from smoltrain.planner.compare import per_rank

    plan = {"inner_steps": 4, "step_s": 1.0, "ranks": [{"name": "a", "compute_s": 0.5, "comm_s": 0.25}]}
    comm = [0.0, 0.0, 0.0, 1.0] * 2
    run = {
        "steps": [
            {"step": i, "ranks": [{"rank": 0, "compute_s": 0.5, "comm_s": c, "wait_s": 0.0}]}
            for i, c in enumerate(comm)
        ]
    }
    (row,) = per_rank(plan, run, warmup=0)["ranks"]
    assert row["comm_s"]["measured"] == 0.25 and row["comm_s"]["verdict"] == "within"
    (row,) = per_rank({**plan, "inner_steps": 1}, run, warmup=0)["ranks"]
    assert row["comm_s"]["measured"] == 0.0  # a lockstep plan: the median step
