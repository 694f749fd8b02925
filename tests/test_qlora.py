"""QLoRA: `run --lora-rank R --quantize int8|q4` trains LoRA adapters on a frozen base held quantised
(models.qlinear). Its loss is PEFT's on transformers' model carrying the dequantised weights; a step
moves the adapters alone (gradients still reach the layers below through the quantised ones); dp
--local 2 reproduces --local 1; dp and diloco send the adapters' bytes, as the plan says; each rank
holds the weight bytes the plan counts; the exported adapter loads in PEFT on the dequantised base;
what cannot train this way is one line, exit 2."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from hf_train_models import TEXT, make

from smoltrain.cli import main
from smoltrain.finetune import lora
from smoltrain.finetune.lora import LoraConfig
from smoltrain.models import quant
from smoltrain.models.causal import build
from smoltrain.models.gpt import loss_sum
from smoltrain.models.hf import Checkpoint
from smoltrain.models.qlinear import QuantLinear
from smoltrain.models.spec import get_model


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("qlora")
    (root / "text.txt").write_text(TEXT)
    out = {"text": str(root / "text.txt")}
    for arch, tied in (("llama", False), ("gpt2", True), ("qwen2", False)):
        out[arch] = make(str(root / arch), arch, tied=tied)
    return out


def held_bytes(model) -> int:
    """Bytes of weights the model holds: its parameters (a tied table once) and quantised layers."""
    params = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() * p.element_size() for p in params) + sum(
        m.nbytes for m in model.modules() if isinstance(m, QuantLinear)
    )


def dequantised_transformers(path: str, ours):
    """transformers' model of `path` with every layer ours holds quantised at its dequantised weight."""
    import transformers

    tm = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    prefix = "transformer." if ours.cfg.family == "gpt2" else ""
    theirs = dict(tm.named_modules())
    with torch.no_grad():
        for name, m in ours.hf_named_modules():
            if isinstance(m, QuantLinear):
                w = m.dequantized()
                key = name if name == "lm_head" else prefix + name
                theirs[key].weight.copy_(w.t() if m.fan_in_fan_out else w)
    return tm


def _peft(tm, cfg: LoraConfig, arch: str):
    import peft

    pc = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, target_modules=list(cfg.targets_for(arch)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GPT-2's Conv1D: PEFT warns that it sets fan_in_fan_out
        return peft.get_peft_model(tm, pc)


@pytest.mark.parametrize("arch,kind", [("llama", "q4"), ("llama", "int8"), ("gpt2", "q4"), ("qwen2", "int8")])
def test_the_loss_on_a_quantised_base_is_peft_on_its_dequantised_weights(ckpts, arch, kind):
    spec = get_model(ckpts[arch])
    ours = build(spec, kind)
    quantised = {n: m for n, m in ours.hf_named_modules() if isinstance(m, QuantLinear)}
    per_layer = 4 if arch == "gpt2" else 7
    assert len(quantised) == 2 * per_layer + (0 if arch == "gpt2" else 1)  # an untied head too
    assert {m.format for m in quantised.values()} == {"q4_0" if kind == "q4" else "q8_0"}
    ckpt = Checkpoint(ckpts[arch])
    for name, m in quantised.items():  # the checkpoint's weight as models.quant quantises it for inference
        w = ckpt.read(name + ".weight").float()
        w = w.t() if m.fan_in_fan_out else w
        fmt = (quant.quantize_q4, quant.dequantize_q4) if kind == "q4" else (quant.quantize_q8_0, quant.dequantize_q8_0)
        assert torch.equal(m.dequantized(), fmt[1](*fmt[0](w))), name
    assert not any(p.requires_grad for p in ours.parameters())
    cfg = LoraConfig(rank=4, alpha=8.0, targets=("c_attn", "c_fc") if arch == "gpt2" else ("q_proj", "down_proj"))
    lora.apply(ours, cfg, arch, seed=0)
    pm = _peft(dequantised_transformers(ckpts[arch], ours), cfg, arch)
    theirs = {n.removeprefix("base_model.model.").replace(".default.", "."): p for n, p in pm.named_parameters()}
    theirs = {n.removeprefix("transformer."): p for n, p in theirs.items() if p.requires_grad}
    assert sorted(lora.adapter_state(ours)) == sorted(theirs)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B away from zero so the adapters matter
        for name, m in lora.adapted(ours):
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=gen) * 0.3)
            theirs[name + ".lora_B.weight"].copy_(m.lora_B.weight)
            theirs[name + ".lora_A.weight"].copy_(m.lora_A.weight)
    ids = torch.randint(0, spec.vocab, (2, 12), generator=gen)
    y = ids[:, 1:]
    got = loss_sum(ours(ids)[:, :-1], y, y.numel())
    want = pm(input_ids=ids, labels=ids).loss
    assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item())
    got.backward()
    want.backward()
    for name, m in lora.adapted(ours):
        for f in ("lora_A", "lora_B"):
            g, h = getattr(m, f).weight.grad, theirs[f"{name}.{f}.weight"].grad
            assert torch.allclose(g, h, rtol=1e-4, atol=1e-6), name


def test_a_step_moves_the_adapters_alone_and_reaches_the_layers_below(ckpts):
    spec = get_model(ckpts["llama"])
    model = build(spec, "q4")
    lora.apply(model, LoraConfig(rank=4), "llama", seed=0)
    frozen = {n: t.clone() for n, t in [*model.named_parameters(), *model.named_buffers()] if not t.requires_grad}
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, spec.vocab, (2, 12), generator=torch.Generator().manual_seed(2))
    loss_sum(model(ids)[:, :-1], ids[:, 1:], 22).backward()
    # layer 0's B has a gradient only through layer 1's quantised projections and the quantised head
    assert model.units[1].self_attn.q_proj.lora_B.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    opt.step()
    now = dict([*model.named_parameters(), *model.named_buffers()])
    assert all(torch.equal(t, now[n]) for n, t in frozen.items())
    assert any(not torch.equal(t, now[n]) for n, t in trained.items() if n.endswith("lora_B.weight"))


def _run(tmp_path, model, data, *extra) -> dict:
    out = tmp_path / f"run{len(list(tmp_path.glob('run*.json')))}.json"
    argv = ["run", "--model", model, "--data", data, "--lora-rank", "4", "--steps", "3", "--batch", "4"]
    argv += ["--seq", "16", "--threads", "1", "--lr", "0.01", "--out", str(tmp_path), "--json", str(out)]
    assert main([*argv, *extra]) == 0
    return json.loads(out.read_text())


def test_dp_and_diloco_train_a_q4_base_as_planned_and_the_adapter_exports(ckpts, tmp_path, capsys):
    import peft
    from safetensors.torch import load_file

    model, data = ckpts["llama"], ckpts["text"]
    one = _run(tmp_path, model, data, "--strategy", "dp", "--local", "1", "--quantize", "q4")
    ck = ["--checkpoint-dir", str(tmp_path / "ck")]
    two = _run(tmp_path, model, data, "--strategy", "dp", "--local", "2", "--quantize", "q4", *ck)
    assert [s["loss"] for s in two["steps"]] == pytest.approx([s["loss"] for s in one["steps"]], abs=1e-5)
    spec = get_model(model)
    ours = build(spec, "q4")
    lora.apply(ours, LoraConfig(rank=4), "llama", seed=0)
    for doc in (one, two):
        assert doc["plan"]["tuning"]["quantize"] == "q4"
        assert [r["memory"]["weights"] for r in doc["plan"]["ranks"]] == [held_bytes(ours)] * doc["world_size"]
    assert held_bytes(ours) < 0.6 * held_bytes(build(spec))  # q4 layers; the embedding and norms stay fp32
    dil = _run(tmp_path, model, data, "--strategy", "diloco", "--local", "2", "--inner-steps", "1", "--quantize", "q4")
    for doc in (two, dil):  # the adapters' bytes alone cross the wire, as the plan counts them
        plan = {(x["src"], x["dst"]): x["bytes_per_step"] for x in doc["plan"]["links"]}
        sent = {(x["src"], x["dst"]): x["bytes"] / len(doc["steps"]) for x in doc["bytes"]}
        assert sent == plan and sent
    assert plan[("rank0", "rank1")] == 4 * doc["trainable_params"]

    adapter = tmp_path / "adapter"
    assert main(["export", "--checkpoint-dir", str(tmp_path / "ck"), "--out", str(adapter)]) == 0
    capsys.readouterr()
    state = load_file(str(adapter / "adapter_model.safetensors"))
    layers = dict(lora.adapted(ours))
    with torch.no_grad():  # the exported adapter onto our quantised model
        for key, t in state.items():
            layer, factor = key.removeprefix("base_model.model.").removesuffix(".weight").rsplit(".", 1)
            getattr(layers[layer], factor).weight.copy_(t)
    assert any(t.abs().sum() > 0 for k, t in state.items() if "lora_B" in k)  # trained
    base = dequantised_transformers(model, ours)
    pm = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
    ids = torch.randint(0, spec.vocab, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.allclose(ours(ids), pm(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "argv,says",
    [
        (["--strategy", "dp", "--quantize", "int8"], "it needs --lora-rank"),
        (["--strategy", "tp", "--quantize", "q4", "--lora-rank", "4"], "a quantised base trains with dp, "),
        (["--strategy", "dp", "--quantize", "q4", "--lora-rank", "4", "--model", "tiny"], "Hugging Face checkpoint"),
    ],
    ids=["no-lora", "tp", "builtin"],
)
def test_what_cannot_train_on_a_quantised_base_is_one_line(ckpts, tmp_path, capsys, argv, says):
    base = ["run", "--local", "2", "--model", ckpts["llama"], "--data", ckpts["text"], "--out", str(tmp_path)]
    assert main([*base, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err
    assert not list(tmp_path.glob("*.png"))
