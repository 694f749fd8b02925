"""Export forms of a fine-tune: a PEFT adapter folder that peft loads and that gives our logits, the
merged folder and a full folder that transformers load with equal logits (tokenizer and chat template
kept), and `--adapter` for generate/serve: the base read with the adapter folded in."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from finetune_models import CHATS, make_finetune_checkpoint

from smoltrain.finetune import lora
from smoltrain.finetune.adapter import AdaptedCheckpoint, open_checkpoint
from smoltrain.finetune.export import merged_state, write_adapter, write_full
from smoltrain.finetune.lora import LoraConfig
from smoltrain.models.hf import Checkpoint, CheckpointError

IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 11]])


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def tuned(request, tmp_path_factory):
    """(arch, base folder, our adapted transformers model, its adapter folder)."""
    import transformers

    arch = request.param
    base = make_finetune_checkpoint(str(tmp_path_factory.mktemp(arch)), arch=arch)
    model = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    cfg = LoraConfig(rank=4, alpha=8.0, targets=None if arch == "gpt2" else ("q_proj", "v_proj", "down_proj"))
    lora.apply(model, cfg, arch, seed=1)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    state = lora.adapter_state(model)
    adapter = write_adapter(str(tmp_path_factory.mktemp("adapter") / "out"), state, cfg, arch, base)
    return arch, base, model, str(adapter)


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_the_adapter_folder_loads_in_peft_and_gives_our_logits(tuned):
    import peft
    import transformers

    arch, base, ours, adapter = tuned
    cfg = json.loads((Path(adapter) / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    assert torch.allclose(_logits(pm), _logits(ours), atol=1e-5, rtol=1e-5)
    plain = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    assert not torch.allclose(_logits(plain), _logits(ours), atol=1e-3)  # the adapter matters


def test_the_merged_folder_loads_in_transformers_with_our_logits_and_tokenizer(tuned, tmp_path):
    import transformers

    arch, base, ours, adapter = tuned
    out = write_full(str(tmp_path / "merged"), merged_state(base, adapter), base, note={"lora": "merged"})
    m = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert torch.allclose(_logits(m), _logits(ours), atol=1e-4, rtol=1e-4)
    tok, want = transformers.AutoTokenizer.from_pretrained(out), transformers.AutoTokenizer.from_pretrained(base)
    assert tok.apply_chat_template(CHATS[0], tokenize=False) == want.apply_chat_template(CHATS[0], tokenize=False)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_a_full_folder_of_trained_weights_loads_in_transformers(tuned, tmp_path):
    import transformers

    arch, base, _, _ = tuned
    model = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    state = {k: v for k, v in model.state_dict().items() if k in Checkpoint(base).index}
    out = write_full(str(tmp_path / "full"), state, base)
    assert torch.allclose(_logits(transformers.AutoModelForCausalLM.from_pretrained(out)), _logits(model))


def test_adapter_on_the_base_reads_as_the_merged_model(tuned, tmp_path):
    """generate/serve --adapter: every weight a rank reads, whole or a tp window, is the merged weight."""
    from smoltrain.models.split import even_layers
    from smoltrain.models.stage import Stage

    arch, base, ours, adapter = tuned
    merged = write_full(str(tmp_path / "merged"), merged_state(base, adapter), base)
    a, m = open_checkpoint(base, adapter), Checkpoint(str(merged))
    assert isinstance(a, AdaptedCheckpoint) and type(open_checkpoint(base)) is Checkpoint
    assert a.adapted  # it adapts something
    for name in a.adapted:
        full = m.read(name)
        assert torch.allclose(a.read(name), full, atol=1e-6)
        assert torch.allclose(a.read(name, (1, 3), (2, 5)), full[1:3, 2:5], atol=1e-6)
    layers = a.config.layers
    (first, last), ids = even_layers(layers, 1)[0], IDS[:, :5]
    got = Stage(a, first, last, True, True, batched=False)
    want = Stage(m, first, last, True, True, batched=False)
    got.open(0, 8), want.open(0, 8)
    assert torch.allclose(got(ids, [0]), want(ids, [0]), atol=1e-5)
    assert torch.allclose(got(ids[:, :1], [0]), _logits(ours, torch.cat([ids, ids[:, :1]], 1))[:, -1], atol=1e-4)


def test_bad_adapters_are_one_line_errors(tuned, tmp_path):
    arch, base, _, adapter = tuned
    with pytest.raises(CheckpointError, match="not a folder"):
        open_checkpoint(base, str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no adapter_config.json"):
        open_checkpoint(base, str(tmp_path / "empty"))
    dora = tmp_path / "dora"
    dora.mkdir()
    cfg = json.loads((Path(adapter) / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps(dict(cfg, use_dora=True)))
    with pytest.raises(CheckpointError, match="DoRA is not supported"):
        open_checkpoint(base, str(dora))
    other = make_finetune_checkpoint(str(tmp_path / "wide"), arch=arch, layers=1)
    with pytest.raises(CheckpointError, match=r"adapts .*layers?.1|h\.1"):
        open_checkpoint(other, adapter)  # an adapter of a 2-layer model on a 1-layer one
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    t = load_file(f"{adapter}/adapter_model.safetensors")
    t = {k: (v[:, :-1].contiguous() if k.endswith("lora_A.weight") else v) for k, v in t.items()}
    save_file(t, str(bad / "adapter_model.safetensors"))
    with pytest.raises(CheckpointError, match="another model"):
        open_checkpoint(base, str(bad))
    # a failed write leaves nothing behind
    with pytest.raises(CheckpointError):
        write_full(str(tmp_path / "never"), merged_state(base, str(bad)), base)
    assert not (tmp_path / "never").exists() and not list(tmp_path.glob(".never.partial-*"))


def _generate(tmp_path, *args) -> list[int]:
    from smoltrain.cli import main

    out = tmp_path / "gen.json"
    argv = ["generate", "--prompt-ids", "5,17,42,99", "--max-new-tokens", "6", "--ignore-eos", "--json", str(out)]
    assert main([*argv, *args]) == 0
    return json.loads(out.read_text())["output_ids"]


@pytest.mark.parametrize("tuned", ["llama"], indirect=True)  # one architecture is enough for the command line
def test_generate_with_adapter_equals_the_merged_model(tuned, tmp_path, capsys):
    """`--adapter` in one process and on tp ranks (the adapter folder travels as a path in the rank config)."""
    arch, base, ours, adapter = tuned
    merged = str(write_full(str(tmp_path / "merged"), merged_state(base, adapter), base))
    want = _generate(tmp_path, "--strategy", "local", "--model", merged)
    assert _generate(tmp_path, "--strategy", "local", "--model", base, "--adapter", adapter) == want
    assert _generate(tmp_path, "--strategy", "tp", "--local", "2", "--model", base, "--adapter", adapter) == want
    assert _generate(tmp_path, "--strategy", "local", "--model", base) != want  # the adapter changes the answer
    from smoltrain.cli import main

    capsys.readouterr()
    rc = main(["generate", "--model", base, "--adapter", str(tmp_path), "--prompt-ids", "1", "--strategy", "local"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "no adapter_config.json" in err and "\n" not in err


def _run_checkpoint(tmp_path, base: str, arch: str, lora_cfg: LoraConfig | None, tp: bool = False, stages=None):
    """A `smoltrain run` checkpoint as dp's rank 0 (or tp's 2 ranks, or pp's stages) writes one: the trained model's
    parameters (only the adapters under LoRA) as `param.units...` (tp: `param.<unit>...`, each rank's
    slice), and complete.json with the run's model and LoRA settings."""
    from smoltrain.models import causal
    from smoltrain.models.spec import get_model
    from smoltrain.run import checkpoint

    spec = get_model(base)
    model = causal.build(spec)
    if lora_cfg is not None:
        lora.apply(model, lora_cfg, arch, seed=0)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    root = tmp_path / "ckpt"
    units = list(model.units)
    if stages:  # pp: each stage its placement's layers (Embed joins the first, Head the last), from 0
        ranks, lo = [], 1
        for r, n in enumerate(stages):
            first, last = r == 0, r == len(stages) - 1
            ranks.append(torch.nn.Sequential(*units[0 if first else lo : lo + n + (1 if last else 0)]))
            lo += n
    elif not tp:
        ranks = [model]
    else:  # tp over 2 ranks, cut by the strategy's own slicing (models.causal tp_slice)
        n = model.units[1].self_attn.heads if arch == "llama" else model.units[1].attn.heads
        f = spec.ffn
        ranks = []
        for r, (heads, ffn) in enumerate([((0, n // 2), (0, f // 2)), ((n // 2, n), (f // 2, f))]):
            blocks = [b.tp_slice(heads, ffn, _same, _same, keep_bias=r == 0) for b in list(model.units)[1:-1]]
            ranks.append(torch.nn.Sequential(model.units[0], *blocks, model.units[-1]))
    parts = {}
    for r, m in enumerate(ranks):
        tensors = {f"param.{n}": p for n, p in m.named_parameters() if p.requires_grad}
        parts[f"rank{r}"] = checkpoint.save_part(root, 3, f"rank{r}", tensors)
    meta = {
        "strategy": "pp" if stages else "tp" if tp else "dp",
        "world_size": len(ranks),
        "model": spec.name,
        "seed": 0,
    }
    meta.update(model_spec=spec.to_dict(), lora=lora_cfg.to_dict() if lora_cfg else None)
    checkpoint.mark_complete(root, 3, meta, parts)
    return str(root), model.eval()


def _same(t):
    return t


def _ours(model):
    with torch.no_grad():
        return model(IDS)


def _export(capsys, *argv) -> tuple[int, str]:
    from smoltrain.cli import main

    capsys.readouterr()
    rc = main(["export", *argv])
    return rc, capsys.readouterr().err.strip()


def test_export_of_a_run_full_lora_and_merged(tuned, tmp_path, capsys):
    import peft
    import transformers

    arch, base, _, _ = tuned
    root, model = _run_checkpoint(tmp_path / "full", base, arch, None)
    out = tmp_path / "full-out"
    assert _export(capsys, "--checkpoint-dir", root, "--out", str(out))[0] == 0
    got = _logits(transformers.AutoModelForCausalLM.from_pretrained(out).eval())
    assert torch.allclose(got, _ours(model), atol=1e-4, rtol=1e-4)
    assert transformers.AutoTokenizer.from_pretrained(out).chat_template
    rc, err = _export(capsys, "--checkpoint-dir", root, "--out", str(tmp_path / "x"), "--merge")
    assert rc == 2 and "trained the full model" in err and "\n" not in err

    root, model = _run_checkpoint(tmp_path / "lora", base, arch, LoraConfig(rank=2, alpha=4.0))
    want = _ours(model)
    adapter = tmp_path / "adapter"
    assert _export(capsys, "--checkpoint-dir", root, "--out", str(adapter))[0] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), str(adapter))
    assert torch.allclose(_logits(pm.eval()), want, atol=1e-4, rtol=1e-4)
    merged = tmp_path / "merged"
    assert _export(capsys, "--checkpoint-dir", root, "--out", str(merged), "--merge")[0] == 0
    assert torch.allclose(_logits(transformers.AutoModelForCausalLM.from_pretrained(merged).eval()), want, atol=1e-4)


def _serve(model: str, *argv: str):
    """`smoltrain serve` in this process (its own argument parser and build) and an openai client on it."""
    import argparse
    import threading

    import openai

    from smoltrain.commands import serve
    from smoltrain.infer.server import make_server

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args(["--model", model, "--strategy", "local", "--threads", "1", "--api-key", "k", *argv])
    svc, _ = serve.build(args, log=lambda line: None)
    server = make_server(svc, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="k", max_retries=0)
    return svc, server, client


@pytest.mark.parametrize("tuned", ["llama"], indirect=True)
def test_serve_answers_with_the_adapter_through_the_openai_client(tuned, tmp_path):
    arch, base, _, adapter = tuned
    merged = str(write_full(str(tmp_path / "merged"), merged_state(base, adapter), base))
    answers = []
    for model, extra in ((merged, ()), (base, ("--adapter", adapter))):  # (the base alone differs: generate's test)
        svc, server, client = _serve(model, *extra)
        try:
            r = client.chat.completions.create(
                model=client.models.list().data[0].id,
                messages=CHATS[1][:1],
                max_tokens=6,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            answers.append(r.choices[0].message.content)
        finally:
            server.shutdown()
            server.server_close()
            svc.router.close()
    assert answers[1] == answers[0] and answers[0]


def test_a_lora_run_trains_what_peft_and_torch_adamw_train(tmp_path, capsys):
    """End to end: `run --lora-rank` on chats for 2 steps, `export`, then the same 2 AdamW steps by hand on
    transformers' model with the same adapters (same seed, same names) and the same batches: equal adapters."""
    import transformers
    from finetune_models import write_jsonl

    from smoltrain.cli import main
    from smoltrain.finetune import data
    from smoltrain.finetune.adapter import read_adapter

    base = make_finetune_checkpoint(str(tmp_path / "base"))
    chats = write_jsonl(str(tmp_path / "chats.jsonl"), [{"messages": CHATS[i % 2]} for i in range(6)])
    ck, out = tmp_path / "ck", tmp_path / "adapter"
    argv = ["run", "--strategy", "dp", "--local", "1", "--model", base, "--data", chats, "--seq", "100"]
    argv += ["--batch", "2", "--steps", "2", "--lr", "0.01", "--lora-rank", "2", "--checkpoint-dir", str(ck)]
    assert main(argv) == 0
    assert _export(capsys, "--checkpoint-dir", str(ck), "--out", str(out))[0] == 0
    got = read_adapter(str(out)).pairs

    model = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    lora.apply(model, LoraConfig(rank=2), "llama", seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    batches = data.Batches(data.load(chats, base, seq=100), 2, 100, seed=0)
    for step in range(2):
        x, y = batches.global_batch(step)
        logits = model(input_ids=x).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100).backward()
        opt.step()
        opt.zero_grad()
    want = lora.adapter_state(model)
    assert len(got) == len(want) // 2 == 4  # q_proj and v_proj of 2 layers
    for layer, (a, b) in got.items():
        assert torch.allclose(a, want[f"{layer}.lora_A.weight"], atol=1e-5), layer
        assert torch.allclose(b, want[f"{layer}.lora_B.weight"], atol=1e-5), layer
    assert float(next(iter(got.values()))[1].abs().max()) > 1e-3  # B moved from zero: a real check


def test_export_of_a_tp_run_joins_the_ranks_slices(tuned, tmp_path, capsys):
    """tp keeps each block's heads and MLP columns on their rank (GPT-2's c_attn a third of each of q,
    k, v; an output bias on rank 0 only; a LoRA adapter cut like its layer): export joins them back."""
    from safetensors.torch import load_file

    arch, base, _, _ = tuned
    targets = ("q_proj", "v_proj", "o_proj", "down_proj") if arch == "llama" else ("c_attn", "c_proj", "c_fc")
    for name, cfg, file in (
        ("full", None, "model.safetensors"),
        ("lora", LoraConfig(2, targets=targets), "adapter_model.safetensors"),
    ):
        want = {}
        for tp in (False, True):
            root, _ = _run_checkpoint(tmp_path / f"{name}{tp}", base, arch, cfg, tp=tp)
            out = tmp_path / f"{name}{tp}-out"
            assert _export(capsys, "--checkpoint-dir", root, "--out", str(out))[0] == 0
            want[tp] = load_file(str(out / file))
        assert sorted(want[True]) == sorted(want[False])
        for k, v in want[False].items():
            assert torch.equal(want[True][k], v), k


def test_export_of_a_pp_run_with_uneven_stages(tmp_path, capsys):
    """The placement may give stages unequal layers (1 and 2 here, where an even cut is 2 and 1):
    export reads each stage's units from its part, not from an even split."""
    from safetensors.torch import load_file

    base = make_finetune_checkpoint(str(tmp_path / "base"), layers=3)
    for name, cfg, file in (("full", None, "model.safetensors"), ("lora", LoraConfig(2), "adapter_model.safetensors")):
        got = {}
        for stages in (None, [1, 2]):
            root, _ = _run_checkpoint(tmp_path / f"{name}{stages}", base, "llama", cfg, stages=stages)
            out = tmp_path / f"{name}{stages}-out"
            assert _export(capsys, "--checkpoint-dir", root, "--out", str(out))[0] == 0
            got[bool(stages)] = load_file(str(out / file))
        assert sorted(got[True]) == sorted(got[False])
        assert all(torch.equal(got[True][k], v) for k, v in got[False].items())


@pytest.mark.parametrize("tuned", ["llama"], indirect=True)
def test_a_checkpoint_export_cannot_read_is_refused(tuned, tmp_path, capsys):
    """One tp rank's slices passed off as dp's whole model: the shapes do not fit the base (full) or its
    layers (adapters); a mesh run: not read. One line, exit 2, nothing written."""
    from smoltrain.run import checkpoint

    arch, base, _, _ = tuned
    for cfg in (None, LoraConfig(2, targets=("q_proj", "o_proj"))):
        root, _ = _run_checkpoint(tmp_path / f"x{cfg is None}", base, arch, cfg, tp=True)
        meta = json.loads((Path(root) / "step-000003" / "complete.json").read_text())
        rank0 = checkpoint.load_part(root, 3, "rank0")
        fake = str(tmp_path / f"fake{cfg is None}")
        part = checkpoint.save_part(fake, 3, "rank0", {"param.units." + k[6:]: v for k, v in rank0.items()})
        checkpoint.mark_complete(fake, 3, dict(meta, strategy="dp", world_size=1), {"rank0": part})
        rc, err = _export(capsys, "--checkpoint-dir", fake, "--out", str(tmp_path / "never"))
        assert rc == 2 and "\n" not in err and ("has shape" in err or "another model" in err), err
        checkpoint.mark_complete(root, 3, dict(meta, mesh="dp=1,tp=2"), {k: v for k, v in meta["parts"].items()})
        rc, err = _export(capsys, "--checkpoint-dir", root, "--out", str(tmp_path / "never"))
        assert rc == 2 and "--mesh dp=1,tp=2 run" in err
    assert not (tmp_path / "never").exists()
