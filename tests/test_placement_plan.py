"""The plan under a placement: per-rank work follows the placement's shares, cuts and heads,
in its rank order, and `plan --placement auto` / `plan --compare` describe the placed run."""

from __future__ import annotations

import json

import pytest
from computetools import write_compute

from smoltrain.models.spec import get_model
from smoltrain.planner import capacity
from smoltrain.planner.plan import make_plan
from smoltrain.planner.ranks import Rank, resolve_ranks

TINY8 = get_model("tiny8")


def test_layout_follows_batch_shares():
    pl = {"mode": "auto", "order": ["a", "b", "c"], "shares": [0.125, 0.375, 0.5]}
    works = capacity.layout("dp", "train", TINY8, 3, 8, 64, placement=pl)
    assert [w.tokens for w in works] == [64, 192, 256]  # 1, 3 and 4 sequences of 64
    even = capacity.layout("dp", "train", TINY8, 3, 8, 64)
    assert sum(w.tokens for w in even) == sum(w.tokens for w in works) == 8 * 64


def test_layout_follows_layer_cuts():
    pl = {"mode": "auto", "order": ["a", "b", "c", "d"], "layers": [[0, 1], [1, 2], [2, 3], [3, 8]]}
    works = capacity.layout("pp", "train", TINY8, 4, 8, 64, 4, placement=pl)
    assert [w.layers for w in works] == [1, 1, 1, 5]
    assert [w.logits for w in works] == [False, False, False, True]
    assert sum(w.params_held for w in works) == pytest.approx(TINY8.params(), rel=1e-6)
    with pytest.raises(ValueError, match="do not cover"):
        capacity.layout("pp", "train", TINY8, 2, 8, 64, placement={"order": ["a", "b"], "layers": [[0, 2], [2, 6]]})


def test_layout_follows_head_split():
    pl = {"mode": "auto", "order": ["a", "b"], "heads": [[0, 3], [3, 4]], "ffn": [[0, 288], [288, 384]]}
    works = capacity.layout("tp", "train", TINY8, 2, 8, 64, placement=pl)
    assert [w.attn_share for w in works] == [0.75, 0.25]
    even = capacity.layout("tp", "train", TINY8, 2, 8, 64)
    assert works[0].matmul_params > even[0].matmul_params > works[1].matmul_params
    # held parameters still add up to the model, the embeddings replicated on each rank
    shared = TINY8.embedding_params()
    assert sum(w.params_held - shared for w in works) == pytest.approx(sum(w.params_held - shared for w in even))


def _ranks(speeds: dict) -> list[Rank]:
    from dataclasses import replace

    out = []
    base = resolve_ranks(1)[0]
    for name, f in speeds.items():
        dev = replace(base.device, flops_fp32=base.device.flops_fp32 * f, mem_bw=base.device.mem_bw * f)
        out.append(Rank(name, dev, base.memory_bytes))
    return out


def test_plan_is_made_in_the_placement_order_and_split():
    ranks = _ranks({"slow": 1.0, "fast": 4.0})
    even = make_plan("dp", TINY8, 2, batch=10, ranks=ranks, single=False)
    pl = {"mode": "auto", "order": ["fast", "slow"], "shares": [0.8, 0.2]}
    placed = make_plan("dp", TINY8, 2, batch=10, ranks=ranks, single=False, placement=pl)
    assert [r["name"] for r in placed["ranks"]] == ["fast", "slow"]
    assert placed["placement_mode"] == "auto" and even["placement_mode"] == "even"
    # the fast host's 8 sequences take it as long as the slow host's 2: the step is shorter
    fast, slow = placed["compute_s_per_rank"]
    assert fast == pytest.approx(slow, rel=0.05)
    assert placed["compute_s_per_step"] < even["compute_s_per_step"]
    assert placed["bytes_per_step"] == even["bytes_per_step"]  # the gradients do not shrink


def _compute(tmp_path, fast="rank0"):
    names = ("rank0", "rank1", "rank2")
    return write_compute(tmp_path / "compute.json", names, fast, model="tiny8", fixed=0.002, slow=0.04)


@pytest.mark.parametrize("strategy", ["dp", "pp"])
def test_plan_auto_predicts_the_placed_run(tmp_path, strategy):
    """The headline step of `plan --placement auto` is the auto placement's, and the even
    figure next to it is the plan remade under the even split."""
    from smoltrain.cli import main

    c, out = _compute(tmp_path), tmp_path / "p.json"
    argv = ["plan", "--strategy", strategy, "--world", "3", "--model", "tiny8", "--batch", "12"]
    argv += ["--microbatches", "4", "--compute", str(c), "--no-what-if", "--json", str(out)]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    sec = doc["placement"]
    assert doc["placement_mode"] == sec["mode"] == "auto" and doc["compute_source"] == "measured"
    assert doc["step_s"] == pytest.approx(sec["predicted"]["auto"]["step_s"])
    assert sec["speedup"] == pytest.approx(sec["predicted"]["even"]["step_s"] / doc["step_s"])
    assert sec["speedup"] > 1.2  # rank0 is 4x faster
    assert main(argv[:-2] + ["--placement", "even", "--json", str(out)]) == 0
    even = json.loads(out.read_text())
    assert even["step_s"] == pytest.approx(sec["predicted"]["even"]["step_s"])


def test_compare_plans_the_runs_own_placement():
    """A placement document is planned exactly (plan --compare, generate): its order and cuts."""
    from smoltrain.planner.links import from_class
    from smoltrain.planner.request import PlanRequest, Setting, build_plan

    ranks = _ranks({"a": 1.0, "b": 3.0})
    pl = {"mode": "auto", "strategy": "pp", "order": ["b", "a"], "layers": [[0, 6], [6, 8]]}
    req = PlanRequest("pp", TINY8, microbatches=4, placement=pl, single=False)
    doc = build_plan(req, Setting(TINY8, ranks, from_class("1gbe"), "nominal"))
    assert [r["name"] for r in doc["ranks"]] == ["b", "a"]
    assert doc["placement"]["layers"] == [[0, 6], [6, 8]]
    assert doc["placement"]["predicted"]["auto"]["step_s"] == doc["step_s"]
    direct = make_plan("pp", TINY8, 2, microbatches=4, ranks=ranks, single=False, placement=pl)
    assert direct["step_s"] == doc["step_s"]


def test_verdict_suggests_auto_only_where_the_split_was_even():
    from smoltrain.planner.verdict import sentence

    doc = {
        "strategy": "pp",
        "world_size": 4,
        "tokens_per_s": 100.0,
        "bottleneck": "compute",
        "bottleneck_detail": {
            "kind": "compute",
            "cause": "rank",
            "rank": 0,
            "host": "a",
            "device": "generic",
            "seconds": 0.1,
            "comm_s": 0.01,
            "work": "FLOPs",
            "per": "step",
        },
        "single_host": {"name": "laptop", "fits": True, "step_s": 0.1, "tokens_per_s": 1000.0},
        "placement_mode": "even",
    }
    assert "--placement auto" in sentence(doc)
    doc["placement_mode"] = "auto"
    assert "--placement auto" not in sentence(doc) and "add faster hosts" in sentence(doc)
