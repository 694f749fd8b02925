"""A LoRA rank's share of the measured fixed cost (planner.rank_time, capacity.frozen_grad_bytes):
calibration times a step that trains every weight, whose fixed cost holds the frozen weights'
gradient writes and the embedding's dense gradient; under LoRA the plan charges the per-pass
fixed cost less those bytes at the host's bandwidth, and under full training all of it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from smoltrain.models.spec import ModelSpec
from smoltrain.planner import capacity, rank_time
from smoltrain.planner.devices import get_device
from smoltrain.planner.ranks import Rank
from smoltrain.planner.tuning import Adapter, Tuning

# hidden 32, 4 heads over 2 KV heads, ffn 64, 2 layers, vocabulary 300, tied
MODEL = ModelSpec("t", 300, 2, 32, 4, 2, 64, 64, tied_embeddings=True, gated_mlp=True, learned_pos=False, arch="llama")
LORA = Tuning(
    {"rank": 4, "alpha": 16.0, "dropout": 0.0, "targets": None},
    tuple(Adapter(i + 1, f"model.layers.{i}.self_attn.q_proj", 32, 32, 4, "col", 2 * i) for i in range(2)),
)


def _seconds(tuning, tied=True, bw=1e9):
    model = replace(MODEL, tied_embeddings=tied)
    dev = replace(get_device("generic"), mem_bw=bw)
    rk = Rank("h", dev, 1e12, fixed_s=1.0, measured=True, optimizer_s=0.25)
    w = capacity.layout("dp", "train", model, 1, 4, 16)[0]
    sh = rank_time.Shape("dp", "train", model, "fp32", 4, 16, tuning=tuning)
    return rank_time.seconds(rk, w, sh), model, sh.work(w)


def test_full_training_pays_the_whole_fixed_cost():
    t, model, w = _seconds(None)
    assert capacity.frozen_grad_bytes(w, model) == 0.0
    assert t.compute_s == pytest.approx(t.flops_s + 0.75 + 0.25)


@pytest.mark.parametrize("tied, extra", [(True, 4), (False, 1)])
def test_lora_pays_the_fixed_cost_less_the_frozen_gradients(tied, extra):
    t, model, w = _seconds(LORA, tied)
    adapters = 2 * 4 * (32 + 32)
    assert w.trainable == adapters
    frozen = 4.0 * (model.params() - adapters + extra * 300 * 32)  # by hand: fp32 writes, embedding passes
    assert capacity.frozen_grad_bytes(w, model) == pytest.approx(frozen)
    update = 0.25 * adapters / model.params()
    assert t.compute_s == pytest.approx(t.flops_s + 0.75 - frozen / 1e9 + update)


def test_the_cut_never_goes_below_nothing():
    t, _, _ = _seconds(LORA, bw=1e3)  # a bandwidth so slow the bytes outweigh the fixed cost
    assert t.compute_s == pytest.approx(t.flops_s + 0.25 * 2 * 4 * 64 / MODEL.params())
