"""Hugging Face checkpoints train (`smoltrain run --model HF_DIR`) and generate exactly as transformers.

Each architecture (Llama with Llama 3's rope scaling, Qwen2 with q/k/v biases, Qwen3 with its
per-head q/k norms and head_dim != hidden/heads, GPT-2, and a tied Qwen2) is a tiny random
checkpoint that transformers itself writes. Against transformers: the logits, the loss of
`model(input_ids, labels=...)`, one AdamW step (torch.optim.AdamW, same batch), greedy
generation token for token. Across ranks: dp, pp and tp on a checkpoint reproduce `--local 1`
and send exactly the bytes their plan says, link by link.
"""

from __future__ import annotations

import json
import shutil

import pytest
from hf_train_models import TEXT, make
from infer_models import reference

from smoltrain.cli import main
from smoltrain.schema import check_any

ARCHS = ["llama", "qwen2", "qwen3", "gpt2"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {a: make(str(root / a), a) for a in ARCHS}
    out["qwen2-tied"] = make(str(root / "qwen2-tied"), "qwen2", tied=True)
    (root / "text.txt").write_text(TEXT)
    out["text"] = str(root / "text.txt")
    return out


def _hf(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()


def test_config_fields_of_each_architecture(ckpts):
    from smoltrain.models.hf import read_config

    llama, qwen2, qwen3 = (read_config(ckpts[a]) for a in ("llama", "qwen2", "qwen3"))
    assert llama.rope_scaling == (8.0, 1.0, 4.0, 16.0) and llama.rope_theta == 500000.0
    assert qwen2.qkv_bias and not qwen2.bias and not qwen2.qk_norm
    assert qwen3.qk_norm and qwen3.head_dim == 16 and qwen3.hidden == 32
    assert read_config(ckpts["qwen2-tied"]).tied


@pytest.mark.parametrize("arch", ARCHS + ["qwen2-tied"])
def test_logits_loss_and_params_equal_transformers(ckpts, arch):
    import torch

    from smoltrain.models.causal import build
    from smoltrain.models.gpt import loss_sum
    from smoltrain.models.spec import get_model

    spec = get_model(ckpts[arch])
    ref, ours = _hf(ckpts[arch]), build(spec)
    assert spec.params() == sum(p.numel() for p in ref.parameters()) == sum(p.numel() for p in ours.parameters())
    ids = torch.randint(0, spec.vocab, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids, labels=ids)
        logits = ours(ids)
    assert torch.allclose(logits, want.logits, atol=1e-5, rtol=0), (logits - want.logits).abs().max()
    y = torch.cat([ids[:, 1:], torch.full((3, 1), -100)], 1)  # transformers' shift: no target after the last
    loss = float(loss_sum(logits, y, int((y != -100).sum())))
    assert abs(loss - float(want.loss)) <= 1e-5 * float(want.loss)


@pytest.mark.parametrize("arch", ARCHS)
def test_one_adamw_step_equals_torch(ckpts, arch):
    """`--local 1` (dp on one rank: the strategy and optimizer the run uses) against transformers'
    model trained by torch.optim.AdamW on the same tokens."""
    import torch

    from smoltrain.finetune.data import load
    from smoltrain.models.data import make_batches
    from smoltrain.models.spec import get_model
    from smoltrain.run.config import RunConfig
    from smoltrain.strategies import Context, load_strategy

    spec, lr = get_model(ckpts[arch]), 1e-2
    data = load(ckpts["text"], ckpts[arch], 16)  # what the controller sends every rank
    cfg = RunConfig("dp", "socket", spec, 1, 4, 16, lr, 0, ("rank0",), ("cpu",), data_digest=data.digest())
    batches = make_batches(cfg, data.to_bytes())
    strat = load_strategy("dp")(Context(rank=0, world=1, run=cfg, batches=batches))
    before = {k: v.detach().clone() for k, v in strat.model.hf_state_dict().items()}
    strat.train_step(0)

    ref = _hf(ckpts[arch])
    x, y = batches.global_batch(0)
    opt = torch.optim.AdamW(ref.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    ref(x, labels=y, shift_labels=y).loss.backward()  # y is already shifted: position t's target is y[t]
    opt.step()
    want = {k.removeprefix("transformer."): v for k, v in ref.state_dict().items()}
    moved = 0.0
    for name, p in strat.model.hf_state_dict().items():
        p, w, b = p.detach(), want[name].clone(), before[name]
        key = slice(None) if name.endswith("k_proj.bias") else slice(32, 64) if name.endswith("c_attn.bias") else None
        if key is not None:
            # softmax ignores a key bias (it adds q.b to every score of a row): its gradient is
            # rounding noise, which AdamW's g/sqrt(v) turns into a step of up to lr either way
            assert (p[key] - b[key]).abs().max() <= lr * 1.01 and (w[key] - b[key]).abs().max() <= lr * 1.01
            p = p.clone()
            p[key] = w[key] = 0.0
        assert torch.allclose(p, w, atol=1e-5, rtol=0), (name, (p - w).abs().max())
        moved = max(moved, float((p - b).abs().max()))
    assert moved > 1e-3, "the step must move the weights for the comparison to mean anything"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_generate_matches_transformers(ckpts, tmp_path, arch):
    prompt = [3, 5, 7, 9, 11]
    want = reference(ckpts[arch], prompt, 8)
    out = tmp_path / "gen.json"
    argv = ["generate", "--strategy", "local", "--model", ckpts[arch], "--prompt-ids", "3,5,7,9,11"]
    assert main([*argv, "--max-new-tokens", "8", "--ignore-eos", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["output_ids"] == want


def _run(ckpts, tmp_path, strategy, world, *extra):
    tmp_path.mkdir(exist_ok=True)
    out = tmp_path / f"{strategy}{world}.json"
    argv = ["run", "--strategy", strategy, "--local", str(world), "--model", ckpts["qwen3"], "--data", ckpts["text"]]
    argv += ["--steps", "2", "--batch", "4", "--seq", "16", "--threads", "1", "--out", str(tmp_path)]
    assert main([*argv, "--json", str(out), *extra]) == 0
    doc = json.loads(out.read_text())
    check_any(doc)  # smoltrain.run/1 with model, trainable_params, lora, loss_tokens
    return doc


@pytest.fixture(scope="module")
def local1(ckpts, tmp_path_factory):
    return _run(ckpts, tmp_path_factory.mktemp("local1"), "dp", 1)


@pytest.mark.parametrize("strategy,extra", [("dp", []), ("fsdp", []), ("pp", ["--microbatches", "2"]), ("tp", [])])
def test_strategies_reproduce_local_and_their_plan(ckpts, local1, tmp_path, strategy, extra):
    """Qwen3 (GQA, q/k norms, head_dim 16 over hidden 32): each strategy's losses are --local 1's
    and each link carries exactly the plan's bytes per step."""
    doc = _run(ckpts, tmp_path, strategy, 2, *extra)
    for a, b in zip(local1["steps"], doc["steps"]):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["loss"], b["loss"])
        assert b["loss_tokens"] == 4 * 16
    assert doc["model"] == {"name": "qwen3", "arch": "qwen3", "params": local1["model"]["params"]}
    assert doc["trainable_params"] == doc["model"]["params"] and doc["lora"] is None
    plan = {(x["src"], x["dst"]): x["bytes_per_step"] for x in doc["plan"]["links"]}
    sent = {(x["src"], x["dst"]): x["bytes"] / len(doc["steps"]) for x in doc["bytes"]}
    assert sent == plan and sent


def _error(capsys, argv) -> str:
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0, err
    return err


def test_bad_checkpoints_and_sequences_exit_2(ckpts, tmp_path, capsys):
    base = ["run", "--strategy", "dp", "--local", "1", "--data", ckpts["text"], "--steps", "1"]
    bare = tmp_path / "bare"
    shutil.copytree(ckpts["llama"], bare)
    (bare / "tokenizer.json").unlink()
    assert "no tokenizer.json" in _error(capsys, [*base, "--model", str(bare)])
    assert "model's context 64" in _error(capsys, [*base, "--model", ckpts["llama"], "--seq", "65"])
    for field, value, named in [
        ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "'yarn'"),
        ("use_sliding_window", True, "sliding_window"),
        ("model_type", "mistral", "'mistral'"),
    ]:
        other = tmp_path / field
        shutil.copytree(ckpts["qwen2"], other)
        cfg = json.loads((other / "config.json").read_text())
        cfg.pop("rope_parameters", None)
        (other / "config.json").write_text(json.dumps(dict(cfg, **{field: value})))
        assert named in _error(capsys, [*base, "--model", str(other)])
    tied = ["run", "--strategy", "pp", "--local", "2", "--model", ckpts["qwen2-tied"], "--data", ckpts["text"]]
    assert "ties its LM head" in _error(capsys, tied)
    llama = [*base, "--model", ckpts["llama"], "--lora-rank"]
    assert "no such layer" in _error(capsys, [*llama, "4", "--lora-targets", "qkv"])
    assert "--lora-rank 64 is larger than" in _error(capsys, [*llama, "64"])
    assert "LoRA trains with" in _error(capsys, [*llama, "4", "--strategy", "fsdp"])


def test_lora_under_tp_reproduces_local(ckpts, tmp_path):
    """LoRA on every projection of Qwen3, tp over 2 ranks against one rank: column-parallel layers
    cut B by rows, row-parallel ones A by columns, and the uncut factors' partial gradients are summed."""
    lora = ["--lora-rank", "4", "--lora-targets", "q_proj,k_proj,v_proj,o_proj,gate_proj,down_proj", "--lr", "1e-2"]
    one, two = _run(ckpts, tmp_path, "tp", 1, *lora), _run(ckpts, tmp_path / "2", "tp", 2, *lora)
    for a, b in zip(one["steps"], two["steps"]):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["loss"], b["loss"])
    assert one["steps"][-1]["loss"] != one["steps"][0]["loss"], "the adapters must train"
    assert two["lora"]["rank"] == 4 and 0 < two["trainable_params"] < two["model"]["params"] // 5


@pytest.mark.parametrize("arch", ARCHS + ["qwen2-tied"])
def test_a_serving_stage_is_the_training_model(ckpts, arch):
    """One definition (models.blocks): a stage builds the trainer's blocks by their checkpoint names,
    a tp rank reads from disk exactly the window tp_slice cuts from the whole block, and the packed
    decode view gives the training model's logits, on the prefill and on a decode step."""
    import torch

    from smoltrain.models import causal
    from smoltrain.models.hf import Checkpoint
    from smoltrain.models.spec import get_model
    from smoltrain.models.stage import Stage

    ck, model = Checkpoint(ckpts[arch]), causal.build(get_model(ckpts[arch]))
    for rank in (0, 1):
        heads, ffn = causal.tp_share(ck.config, rank, 2)
        want = dict(model.units[2].tp_slice(heads, ffn, None, None, keep_bias=True).named_parameters())
        got = dict(causal.load_block(ck, 1, rank, 2).named_parameters())
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    ids = torch.randint(0, ck.config.vocab, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids)[0, 7:]
    for batched in (True, False):
        st = Stage(ck, 0, ck.config.layers, True, True, batched=batched)
        st.open(0, 16)
        got = torch.cat([st(ids[:, :8], [0]), st(ids[:, 8:], [0])])
        assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
