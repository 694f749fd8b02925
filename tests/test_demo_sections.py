"""The demo's mesh and fine-tuning sections without a sim: the mesh section rendered from plan
documents (which hosts carry which axis, the agreement check, the run check), and the
fine-tuning stage run for real on four loopback hosts (checkpoint made here, plan, LoRA run,
export, answers before and after) with the report section it writes."""

from __future__ import annotations

import io
import json
import sys
import types
from pathlib import Path

import pytest
from computetools import write_compute
from rich.console import Console
from runtools import write_secret

from smoltrain.demo import finetune, mesh
from smoltrain.demo.stages import Stages

HOSTS = {"pi5": "pi5", "jetson": "jetson-orin-nano", "macmini": "mac-mini-m4", "laptop": "rtx4050-laptop"}


def _mesh(layout: str, order: list[str], tps: float, axes: list[tuple[str, int]], coords: list[list[int]]) -> dict:
    return {
        "layout": layout,
        "mesh": {"axes": [{"name": n, "size": k} for n, k in axes], "hosts": coords},
        "order": order,
        "step_s": 512 / tps,
        "tokens_per_s": tps,
        "bottleneck": "compute",
        "links": [{"src": order[0], "dst": order[1], "axis": axes[-1][0], "bytes_per_step": 1000}],
    }


GRID = [[0, 0], [0, 1], [1, 0], [1, 1]]
BEST = _mesh("dp=2,tp=2", ["fast1", "fast2", "gbe", "slowup"], 9000.0, [("dp", 2), ("tp", 2)], GRID)
NEXT = _mesh("pp=2,tp=2", ["gbe", "slowup", "fast1", "fast2"], 6000.0, [("pp", 2), ("tp", 2)], GRID)


def _plan_docs(out: Path, best_mesh: str = "dp=2,tp=2") -> None:
    (out / mesh.PLAN).write_text(json.dumps({"best": "dp=2,tp=2", "meshes": [BEST, NEXT]}))
    single = [
        {"strategy": "dp", "step_s": 0.08, "tokens_per_s": 6400.0, "bottleneck": "communication"},
        {"strategy": "pp", "step_s": 0.1, "tokens_per_s": 5120.0, "bottleneck": "compute"},
    ]
    doc = {"ranking": ["dp", "pp"], "plans": single, "meshes": [BEST, NEXT], "best_mesh": best_mesh}
    (out / "plans.json").write_text(json.dumps(doc))


@pytest.mark.unit
def test_mesh_section_names_the_hosts_of_each_axis_and_checks_the_plans_agree(tmp_path):
    assert mesh.section(tmp_path, "tiny8", 8, 64, 4) == []  # the stage did not run: no section
    _plan_docs(tmp_path)
    (tmp_path / mesh.STAGE).write_text(json.dumps({"quick": True, "check": None}))
    text = "\n".join(mesh.section(tmp_path, "tiny8", 8, 64, 4))
    assert "## 8. Strategies that compose" in text and "batch 8 x 64, 4 microbatches" in text
    assert "| 1 | dp=2,tp=2 | fast1, fast2, gbe, slowup |" in text
    assert "tp: {fast1, fast2}, {gbe, slowup}; dp: {fast1, gbe}, {fast2, slowup} |" in text  # innermost first
    assert "tp: {gbe, slowup}, {fast1, fast2}; pp: {gbe, fast1}, {slowup, fast2} |" in text
    assert "| dp | 80 ms | 6,400 | communication |" in text
    assert "runs 1.41x the best single strategy (dp): the mesh wins" in text
    assert "names the same best layout with the same figures." in text
    assert "--quick: planned only" in text
    _plan_docs(tmp_path, best_mesh="pp=2,tp=2")  # the two plans disagree: the report says so
    assert "**`plan --strategy all` names another best layout" in "\n".join(mesh.section(tmp_path, "tiny8", 8, 64, 4))


@pytest.mark.unit
def test_mesh_run_check_reads_the_runs_compare_beside_the_plans_pick():
    """The section's check from the run's `plan --compare` document (its real making:
    tests/test_mesh_auto_run.py), beside the plan's pick."""
    run = {"steps": [{"step": i, "step_s": 0.1, "tokens": 512, "loss": 1.0} for i in range(6)], "final_loss": 1.0}
    link = {"src": "fast1", "dst": "fast2", "predicted_bytes_per_step": 1000.0, "measured_bytes_per_step": 1000.0}
    cmp = {
        "layout": BEST["layout"],
        "mesh": BEST["mesh"],
        "order": BEST["order"],
        "bytes_exact": True,
        "links": [link],
        "tokens_per_s": {"predicted": BEST["tokens_per_s"], "measured": 5120.0},
    }
    c = mesh.run_check(BEST, cmp, run)
    assert c["same_layout"] and c["same_prediction"] and c["bytes_exact"] and c["steps"] == 6
    assert c["links"] == [{"src": "fast1", "dst": "fast2", "predicted": 1000.0, "measured": 1000.0}]
    cmp |= {"order": list(reversed(BEST["order"])), "bytes_exact": False}
    cmp["tokens_per_s"] = {"predicted": 1.0, "measured": 5120.0}
    c = mesh.run_check(BEST, cmp, run)
    assert not c["same_layout"] and not c["same_prediction"] and not c["bytes_exact"]


def _links(path: Path, names: list[str]) -> None:
    def link(s, d):
        return {
            "src": s,
            "dst": d,
            "status": "ok",
            "throughput_mbit": 940.0,
            "retransmits": 0,
            "rtt_us": {k: 200.0 for k in ("min", "p50", "p90", "p99", "max")},
            "mtu_effective": 1500,
            "mtu_configured": 1500,
            "ceiling_mbit": 1000.0,
            "method": "iperf3",
            "warnings": [],
            "error": None,
        }

    hosts = [
        {"name": n, "address": f"127.0.0.{71 + i}", "iface": "lo", "mtu_configured": 1500}
        | {"link_rate_mbit": 1000, "device": HOSTS[n], "status": "ok", "error": None}
        for i, n in enumerate(names)
    ]
    doc = {
        "schema": "smolnet.links/1",
        "created": "2026-12-06T00:00:00Z",
        "settings": {"duration_s": 1.0, "backend": "iperf3"},
    }
    doc |= {"hosts": hosts, "links": [link(s, d) for s in names for d in names if s != d]}
    path.write_text(json.dumps(doc))


@pytest.mark.timeout(240)
def test_finetune_stage_on_loopback_hosts_answers_before_and_after(tmp_path, monkeypatch):
    """The stage's real command lines on four loopback hosts (fewer steps and questions than the demo's),
    and the section it leaves: the plan's pick and memory per rank, the run, the answers."""
    names = list(HOSTS)
    secret = write_secret(tmp_path / "secret")
    inv = tmp_path / "sim.yml"
    rows = [f"        {n}: {{cluster_ip: 127.0.0.{71 + i}, device: {HOSTS[n]}}}" for i, n in enumerate(names)]
    inv.write_text(
        "all:\n  children:\n    cluster:\n      hosts:\n" + "\n".join(rows) + "\n      vars:\n"
        f"        ansible_connection: local\n        smol_python: {sys.executable}\n"
        f"        smol_secret_file: {secret}\n"
    )
    _links(tmp_path / "links.json", names)
    write_compute(tmp_path / "compute.json", names, "laptop", model="tiny8")
    out = tmp_path / "run"
    out.mkdir()
    demo = types.SimpleNamespace(out=out, py=sys.executable, stages=Stages(Console(file=io.StringIO()), out))
    demo.common = lambda: ["-i", inv, "--links", tmp_path / "links.json", "--compute", tmp_path / "compute.json"]
    monkeypatch.setattr(finetune, "ASK", (0,))  # one question: each answer is two more processes
    assert finetune.stages(demo, steps=4), (out / "demo.log").read_text()[-3000:]
    assert not demo.stages.failed
    d = finetune.folder(out)
    assert (d / "adapter" / "adapter_config.json").exists() and (d / "adapter" / "adapter_model.safetensors").exists()
    s = json.loads((d / finetune.STAGE).read_text())
    run = json.loads((d / "run.json").read_text())
    assert run["strategy"] == s["plan"]["best"]["strategy"] and run["world_size"] == 4
    assert run["lora"]["rank"] == finetune.RANK and len(run["steps"]) == 4
    assert [r["name"] for r in s["ranks"]] == s["plan"]["best"]["hosts"] and all(r["fits"] for r in s["ranks"])
    assert all(a["before"] != a["after"] for a in s["answers"])  # the adapter changed the answers
    text = "\n".join(finetune.section(out, quick=False))
    assert f"fastest setup that fits: **{run['strategy']}** on 4 ranks" in text
    assert "| 0 | pi5 |" in text and "| 3 | laptop |" in text
    assert f"| {finetune.CHATS[0][0]} | `" in text and f"| {finetune.CHATS[0][1]} |" in text
    assert "\n".join(finetune.section(tmp_path, quick=True)).count(finetune.SKIPPED) == 1


@pytest.mark.unit
def test_the_demo_checkpoint_is_a_transformers_llama_folder(tmp_path):
    """What tinymodel writes loads in transformers with every weight named (none missing or
    left over), and its tokenizer renders the chat prompt the stage sends as transformers does."""
    import transformers

    model_dir, _ = finetune.prepare(tmp_path)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert model.config.model_type == "llama" and not any(info[k] for k in ("missing_keys", "unexpected_keys"))
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    question = [{"role": "user", "content": finetune.CHATS[0][0]}]
    want = tok.apply_chat_template(question, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert finetune.prompt_ids(model_dir, finetune.CHATS[0][0]) == ",".join(map(str, want))
