"""Uneven cuts on a mesh from measured compute (`--placement auto`): the plan cuts them, the run
executes the plan's cuts and order, keeps the `--local 1` loss curve, and moves the plan's bytes.

The hand-built compute report makes rank0 and rank1 three times as fast as rank2 and rank3.
On dp=2,pp=2 the plan puts the two slow hosts on one stage (its speed is its slowest member's)
and gives that stage fewer layers; on dp=2,tp=2 the fast tp pair is one replica and gets more
of the batch. Real worker processes on loopback.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from computetools import compute_doc
from runtools import smoltrain, write_secret

from smoltrain.cli import main
from smoltrain.mesh import parse

SHAPE = ["--batch", "6", "--seq", "32", "--microbatches", "2"]
STEPS, REL_TOL = 2, 1e-5
FAST = {"rank0", "rank1"}
MESHES = ("dp=2,pp=2", "dp=2,tp=2")


def write_compute(path) -> str:
    doc = compute_doc([f"rank{r}" for r in range(4)], "rank0", seq=32, fixed=0.002, machine_id="m")
    for h in doc["hosts"]:
        if h["name"] in FAST:
            for t in h["train_step"]:
                t["seconds"] = 0.002 + t["batch"] * 0.01
    path.write_text(json.dumps(doc))
    return str(path)


def plan(tmp_path, mesh: str, *extra) -> dict:
    out = tmp_path / f"plan-{mesh}-{len(extra)}.json"
    assert main(["plan", "--mesh", mesh, "--local", "4", *SHAPE, *extra, "--json", str(out)]) == 0
    return json.loads(out.read_text())["meshes"][0]


def members(e: dict, axis: str) -> list[set]:
    """Host names at each coordinate along `axis` of a plan entry's layout and order."""
    mesh = parse(e["layout"], 4)
    i = mesh.names.index(axis)
    return [{e["order"][r] for r in range(4) if mesh.coords(r)[i] == k} for k in range(mesh.size(axis))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("meshplace")
    secret, compute = write_secret(d / "secret"), write_compute(d / "compute.json")

    def one(mesh):
        how = ["--strategy", "dp", "--local", "1"] if mesh == "ref" else ["--mesh", mesh, "--local", "4"]
        how += [] if mesh == "ref" else ["--placement", "auto", "--compute", compute]
        out = d / f"{mesh}.json"
        args = ["run", *how, *SHAPE, "--steps", str(STEPS), "--seed", "3", "--secret-file", str(secret)]
        p = smoltrain(*args, "--out", str(d), "--json", str(out), timeout=120)
        assert p.returncode == 0, p.stdout[-800:] + p.stderr[-800:]
        return json.loads(out.read_text())

    with ThreadPoolExecutor(max_workers=3) as pool:
        done = dict(zip(("ref", *MESHES), pool.map(one, ("ref", *MESHES))))
    return done, d / "compute.json"


def test_plan_cuts_by_the_slowest_member(tmp_path):
    compute = write_compute(tmp_path / "c.json")
    pp = plan(tmp_path, "dp=2,pp=2", "--placement", "auto", "--compute", compute)
    stages, layers = members(pp, "pp"), pp["mesh"]["layers"]
    slow = next(i for i, s in enumerate(stages) if not s & FAST)  # both slow hosts on one stage
    assert layers[slow][1] - layers[slow][0] < layers[1 - slow][1] - layers[1 - slow][0]
    tp = plan(tmp_path, "dp=2,tp=2", "--placement", "auto", "--compute", compute)
    fast = members(tp, "dp").index(FAST)  # the fast pair is one replica, on more of the batch
    rows = tp["mesh"]["rows"]
    assert rows[fast][1] - rows[fast][0] > rows[1 - fast][1] - rows[1 - fast][0]
    for mesh, auto in (("dp=2,pp=2", pp), ("dp=2,tp=2", tp)):
        even = plan(tmp_path, mesh, "--placement", "even", "--compute", compute)
        assert "layers" not in even["mesh"] and "rows" not in even["mesh"]
        assert auto["step_s"] < even["step_s"]
        nominal = plan(tmp_path, mesh, "--placement", "auto")  # no measured speeds: even cuts
        assert "layers" not in nominal["mesh"] and "rows" not in nominal["mesh"]


@pytest.mark.parametrize("mesh", MESHES)
def test_run_executes_the_plans_cuts(runs, tmp_path, mesh):
    done, compute = runs
    ref = [s["loss"] for s in done["ref"]["steps"]]
    doc = done[mesh]
    got = [s["loss"] for s in doc["steps"]]
    assert len(got) == STEPS and all(abs(a - b) <= REL_TOL * abs(b) for a, b in zip(got, ref)), (got, ref)
    e = plan(tmp_path, mesh, "--placement", "auto", "--compute", str(compute))
    assert doc["mesh"] == e["mesh"] and ("layers" in e["mesh"] or "rows" in e["mesh"])
    assert doc["placement"]["order"] == e["order"] == doc["config"]["names"]
    measured = {(b["src"], b["dst"]): b["bytes"] for b in doc["bytes"]}
    assert measured == {(ln["src"], ln["dst"]): STEPS * ln["bytes_per_step"] for ln in e["links"]}


def test_shares_and_placement_files_are_refused_on_a_mesh(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps({"order": ["rank0", "rank1"], "layers": [[0, 3], [3, 6]]}))
    for extra in (["--shares", "1,1,1,1"], ["--placement", str(tmp_path / "p.json")]):
        p = smoltrain("run", "--mesh", "dp=2,pp=2", "--local", "4", "--steps", "1", *extra, "--out", tmp_path)
        assert p.returncode == 2 and "do not apply to a mesh" in p.stderr, p.stderr
        assert p.stderr.strip().count("\n") == 0
