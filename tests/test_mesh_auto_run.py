"""`run --mesh auto` runs the layout `plan --mesh auto` picks for the same ranks, and moves the
bytes that layout's plan says, link by link (real worker processes on loopback)."""

from __future__ import annotations

import json
import subprocess
import sys

from smoltrain.cli import main
from smoltrain.mesh import parse

SHAPE = ["--batch", "6", "--seq", "32", "--microbatches", "2"]
STEPS = 2


def cli(args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "smoltrain", *args], capture_output=True, text=True, timeout=timeout)


def test_run_mesh_auto_runs_the_plans_pick(tmp_path, capsys):
    assert main(["plan", "--mesh", "auto", "--local", "4", *SHAPE, "--json", str(tmp_path / "plan.json")]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    best = plan["meshes"][0]
    secret = tmp_path / "secret"
    secret.write_text("ab" * 32)
    secret.chmod(0o600)
    args = ["run", "--local", "4", "--mesh", "auto", "--steps", str(STEPS), *SHAPE, "--optimizer", "sgd"]
    args += ["--secret-file", str(secret), "--out", str(tmp_path), "--json", str(tmp_path / "run.json")]
    p = cli(args)
    assert p.returncode == 0, p.stdout[-800:] + p.stderr[-800:]
    assert f"mesh auto: {best['layout']} on rank0, rank1, rank2, rank3" in p.stdout
    doc = json.loads((tmp_path / "run.json").read_text())
    assert doc["mesh"] == best["mesh"] == parse(plan["best"], 4).report()
    measured = {(int(b["src"][4:]), int(b["dst"][4:])): b["bytes"] for b in doc["bytes"]}
    assert measured == {(ln["src_rank"], ln["dst_rank"]): STEPS * ln["bytes_per_step"] for ln in best["links"]}


def test_run_mesh_auto_with_no_layout_is_one_line_exit_2():
    p = cli(["run", "--local", "3", "--mesh", "auto", "--steps", "1"])
    assert p.returncode == 2 and "no layout of 3 ranks" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_plan_compare_of_a_mesh_run_plans_its_mesh_on_its_hosts(tmp_path):
    """`plan --compare` of a `run --mesh dp=2,tp=2` report plans that mesh on the run's hosts in
    its rank order (what `plan --mesh dp=2,tp=2` says for the same request and measured compute),
    not a 1-D tp plan over the four ranks: the same step time, and the measured bytes exactly."""
    from computetools import write_compute

    from smoltrain.schema import check_any

    names = [f"rank{r}" for r in range(4)]
    compute = str(write_compute(tmp_path / "compute.json", names, "rank2", seq=32))  # one rank 3x faster
    secret = tmp_path / "secret"
    secret.write_text("cd" * 32)
    secret.chmod(0o600)
    args = ["run", "--local", "4", "--mesh", "dp=2,tp=2", "--steps", str(STEPS), *SHAPE, "--optimizer", "sgd"]
    args += ["--compute", compute, "--secret-file", str(secret), "--out", str(tmp_path)]
    p = cli([*args, "--json", str(tmp_path / "run.json")])
    assert p.returncode == 0, p.stdout[-800:] + p.stderr[-800:]
    planned = tmp_path / "plan.json"
    plan = ["plan", "--mesh", "dp=2,tp=2", "--local", "4", *SHAPE, "--compute", compute, "--json", str(planned)]
    assert main(plan) == 0
    best = json.loads(planned.read_text())["meshes"][0]
    cmp_path = tmp_path / "compare.json"
    assert main(["plan", "--compare", str(tmp_path / "run.json"), "--compute", compute, "--json", str(cmp_path)]) == 0
    cmp = json.loads(cmp_path.read_text())
    check_any(cmp)
    assert cmp["layout"] == "dp=2,tp=2" and cmp["mesh"] == best["mesh"] and cmp["order"] == names
    assert cmp["plan"]["schema"] == "smoltrain.meshplan/1" and cmp["plan"]["best"] == "dp=2,tp=2"
    assert abs(cmp["step_s"]["predicted"] - best["step_s"]) <= 1e-9 * best["step_s"]
    assert abs(cmp["tokens_per_s"]["predicted"] - best["tokens_per_s"]) <= 1e-9 * best["tokens_per_s"]
    assert {(r["src"], r["dst"]): r["predicted_bytes_per_step"] for r in cmp["links"]} == {
        (ln["src"], ln["dst"]): ln["bytes_per_step"] for ln in best["links"]
    }  # dp and tp links only: no link a 1-D tp over four ranks would add
    assert cmp["bytes_exact"] and cmp["bytes_within_2pct"]
    assert all(r["ratio"] == 1.0 for r in cmp["links"])
    predicted = {r["rank"]: r["compute_s"]["predicted"] for r in cmp["ranks"]}
    assert predicted == {r["rank"]: r["compute_s"] for r in best["ranks"]} and predicted[2] < predicted[0]
