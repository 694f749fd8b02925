"""LoRA on a mesh: `run --mesh dp=2,tp=2 --lora-rank R` on a tiny Llama checkpoint
(tests/hf_train_models.py) sends, link by link, the bytes per step `plan --mesh` says: dp the
adapters' gradients alone, tp its activations and the uncut factors' gradients. Inside pp's
stages tp counts each stage's own adapters (a later stage also all-reduces its input's
gradient). A quantised base and checkpointing on a mesh, and a checkpoint trained in full on a
mesh, are refused in one line (exit 2)."""

from __future__ import annotations

import json

import pytest
from hf_train_models import TEXT, make

from smoltrain.cli import main
from smoltrain.finetune.tuning import describe
from smoltrain.mesh import parse
from smoltrain.models.spec import get_model
from smoltrain.planner.mesh_traffic import adapter_params, axis_traffic, held_params

TARGETS = "q_proj,o_proj,gate_proj,down_proj"  # column- and row-cut layers in attention and MLP


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("meshlora")
    (root / "text.txt").write_text(TEXT)
    return make(str(root / "llama"), "llama"), str(root / "text.txt")


def _plan(argv, tmp_path) -> dict:
    out = tmp_path / "plan.json"
    assert main(["plan", *argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_a_lora_mesh_run_sends_the_plans_bytes(ckpt, tmp_path):
    model, data = ckpt
    common = ["--mesh", "dp=2,tp=2", "--local", "4", "--model", model, "--lora-rank", "4", "--lora-targets", TARGETS]
    common += ["--batch", "4", "--seq", "16"]
    out = tmp_path / "run.json"
    run = ["run", *common, "--data", data, "--steps", "1", "--threads", "1", "--out", str(tmp_path)]
    assert main([*run, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    sent = {(x["src"], x["dst"]): x["bytes"] / len(doc["steps"]) for x in doc["bytes"]}
    e = _plan(common, tmp_path)["meshes"][0]
    planned = {(x["src"], x["dst"]): x["bytes_per_step"] for x in e["links"]}
    assert sent == planned and sent
    spec, lora = get_model(model), doc["lora"]
    t = describe(spec, lora)
    mesh = parse("dp=2,tp=2", 4)
    for ln in e["links"]:
        if ln["axis"] == "dp":  # a 2-rank all-reduce sends each rank's adapters' gradients once
            pl = {"dp": (0, 2), "tp": (mesh.coords(ln["src_rank"])[1], 2)}
            assert ln["bytes_per_step"] == 4 * adapter_params(t, spec, pl, spec.layers)
            assert ln["bytes_per_step"] < 4 * held_params(spec, pl) // 10  # not the frozen base's
    assert all(r["fits"] for r in e["ranks"])


def test_inside_pp_stages_tp_counts_each_stages_adapters(ckpt):
    model, _ = ckpt
    spec = get_model(model)
    t = describe(spec, {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["q_proj", "v_proj"]})
    tp = [tr for axis, _, tr in axis_traffic(parse("pp=2,tp=2", 4), spec, 4, 16, 2, tuning=t) if axis == "tp"]
    first, second = (tr.link_bytes()[(0, 1)] for tr in tp)
    step = 4 * 16 * spec.hidden * 4  # one all-reduce of the activations (fp32), two ranks
    assert second - first == step  # stage 1's input needs its gradient: one more backward all-reduce
    whole = axis_traffic(parse("tp=2,dp=2", 4), spec, 4, 16, 1, tuning=t)[0][2].link_bytes()[(0, 1)]
    assert first + second > whole  # the stage count is not the whole model's, halved


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--lora-rank", "4", "--checkpoint-activations"], "checkpointing are not planned for a mesh"),
        ([], "(a Hugging Face model's under LoRA, --lora-rank)"),
    ],
)
def test_what_the_mesh_plan_does_not_take_is_one_line_exit_2(ckpt, capsys, extra, needle):
    argv = ["plan", "--mesh", "dp=2,tp=2", "--local", "4", "--model", ckpt[0], "--batch", "4", "--seq", "16"]
    assert main([*argv, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_plan_mesh_auto_ranks_lora_layouts_with_adapter_bytes_on_the_data_axes(ckpt, tmp_path):
    model, _ = ckpt
    argv = ["--mesh", "auto", "--local", "4", "--model", model, "--lora-rank", "4", "--batch", "4", "--seq", "16"]
    doc = _plan([*argv, "--microbatches", "2"], tmp_path)
    spec = get_model(model)
    t = describe(spec, {"rank": 4, "alpha": 16.0, "dropout": 0.0, "targets": None})
    assert {e["layout"] for e in doc["meshes"]} >= {"dp=2,pp=2", "dp=2,tp=2", "pp=2,tp=2"}
    for e in doc["meshes"]:
        data = [ln["bytes_per_step"] for ln in e["links"] if ln["axis"] == "dp"]
        assert all(0 < b <= 4 * t.trainable(spec) for b in data), e["layout"]  # adapters, not the base
