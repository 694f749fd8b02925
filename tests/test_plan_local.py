"""Plan against measurement: predicted bytes per link equal what the transport counted in
`smoltrain run --local 2` (tiny model, 2 steps), within 2%, for every strategy run has."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from smoltrain import registry
from smoltrain.models.spec import get_model
from smoltrain.planner.compare import compare
from smoltrain.planner.request import PlanRequest, build_plan
from smoltrain.schema import check_any

ROOT = Path(__file__).resolve().parents[1]
RUN_STRATEGIES = registry.names(trainable=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """All strategies at once (they are small; startup dominates), each with its own report."""
    d = tmp_path_factory.mktemp("plan-local")
    procs = {}
    for s in RUN_STRATEGIES:
        argv = [
            sys.executable,
            "-m",
            "smoltrain",
            "run",
            "--strategy",
            s,
            "--local",
            "2",
            "--steps",
            "2",
            "--batch",
            "8",
            "--seq",
            "64",
            "--microbatches",
            "2",
            "--data-cap-mb",
            "0.1",
            "--json",
            str(d / f"{s}.json"),
            "--out",
            str(d),
        ]
        procs[s] = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = {}
    for s, p in procs.items():
        try:
            log, _ = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            log, _ = p.communicate()
        out[s] = (p.returncode, log, d / f"{s}.json")
    return out


@pytest.mark.parametrize("strategy", RUN_STRATEGIES)
def test_predicted_bytes_match_measured_on_local_runs(runs, strategy):
    rc, log, path = runs[strategy]
    assert rc == 0, log[-2000:]
    run = json.loads(path.read_text())
    cfg = run["config"]
    plan = build_plan(
        PlanRequest(
            strategy,
            get_model(cfg["model"]),
            world=run["world_size"],
            batch=cfg["batch"],
            seq=cfg["seq"],
            microbatches=cfg["microbatches"],
            placement="even",
            calibration=False,
            local=True,
        )
    )
    cmp = compare(plan, run)
    assert cmp["steps"] == 2
    assert {(r["src"], r["dst"]) for r in cmp["links"]} == {("rank0", "rank1"), ("rank1", "rank0")}
    for r in cmp["links"]:
        assert r["measured_bytes_per_step"] > 0
        assert r["ratio"] == pytest.approx(1.0, abs=0.02), r
    assert "plan_error" not in run  # the plan `smoltrain run` showed before launching says the same
    shown = {(ln["src"], ln["dst"]): ln["bytes_per_step"] for ln in run["plan"]["links"]}
    assert shown == {(ln["src"], ln["dst"]): ln["bytes_per_step"] for ln in plan["links"]}


NUMBERS = ("step_s", "compute_s_per_step", "comm_s_per_step", "compute_s_per_rank", "tokens_per_s", "bytes_per_step")


@pytest.mark.parametrize("strategy", ["dp", "syncps", "pp", "tp"])
def test_one_request_gives_one_plan_through_every_entry_point(runs, strategy, tmp_path):
    """The run's own plan, `plan --local 2` with the run's arguments, `plan --compare` of the
    run, the placement section's prediction and request.build_plan: the same numbers and the
    same placement (the demo builds its tables from these same plan and compare documents)."""
    from smoltrain.cli import main
    from smoltrain.planner.request import PlanRequest, build_plan

    rc, log, path = runs[strategy]
    assert rc == 0, log[-2000:]
    ran = json.loads(path.read_text())["plan"]
    shape = ["--batch", "8", "--seq", "64", "--microbatches", "2", "--no-what-if"]
    assert main(["plan", "--strategy", strategy, "--local", "2", *shape, "--json", str(tmp_path / "p.json")]) == 0
    assert main(["plan", "--compare", str(path), "--no-what-if", "--json", str(tmp_path / "c.json")]) == 0
    planned = json.loads((tmp_path / "p.json").read_text())
    compared = json.loads((tmp_path / "c.json").read_text())["plan"]
    built = build_plan(PlanRequest(strategy, "tiny", world=2, batch=8, seq=64, microbatches=2, local=True))
    for doc in (planned, compared, built):
        assert {k: doc[k] for k in NUMBERS} == {k: ran[k] for k in NUMBERS}
        assert {k: doc["placement"].get(k) for k in ("order", "shares", "layers", "heads")} == {
            k: ran["placement"].get(k) for k in ("order", "shares", "layers", "heads")
        }
    assert planned["placement"]["predicted"]["even"]["step_s"] == ran["step_s"]


def test_cli_compare_reads_a_run_report(runs, capsys, tmp_path):
    from smoltrain.cli import main

    rc, log, path = runs["fsdp"]
    assert rc == 0, log[-2000:]
    assert main(["plan", "--compare", str(path), "--no-what-if", "--json", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    assert "predicted vs measured" in out and "all links within 2%" in out
    c = json.loads((tmp_path / "c.json").read_text())
    assert c["schema"] == "smoltrain.compare/1" and c["bytes_within_2pct"]
    check_any(c)
    assert c["step_s"]["measured"] > 0 and c["step_s"]["predicted"] > 0
    # fsdp, world 2: 3 collectives x 1/2 x 721344 x 4 bytes per step on each link
    assert {r["predicted_bytes_per_step"] for r in c["links"]} == {4328064}
