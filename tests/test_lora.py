"""LoRA: the trainable parameters (names and count) are PEFT's for the same config on the same
transformers model, the adapted forward and the merged weights equal PEFT's, only adapters train,
and impossible settings are one-line errors."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from infer_models import make_checkpoint

from smoltrain.finetune import lora
from smoltrain.finetune.lora import LoraConfig, LoraError

ALL_LLAMA = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import transformers

    out = {}
    for arch in ("llama", "gpt2"):
        path = make_checkpoint(str(tmp_path_factory.mktemp(arch)), arch, layers=2)
        out[arch] = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    return out


def _peft(model, cfg: LoraConfig, arch: str):
    import warnings

    import peft

    pc = peft.LoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.targets_for(arch))
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GPT-2's Conv1D: PEFT warns that it sets fan_in_fan_out
        return peft.get_peft_model(copy.deepcopy(model), pc)


def _peft_names(pm) -> dict:
    """PEFT's trainable parameters by its saved names less `base_model.model.` (adapter name dropped)."""
    return {
        n.removeprefix("base_model.model.").replace(".default.", "."): p
        for n, p in pm.named_parameters()
        if p.requires_grad
    }


CASES = [
    ("llama", LoraConfig()),
    ("llama", LoraConfig(rank=4, alpha=8, targets=ALL_LLAMA)),
    ("gpt2", LoraConfig()),
    ("gpt2", LoraConfig(rank=2, alpha=3, targets=("c_attn", "c_proj", "c_fc"))),
]


@pytest.mark.parametrize("arch,cfg", CASES, ids=["llama", "llama-all", "gpt2", "gpt2-all"])
def test_trainable_parameters_forward_and_merge_equal_peft(models, arch, cfg):
    base = models[arch]
    ours = copy.deepcopy(base)
    names = lora.apply(ours, cfg, arch, seed=0)
    pm = _peft(base, cfg, arch)
    theirs = _peft_names(pm)
    mine = {n: p for n, p in ours.named_parameters() if p.requires_grad}
    assert sorted(mine) == sorted(theirs)
    assert sum(p.numel() for p in mine.values()) == pm.get_nb_trainable_parameters()[0]
    assert {n: tuple(p.shape) for n, p in mine.items()} == {n: tuple(p.shape) for n, p in theirs.items()}
    assert sorted(lora.adapter_state(ours)) == sorted(mine)
    assert len(names) == len(mine) // 2
    # the same adapters (B non-zero, so they matter) give the same logits, adapted and merged
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in mine.items():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            theirs[n].copy_(p)
    ids = torch.randint(0, 97, (2, 9), generator=gen)
    with torch.no_grad():
        want, got = pm(input_ids=ids).logits, ours(input_ids=ids).logits
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(got, base(input_ids=ids).logits, atol=1e-3)  # the adapters change the output
    assert lora.merge(ours) == len(names)
    merged = pm.merge_and_unload()
    want_sd, got_sd = merged.state_dict(), ours.state_dict()
    assert sorted(got_sd) == sorted(want_sd)  # no adapter left behind
    for k in want_sd:
        assert torch.allclose(got_sd[k], want_sd[k], atol=1e-6), k
    with torch.no_grad():
        assert torch.allclose(ours(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
        assert torch.allclose(ours(input_ids=ids).logits, want, atol=1e-4, rtol=1e-4)  # (W + BA)x vs Wx + BAx


def test_init_is_peft_s_and_depends_only_on_seed_and_layer(models):
    a, b = copy.deepcopy(models["llama"]), copy.deepcopy(models["llama"])
    lora.apply(a, LoraConfig(rank=4), "llama", seed=5)
    lora.apply(b, LoraConfig(rank=4), "llama", seed=5)
    sa, sb = lora.adapter_state(a), lora.adapter_state(b)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    q0 = sa["model.layers.0.self_attn.q_proj.lora_A.weight"]
    assert not torch.equal(q0, sa["model.layers.1.self_attn.q_proj.lora_A.weight"])
    bound = 1 / math.sqrt(q0.shape[1])  # kaiming_uniform(a=sqrt(5)) on fan_in: U(-1/sqrt(in), 1/sqrt(in))
    assert float(q0.abs().max()) <= bound and float(q0.abs().max()) > bound / 2
    assert all(float(v.abs().max()) == 0 for k, v in sa.items() if "lora_B" in k)
    c = copy.deepcopy(models["llama"])
    lora.apply(c, LoraConfig(rank=4), "llama", seed=6)
    assert not torch.equal(lora.adapter_state(c)["model.layers.0.self_attn.q_proj.lora_A.weight"], q0)


def test_only_adapters_train(models):
    m = copy.deepcopy(models["llama"]).train()
    lora.apply(m, LoraConfig(rank=2, dropout=0.1), "llama", seed=0)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 97, (2, 8))
    for _ in range(2):
        m(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    after = m.state_dict()
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    assert changed and all(".lora_A." in k or ".lora_B." in k for k in changed)
    assert any(".lora_B." in k for k in changed)


def test_impossible_settings_are_one_line_errors(models):
    m = copy.deepcopy(models["llama"])
    with pytest.raises(LoraError, match=r"--lora-targets c_attn: this llama model has no such layer .*q_proj"):
        lora.apply(m, LoraConfig(targets=("q_proj", "c_attn")), "llama", 0)
    with pytest.raises(LoraError, match=r"--lora-rank 40 is larger than model.layers.0.self_attn.q_proj \(32 x 32\)"):
        lora.apply(m, LoraConfig(rank=40), "llama", 0)
    with pytest.raises(LoraError, match="mlp is not a linear layer"):
        lora.apply(m, LoraConfig(targets=("mlp",)), "llama", 0)
    for bad in (dict(rank=0), dict(dropout=1.0), dict(alpha=-1.0), dict(targets=("",))):
        with pytest.raises(LoraError) as e:
            LoraConfig(**bad)
        assert e.value.code == 2 and "\n" not in str(e.value)
    assert LoraConfig.from_dict(LoraConfig(3, 6.0, 0.1, ("q_proj",)).to_dict()) == LoraConfig(3, 6.0, 0.1, ("q_proj",))
    assert lora.parse_targets(" q_proj, v_proj") == ("q_proj", "v_proj")


def test_a_tp_slice_carries_its_share_of_the_adapter(models):
    """Column-parallel q_proj keeps B's rows, row-parallel o_proj A's columns: the halves add up."""
    m = copy.deepcopy(models["llama"])
    lora.apply(m, LoraConfig(rank=2, targets=("q_proj", "o_proj")), "llama", seed=0)
    attn = m.model.layers[0].self_attn
    with torch.no_grad():
        for lin in (attn.q_proj, attn.o_proj):
            lin.lora_B.weight.normal_()
    x = torch.randn(3, 32)
    halves = [slice(0, 16), slice(16, 32)]
    q_parts, o_parts = [], []
    for h in halves:
        q = torch.nn.Linear(32, 16, bias=False)
        o = torch.nn.Linear(16, 32, bias=False)
        with torch.no_grad():
            q.weight.copy_(attn.q_proj.weight[h])
            o.weight.copy_(attn.o_proj.weight[:, h])
        lora.attach_like(q, attn.q_proj, rows=h)
        lora.attach_like(o, attn.o_proj, cols=h)
        q_parts.append(q(x))
        o_parts.append(o(x[:, h]))
    with torch.no_grad():
        assert torch.allclose(torch.cat(q_parts, 1), attn.q_proj(x), atol=1e-5)
        assert torch.allclose(o_parts[0] + o_parts[1], attn.o_proj(x), atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_training_model_takes_the_same_adapters_as_peft(tmp_path, arch):
    """Our trainer's model (models.causal) adapted: PEFT's names (GPT-2's under `transformer.`) and,
    with the same adapter weights, PEFT's logits."""
    import transformers

    from smoltrain.finetune.export import peft_name
    from smoltrain.models import causal
    from smoltrain.models.spec import get_model

    path = make_checkpoint(str(tmp_path / arch), arch, layers=2)
    cfg = LoraConfig(rank=2, alpha=5.0, targets=ALL_LLAMA if arch == "llama" else ("c_attn", "c_proj", "c_fc"))
    ours = causal.build(get_model(path))
    lora.apply(ours, cfg, arch, seed=0)
    pm = _peft(transformers.AutoModelForCausalLM.from_pretrained(path).eval(), cfg, arch)
    theirs = _peft_names(pm)
    state = {peft_name(k, arch): v for k, v in lora.adapter_state(ours).items()}
    assert sorted(state) == sorted(theirs)
    assert sum(p.numel() for p in ours.parameters() if p.requires_grad) == pm.get_nb_trainable_parameters()[0]
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for k, p in state.items():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            theirs[k].copy_(p)
        ids = torch.randint(0, 97, (2, 9), generator=gen)
        assert torch.allclose(ours.eval()(ids), pm(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
