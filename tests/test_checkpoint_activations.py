"""`run --checkpoint-activations` (models.gpt.run_block): each block keeps its input only and reruns
its forward in backward, so it saves fewer tensors yet gives the same gradients; a run with it
gives the losses of a run without it, and under dp and tp (which reruns forward all-reduces) the
bytes its plan says."""

from __future__ import annotations

import json

import pytest
from hf_train_models import llama_and_text, make

from smoltrain.cli import main


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return llama_and_text(tmp_path_factory.mktemp("ckpt_act"))


@pytest.mark.parametrize("arch", ["llama", "gpt2", "builtin"])
def test_blocks_save_less_and_give_the_same_gradients(ckpt, tmp_path, arch):
    import torch

    from smoltrain.models.gpt import build_model
    from smoltrain.models.spec import get_model

    spec = get_model({"llama": ckpt[0], "builtin": "tiny"}.get(arch) or make(str(tmp_path / "g"), "gpt2"))
    model = build_model(spec, 0)
    x = torch.randint(0, spec.vocab, (2, 16))

    def grads_and_saved(on: bool):
        for block in list(model.units)[1:-1]:
            block.checkpoint = on
        model.zero_grad()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss = model(x).float().logsumexp(-1).mean()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()], len(saved)

    plain, n_plain = grads_and_saved(False)
    ckpt_grads, n_ckpt = grads_and_saved(True)
    assert n_ckpt < n_plain / 2, (n_ckpt, n_plain)
    for a, b in zip(plain, ckpt_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def _run(ckpt, tmp_path, name, extra):
    out = tmp_path / f"{name}.json"
    argv = ["run", "--strategy", "dp", "--model", ckpt[0], "--data", ckpt[1], "--batch", "4", "--seq", "16"]
    argv += ["--threads", "1", "--out", str(tmp_path / name), "--json", str(out), *extra]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_run_with_it_gives_the_same_losses_and_the_plans_bytes(ckpt, tmp_path):
    base = ["--local", "1", "--steps", "3", "--lora-rank", "4", "--lora-dropout", "0.1"]
    plain = _run(ckpt, tmp_path, "plain", base)
    again = _run(ckpt, tmp_path, "ckpt", [*base, "--checkpoint-activations"])
    assert again["config"]["checkpoint_activations"] is True and plain["config"]["checkpoint_activations"] is False
    for a, b in zip(plain["steps"], again["steps"], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6, (a["loss"], b["loss"])
    assert plain["steps"][-1]["loss"] != plain["steps"][0]["loss"], "the adapters must train"

    doc = _run(ckpt, tmp_path, "dp2", ["--local", "2", "--steps", "1", "--checkpoint-activations"])
    assert doc["plan"]["tuning"]["checkpoint_activations"] is True
    plan = {(x["src"], x["dst"]): x["bytes_per_step"] for x in doc["plan"]["links"]}
    sent = {(x["src"], x["dst"]): x["bytes"] / len(doc["steps"]) for x in doc["bytes"]}
    assert sent == plan and sent


@pytest.mark.parametrize("extra", [[], ["--lora-rank", "4", "--lora-targets", "o_proj,down_proj"]])
def test_tp_reruns_the_forward_all_reduces_the_plan_counts(ckpt, tmp_path, extra):
    """A rerun block stops once backward has what it needs: the attention's output all-reduce
    again, not the MLP's, in every block backward reaches (planner.tuning.recompute_leaves)."""
    argv = ["run", "--strategy", "tp", "--local", "2", "--model", ckpt[0], "--data", ckpt[1], "--batch", "4"]
    argv += ["--seq", "16", "--steps", "1", "--threads", "1", "--out", str(tmp_path), "--checkpoint-activations"]
    assert main([*argv, "--json", str(tmp_path / "tp.json"), *extra]) == 0
    doc = json.loads((tmp_path / "tp.json").read_text())
    plan = {(x["src"], x["dst"]): x["bytes_per_step"] for x in doc["plan"]["links"]}
    sent = {(x["src"], x["dst"]): x["bytes"] / len(doc["steps"]) for x in doc["bytes"]}
    assert sent == plan and sent
