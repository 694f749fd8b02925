"""The planner's fixed formulas against values computed by hand from the published shapes.

Shapes: llama-3.1-8b P = 8,030,527,488, a block 218,120,192, embedding 525,336,576, untied
head unit 525,344,768 (norm + LM head); gpt2-124m P = 124,356,864 (tied), embedding unit
(50257 + 1024) x 768 = 39,383,808, 12 blocks of 7,080,960, final norm 1,536; mixtral-8x7b
active parameters 12,880,191,488 of which 262,152,192 embedding/head.
"""

from __future__ import annotations

import pytest

from smoltrain.models.spec import get_model
from smoltrain.planner.links import from_class
from smoltrain.planner.plan import make_plan, resolve_ranks
from smoltrain.planner.traffic import padded


def _plan(strategy, model, world, **kw):
    kw.setdefault("lm", from_class("10gbe"))
    return make_plan(strategy, get_model(model), world, ranks=resolve_ranks(world), single=False, **kw)


def test_fsdp_memory_holds_one_gathered_unit():
    # llama-3.1-8b, 8 ranks, bf16: weights = shard P/8 + the largest unit (the head) gathered
    d = _plan("fsdp", "llama-3.1-8b", 8, dtype="bf16", batch=1, seq=128)
    m = d["ranks"][0]["memory"]
    assert m["weights"] == int((8_030_527_488 / 8 + 525_344_768) * 2)
    assert m["grads"] == int((8_030_527_488 / 8 + 525_344_768) * 2)
    # before the fix: the whole model gathered (P x 2 bytes on top of the shard)
    assert m["weights"] < 0.3 * (8_030_527_488 / 8 + 8_030_527_488) * 2


def test_fsdp_compute_counts_the_recompute():
    dp = _plan("dp", "gpt2-124m", 2, batch=4, seq=128)
    fs = _plan("fsdp", "gpt2-124m", 2, batch=4, seq=128)
    assert fs["ranks"][0]["flops_per_step"] == pytest.approx(dp["ranks"][0]["flops_per_step"] * 8 / 6)


def test_fsdp_tied_embedding_sent_once():
    # gpt2-124m, 2 ranks, fp32: 3 collectives x (N-1)/N x padded units x 4 bytes
    units = [39_383_808] + [7_080_960] * 12 + [1_536]
    assert sum(units) == 124_356_864  # the tied matrix counted once
    want = 3 * 0.5 * sum(padded(u, 2) for u in units) * 4
    assert _plan("fsdp", "gpt2-124m", 2)["bytes_per_step"] == int(round(want))


def test_moe_training_flops_use_active_parameters():
    d = _plan("dp", "mixtral-8x7b", 1, dtype="bf16", batch=1, seq=128)
    m = get_model("mixtral-8x7b")
    mm = 12_880_191_488 - 262_152_192 + 32_000 * 4096  # active blocks + LM head
    want = 128 * (6 * mm + 12 * 32 * 4096 * 128)
    assert d["ranks"][0]["flops_per_step"] == pytest.approx(want)
    assert m.params() / m.active_params() > 3.5  # what counting every expert overstated


def test_pipeline_logits_on_the_last_stage_only():
    d = _plan("pp", "llama-3.2-1b", 4, batch=1, seq=128)
    h, heads, a, toks = 2048, 32, 4, 128
    per_token = h * (34 + 5 * heads * 128 / h)
    body = toks * 4 * per_token * a / 2  # 4 layers per stage
    acts = [r["memory"]["activations"] for r in d["ranks"]]
    assert acts[0] == int(body) and acts[1] == int(body)
    assert acts[3] == int(body + toks * 128_256 * 4)


def test_1f1b_holds_at_most_p_microbatches():
    # tiny8, 2 stages, 8 microbatches of one sequence: stage 0 holds 2, stage 1 holds 1
    d = _plan("pp", "tiny8", 2, batch=8, seq=64, microbatches=8)
    h, heads, a = 96, 4, 4
    per_layer_token = h * (34 + 5 * heads * 64 / h) * a / 2
    acts = [r["memory"]["activations"] for r in d["ranks"]]
    assert acts[0] == int(2 * 64 * 4 * per_layer_token)
    assert acts[1] == int(1 * 64 * 4 * per_layer_token + 64 * 256 * 4)


def test_parameter_server_aggregation_and_update_count():
    dp = _plan("syncps", "tiny", 1)
    ps = _plan("syncps", "tiny", 3)
    P = get_model("tiny").params()
    bw = resolve_ranks(3)[0].device.mem_bw
    slowest = max(r["compute_s"] for r in ps["ranks"])
    assert ps["compute_s_per_step"] == pytest.approx(slowest + P * (8 * 3 + 28) / bw)
    assert dp["compute_s_per_step"] == pytest.approx(max(r["compute_s"] for r in dp["ranks"]))


def test_sp_decode_ring_hops_in_series():
    lm = from_class("1gbe")
    d = _plan("sp", "llama-3.2-1b", 4, mode="infer", seq=4096, lm=lm)
    ln = lm.get("rank0", "rank1")
    hop = ln.alpha_s + (2 * 2048 * 4 + 32 * 4) / ln.bytes_per_s
    assert d["comm_s_per_step"] == pytest.approx(16 * 4 * hop)


def test_compare_excludes_warm_up_steps():
    from smoltrain.planner.compare import compare

    plan = _plan("dp", "tiny", 2)
    run = {
        "config": {},
        "bytes": [],
        "tokens_per_s": 1.0,
        "steps": [
            {"step": 0, "step_s": 5.0, "comm_s": 2.0, "tokens": 512},
            {"step": 1, "step_s": 0.1, "comm_s": 0.01, "tokens": 512},
            {"step": 2, "step_s": 0.1, "comm_s": 0.01, "tokens": 512},
        ],
    }
    c = compare(plan, run)
    assert c["step_s"]["measured"] == pytest.approx(0.1)
    assert c["comm_s"]["measured"] == pytest.approx(0.01)
    assert c["tokens_per_s"]["measured"] == pytest.approx(5120.0)
