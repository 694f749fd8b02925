"""The fine-tuning plan's arithmetic (planner.tuning): memory per rank for full training, LoRA,
a quantised base and checkpointed activations on a shape equal to the tiny Llama checkpoint of
tests/hf_train_models.py, checked against numbers derived by hand; tp's LoRA traffic; a layout
that does not fit refused in one line naming the host and the shortfall (exit 2)."""

from __future__ import annotations

import pytest

from smolnet.errors import UsageError
from smoltrain.cli import main
from smoltrain.models.spec import ModelSpec, get_model
from smoltrain.planner.plan import make_plan
from smoltrain.planner.tuning import Adapter, Tuning

# tests/hf_train_models.make(arch="llama"): hidden 32, 4 heads over 2 KV heads, ffn 64, 2 layers,
# vocab 300 (its byte-level tokenizer), untied head
LLAMA = ModelSpec(
    "llama", 300, 2, 32, 4, 2, 64, 64, tied_embeddings=False, gated_mlp=True, learned_pos=False, arch="llama"
)
P = 2 * (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32) + 2 * 300 * 32 + 32  # 37,792


def lora(rank=4, names=("q_proj", "v_proj"), layers=2) -> Tuning:
    """PEFT's default targets: q_proj 32 -> 32, v_proj 32 -> 16 (2 KV heads of 8) in each block."""
    shape = {"q_proj": (32, 32, "col"), "v_proj": (32, 16, "col"), "o_proj": (32, 32, "row")}
    out = []
    for i in range(layers):
        for n in names:
            fin, fout, cut = shape[n]
            out.append(Adapter(i + 1, f"model.layers.{i}.self_attn.{n}", fin, fout, rank, cut, 2 * i))
    return Tuning({"rank": rank, "alpha": 16.0, "dropout": 0.0, "targets": None}, tuple(out))


def mem(strategy="dp", tuning=None, dtype="fp32", world=2):
    d = make_plan(strategy, LLAMA, world, dtype=dtype, batch=4, seq=16, single=False, tuning=tuning)
    return d, d["ranks"][0]["memory"]


def test_memory_of_full_lora_qlora_and_checkpointing_by_hand():
    assert LLAMA.params() == P == 37792
    T = 2 * (4 * (32 + 32) + 4 * (32 + 16))  # 896 adapter weights
    assert lora().trainable(LLAMA) == T
    # dp, 2 ranks, fp32: each holds the model and trains 2 of the 4 sequences of 16 tokens
    tokens, per_token = 2 * 16, 32 * (34 + 5 * 4 * 16 / 32)  # Korthikanti's activations per layer
    acts = tokens * 2 * per_token * 4 / 2 + tokens * 300 * 4  # two layers at 4 bytes, halved; fp32 logits
    _, full = mem()
    assert (full["weights"], full["grads"], full["optimizer"], full["activations"]) == (4 * P, 4 * P, 8 * P, acts)
    assert full["total"] == 16 * P + acts and full["fits"] and full["host_bytes"] > full["total"]
    _, lo = mem(tuning=lora())
    assert (lo["weights"], lo["grads"], lo["optimizer"], lo["activations"]) == (4 * P + 4 * T, 4 * T, 8 * T, acts)
    # bf16: weights and gradients at 2 bytes, AdamW's two moments and an fp32 master copy per trained weight
    _, bf = mem(tuning=lora(), dtype="bf16")
    assert (bf["weights"], bf["grads"], bf["optimizer"]) == (2 * P + 2 * T, 2 * T, 12 * T)
    # int8 base (QLoRA): the blocks' linear weights and the head's at Q8_0's 17/16 bytes; embeddings, norms (the
    # blocks' too: models.qlinear quantises linear layers only) and adapters at the dtype
    q = Tuning(lora().lora, lora().adapters, "int8")
    _, qm = mem(tuning=q)
    matmul = 2 * (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64) + 300 * 32  # the two blocks' linears and the LM head
    assert qm["weights"] == int(matmul * 17 / 16 + (P - matmul) * 4 + 4 * T)
    # checkpointing: each layer's input (and the embeddings' and the head's) kept, one layer's full set live
    ck = Tuning(lora().lora, lora().adapters, checkpoint_activations=True)
    d, cm = mem(tuning=ck)
    assert cm["activations"] == int(tokens * 4 * 32 * 4 + tokens * per_token * 4 / 2 + tokens * 300 * 4)
    assert cm["activations"] < lo["activations"]
    assert d["tuning"] == {"lora": lora().lora, "trainable_params": T, "quantize": None, "checkpoint_activations": True}


def test_lora_memory_is_far_below_full_on_a_1b_model():
    m = get_model("llama-3.2-1b")
    ad = [Adapter(i + 1, f"l{i}.q_proj", 2048, 2048, 8, "col") for i in range(16)]
    ad += [Adapter(i + 1, f"l{i}.v_proj", 2048, 512, 8, "col") for i in range(16)]
    t = Tuning({"rank": 8, "alpha": 16.0, "dropout": 0.0, "targets": None}, tuple(ad))
    kw = dict(batch=1, seq=256, single=False)
    full = make_plan("dp", m, 1, dtype="bf16", **kw)["ranks"][0]["memory"]
    lo = make_plan("dp", m, 1, dtype="bf16", tuning=t, **kw)["ranks"][0]["memory"]
    q4 = make_plan("dp", m, 1, dtype="bf16", tuning=Tuning(t.lora, t.adapters, "q4"), **kw)["ranks"][0]["memory"]
    assert lo["grads"] + lo["optimizer"] < (full["grads"] + full["optimizer"]) / 500
    assert q4["total"] < lo["total"] < full["total"] / 3


def test_lora_traffic_dp_diloco_and_tp():
    T = lora().trainable(LLAMA)
    d, _ = mem(tuning=lora())
    assert [x["bytes_per_step"] for x in d["links"]] == [4 * T, 4 * T]  # ring all-reduce: 2(N-1)/N of 4T
    # tp: q (column-parallel: A whole, 4 x 32) and o (row-parallel: B whole, 32 x 4) in each block; the first
    # block's attention input needs no gradient, so 2 x 2 forward and 3 backward all-reduces of b*s*h
    t = lora(names=("q_proj", "o_proj"))
    d = make_plan("tp", LLAMA, 2, batch=4, seq=16, single=False, tuning=t)
    acts = (2 * 2 + 3) * 2 * (4 * 16 * 32 * 4) / 2
    partial = 2 * (4 * 32 + 32 * 4) * 4
    assert [x["bytes_per_step"] for x in d["links"]] == [acts + partial] * 2
    d = make_plan("diloco", LLAMA, 2, batch=4, seq=16, single=False, tuning=lora(), outer={"inner_steps": 1})
    assert [x["bytes_per_step"] for x in d["links"]] == [4 * T, 4 * T]
    with pytest.raises(UsageError, match="LoRA trains with"):
        make_plan("fsdp", LLAMA, 2, batch=4, seq=16, single=False, tuning=lora())
    with pytest.raises(UsageError, match="needs --lora-rank"):
        Tuning(quantize="q4")


def test_a_layout_that_does_not_fit_is_refused_naming_host_and_shortfall(tmp_path, capsys):
    inv = tmp_path / "inv.yml"
    inv.write_text(
        "all:\n  children:\n    cluster:\n      hosts:\n"
        "        big: {ansible_connection: local, cluster_ip: 127.0.0.11, device: pi5, smol_memory_gb: 0.002}\n"
        "        small: {ansible_connection: local, cluster_ip: 127.0.0.12, device: pi5, smol_memory_gb: 0.0001}\n"
    )
    argv = ["plan", "--strategy", "dp", "-i", str(inv), "--model", "tiny", "--placement", "even", "--no-what-if"]
    rc = main([*argv, "--checkpoint-activations"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0, err
    head, _, rest = err.partition("dp (full) on 2 ranks does not fit host small: it needs ")
    assert head == "smoltrain: error: " and rest.endswith(" MB short"), err
    assert " MB of its 90 KB usable memory, " in rest  # 0.0001 GB less the 10% kept for the system
    assert main(argv) == 0  # a built-in model without fine-tuning flags: planned, bottleneck capacity, as before
    assert "does not fit" in capsys.readouterr().out


def test_the_verdict_names_the_fastest_setup_that_fits():
    from smoltrain.planner import verdict

    m = get_model("llama-3.2-1b")
    ad = [Adapter(i + 1, f"l{i}.q_proj", 2048, 2048, 8, "col") for i in range(16)]
    t = Tuning({"rank": 8, "alpha": 16.0, "dropout": 0.0, "targets": None}, tuple(ad))
    kw = dict(dtype="bf16", batch=2, seq=128)
    lo, full = make_plan("dp", m, 2, tuning=t, **kw), make_plan("dp", m, 2, **kw)
    assert verdict.shortfall(full)["name"] == "rank0" and verdict.shortfall(lo) is None  # generic hosts: 8 GB
    v = verdict.setups([full, lo])
    assert v["best"]["strategy"] == "dp" and v["best"]["lora_rank"] == 8 and v["best"]["hosts"] == ["rank0", "rank1"]
    assert v["single_host"]["lora_rank"] == 8  # full training fits no host alone either
    assert v["speedup"] == lo["tokens_per_s"] / lo["single_host"]["tokens_per_s"]
    words = verdict.setups_sentence(v)
    assert words.startswith("Fastest setup that fits: dp with LoRA r=8 on 2 ranks (rank0, rank1)")
    assert verdict.setups_sentence(verdict.setups([full])).startswith("No setup fits")
