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
