"""The plan of diloco under `--placement auto` predicts the paced split the run trains
(planner.pacing, planner.pace_plan): each rank's compute, the step, H and the memory, from the
sequences the run gives each host over an outer step's H batches, not the placement's whole
sequences of one batch. Unit: real plans from a hand-built compute report."""

from __future__ import annotations

import pytest
from computetools import write_compute

from smoltrain.planner.pacing import paced_counts, placed_paces
from smoltrain.planner.request import PlanRequest, build_plan
from smoltrain.strategies.roster import slices

NAMES = ["rank0", "rank1", "rank2"]
PER_SEQ = {"rank0": 0.01, "rank1": 0.015, "rank2": 0.015}  # seconds a sequence (the compute report's)


def _plan(tmp_path, strategy="diloco", placement="auto", **kw) -> dict:
    compute = write_compute(tmp_path / "compute.json", NAMES, "rank0", seq=32, slow=0.015)
    kw.setdefault("outer", {"inner_steps": 4})
    req = PlanRequest(strategy, "tiny", world=3, batch=4, seq=32, placement=placement, compute=str(compute), **kw)
    return build_plan(req)


def _run_split(doc: dict, steps: int) -> dict[str, list[int]]:
    """The sequences each rank trains in each inner step of its first outer step, by the run's
    own code: the placement `run` hands its ranks (run.planning) through the roster's slices."""
    sec = doc["placement"]
    placed = {k: sec[k] for k in ("mode", "strategy", "order", "shares")}
    placed["compute_s"] = doc["paced"]["placed_compute_s"]  # as run.planning.plan_run hands it
    names = placed["order"]
    got = paced_counts(placed_paces(placed, doc["batch"]), names, steps, doc["batch"])
    return {n: [hi - lo for lo, hi in slices({"names": names, "paced": got}, doc["batch"], n)[0]] for n in names}


def test_each_ranks_compute_is_the_runs_paced_split_at_its_pace(tmp_path):
    """Whole sequences of a batch of 4 give rank0 two (20 ms) and the others one each (15 ms);
    the run counts 16 sequences over the outer step's 4 batches by the plan's paces (7, 5, 4),
    and the plan's compute per rank is that split at each host's seconds a sequence."""
    doc = _plan(tmp_path)
    assert doc["placement"]["mode"] == "auto" and doc["placement"]["shares"] == pytest.approx([0.5, 0.25, 0.25])
    assert doc["inner_steps"] == 4 and doc["paced"]["placed_sequences"] == [2, 1, 1]
    split = _run_split(doc, 4)
    assert split == {"rank0": [2, 2, 2, 1], "rank1": [1, 1, 1, 2], "rank2": [1, 1, 1, 1]}, split
    assert doc["paced"]["sequences"] == [sum(split[n]) for n in NAMES]
    want = [sum(split[n]) / 4 * PER_SEQ[n] for n in NAMES]  # mean sequences a step x seconds a sequence
    assert doc["compute_s_per_rank"] == pytest.approx(want, rel=1e-6)
    assert [r["sequences_per_step"] for r in doc["ranks"]] == pytest.approx([7 / 4, 5 / 4, 4 / 4])
    assert doc["compute_s_per_step"] == pytest.approx(max(want), rel=1e-6)
    assert doc["step_s"] == pytest.approx(max(want) + doc["comm_s_per_step"], rel=1e-9)
    assert doc["tokens_per_s"] == pytest.approx(4 * 32 / doc["step_s"])
    assert doc["placement"]["predicted"]["auto"]["compute_s_per_rank"] == doc["compute_s_per_rank"]
    assert "paced to 1.75 a step" in doc["placement"]["why"][0]


def test_memory_is_checked_at_the_most_a_rank_trains_in_one_inner_step(tmp_path):
    """rank1 trains 1 or 2 sequences an inner step: its memory is the memory for 2."""
    doc = _plan(tmp_path)
    by = {r["name"]: r for r in doc["ranks"]}
    assert [by[n]["sequences_most"] for n in NAMES] == [2, 2, 1]
    two = {"mode": "even", "strategy": "diloco", "order": NAMES, "shares": [0.25, 0.5, 0.25]}
    even = _plan(tmp_path, placement=two)  # rank1 with 2 sequences of every batch
    assert "paced" not in even
    assert by["rank1"]["memory"]["activations"] == even["ranks"][1]["memory"]["activations"]
    assert by["rank1"]["memory"]["total"] == even["ranks"][1]["memory"]["total"]


def test_h_is_picked_at_the_paced_compute(tmp_path):
    """Without --inner-steps, H keeps communication at the target of the step at the shares
    the paced split tends to (each host's pace over their sum, of the batch), not at the
    placement's whole sequences; the split is made at that H."""
    from smoltrain.planner.diloco import pick_inner_steps

    doc = _plan(tmp_path, outer={"target_comm": 0.05})
    H, pace = doc["inner_steps"], doc["paced"]["sequences_per_s"]
    assert doc["paced"]["inner_steps"] == H and sum(doc["paced"]["sequences"]) == H * 4
    tending = max(4 * p / sum(pace) * PER_SEQ[n] for p, n in zip(pace, NAMES))
    assert pick_inner_steps(doc["outer"]["sync_s"], tending, 0.05) == H
    whole = max(c * PER_SEQ[n] for c, n in zip(doc["paced"]["placed_sequences"], NAMES))
    assert pick_inner_steps(doc["outer"]["sync_s"], whole, 0.05) < H  # the whole sequences' slower step
    split = _run_split(doc, H)
    want = [sum(split[n]) / H * PER_SEQ[n] for n in NAMES]
    assert doc["compute_s_per_rank"] == pytest.approx(want, rel=1e-6)


def test_a_runs_own_paces_are_planned_as_it_ran(tmp_path):
    """plan --compare plans a run's placement document: the paces in it (`compute_s`, what the
    run was handed) decide the split, not the plan's own compute for the placement."""
    pl = {"mode": "auto", "strategy": "diloco", "order": NAMES, "shares": [0.5, 0.25, 0.25]}
    pl["compute_s"] = [0.02, 0.01, 0.03]  # rank1 was thought fast, rank2 slow, when it ran
    doc = _plan(tmp_path, placement=pl)
    assert doc["paced"]["sequences_per_s"] == pytest.approx([100.0, 100.0, 1 / 0.03])
    assert doc["paced"]["sequences"] == [7, 7, 2]
    assert doc["paced"]["placed_compute_s"] == pl["compute_s"]  # what a run of this placement is handed
    assert doc["compute_s_per_rank"] == pytest.approx([7 / 4 * 0.01, 7 / 4 * 0.015, 2 / 4 * 0.015], rel=1e-6)


@pytest.mark.parametrize("strategy, placement", [("diloco", "even"), ("dp", "auto")])
def test_other_splits_keep_whole_sequences_of_each_batch(tmp_path, strategy, placement):
    """An even diloco split and every lockstep strategy keep the placement's sequences a step."""
    doc = _plan(tmp_path, strategy=strategy, placement=placement, outer=None)
    assert "paced" not in doc and all("sequences_per_step" not in r for r in doc["ranks"])
    counts = [round(s * 4) for s in doc["placement"].get("shares") or [1 / 3] * 3] if placement == "auto" else None
    if counts:
        want = [c * PER_SEQ[n] for c, n in zip(counts, doc["placement"]["order"])]
        assert sorted(doc["compute_s_per_rank"]) == pytest.approx(sorted(want), rel=1e-6)
