"""Under LoRA only the adapters are synchronised, and the plan counts exactly that: `run --local 2`
on a tiny Llama checkpoint (tests/hf_train_models.py) sends, link by link, the bytes per step
that its plan says, for dp, diloco (the adapters' gradients or pseudo-gradient), tp (activations,
fewer backward all-reduces, the uncut factors' gradients), pp and mp (activations).
`plan --model HF_DIR` refuses a host too small, naming it and the shortfall."""

from __future__ import annotations

import json

import pytest
from hf_train_models import llama_and_text

from smoltrain.cli import main


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return llama_and_text(tmp_path_factory.mktemp("lora"))


def test_the_plan_counts_the_adapters_the_run_trains(ckpt):
    from smoltrain.finetune.tuning import describe
    from smoltrain.models.causal import trainable_params
    from smoltrain.models.spec import get_model

    spec = get_model(ckpt[0])
    lora = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["q_proj", "o_proj", "down_proj"]}
    t = describe(spec, lora)
    assert t.trainable(spec) == trainable_params(spec, lora) == 2 * 4 * ((32 + 32) + (32 + 32) + (64 + 32))
    assert [(a.cut, a.pos) for a in t.adapters[:3]] == [("col", 0), ("row", 0), ("row", 1)]
    assert t.partial() == 2 * 4 * (32 + 32 + 32)  # A of q_proj, B of o_proj and of down_proj


@pytest.mark.parametrize(
    "strategy,extra",
    [
        ("dp", []),
        ("diloco", ["--inner-steps", "1"]),
        ("tp", ["--lora-targets", "q_proj,o_proj,gate_proj,down_proj"]),
        ("pp", ["--microbatches", "2"]),
        ("mp", []),
    ],
)
def test_lora_runs_send_the_plans_bytes(ckpt, tmp_path, strategy, extra):
    model, data = ckpt
    out = tmp_path / "run.json"
    argv = ["run", "--strategy", strategy, "--local", "2", "--model", model, "--data", data, "--lora-rank", "4"]
    argv += ["--steps", "1", "--batch", "4", "--seq", "16", "--threads", "1", "--out", str(tmp_path)]
    assert main([*argv, "--json", str(out), *extra]) == 0
    doc = json.loads(out.read_text())
    plan = {(x["src"], x["dst"]): x["bytes_per_step"] for x in doc["plan"]["links"]}
    sent = {(x["src"], x["dst"]): x["bytes"] / len(doc["steps"]) for x in doc["bytes"]}
    assert sent == plan and sent
    assert doc["plan"]["tuning"]["trainable_params"] == doc["trainable_params"] < doc["model"]["params"] // 10
    if strategy == "dp":  # plan --compare replans the run from its report: its folder and its LoRA settings
        cmp = tmp_path / "cmp.json"
        assert main(["plan", "--compare", str(out), "--no-what-if", "--json", str(cmp)]) == 0
        replanned = json.loads(cmp.read_text())["plan"]
        assert {(x["src"], x["dst"]): x["bytes_per_step"] for x in replanned["links"]} == sent
        assert replanned["tuning"]["lora"] == doc["lora"]


def test_plan_refuses_a_host_too_small(ckpt, tmp_path, capsys):
    inv = tmp_path / "inv.yml"
    inv.write_text(
        "all:\n  children:\n    cluster:\n      hosts:\n"
        "        a: {ansible_connection: local, cluster_ip: 127.0.0.11, device: pi5, smol_memory_gb: 0.0003}\n"
        "        b: {ansible_connection: local, cluster_ip: 127.0.0.12, device: pi5, smol_memory_gb: 0.0002}\n"
    )
    argv = ["plan", "--strategy", "pp", "-i", str(inv), "--model", ckpt[0], "--batch", "4", "--seq", "16"]
    argv += ["--placement", "even", "--no-what-if", "--lora-rank", "4"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("smoltrain: error: pp (LoRA r=4) on 2 ranks does not fit host b: it needs ")
    assert "\n" not in err
    assert err.endswith(" short") and "of its 180 KB usable memory" in err
