"""Uneven placements train and keep the `--local 1` loss curve (real runs on loopback).

Each synchronous strategy runs with a placement file that splits its work unevenly (batch
shares 4:1:1, layer cuts 1/3/2, heads 3/1/1/1); pp and tp also run 6 layers over 4 stages and
6 heads over 4 ranks with the default (even) placement; dp runs `--placement auto` from a
hand-built compute report in which rank0 is three times as fast. Losses must match the
single-process reference within 1e-5 relative, and the report must record the placement.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from computetools import compute_doc as tools_compute_doc
from runtools import smoltrain, write_secret

BATCH, SEQ, STEPS = 6, 32, 4
REL_TOL = 1e-5
SHARES = {"order": ["rank0", "rank1", "rank2"], "shares": [4 / 6, 1 / 6, 1 / 6]}
RUNS = {
    "ref": ("dp", 1, None, []),
    "dp": ("dp", 3, SHARES, []),
    "fsdp": ("fsdp", 3, SHARES, []),
    "syncps": ("syncps", 3, SHARES, []),
    "mp": ("mp", 3, {"order": ["rank0", "rank1", "rank2"], "layers": [[0, 1], [1, 4], [4, 6]]}, []),
    "pp": (
        "pp",
        3,
        {"order": ["rank0", "rank1", "rank2"], "layers": [[0, 3], [3, 4], [4, 6]]},
        ["--microbatches", "3"],
    ),
    "tp": (
        "tp",
        4,
        {
            "order": [f"rank{r}" for r in range(4)],
            "heads": [[0, 3], [3, 4], [4, 5], [5, 6]],
            "ffn": [[0, 192], [192, 256], [256, 320], [320, 384]],
        },
        [],
    ),
    "pp4-even": ("pp", 4, None, ["--microbatches", "2"]),
    "tp4-even": ("tp", 4, None, []),
    "dp-auto": ("dp", 3, "compute", []),
}


def compute_doc(names, fast="rank0"):
    return tools_compute_doc(names, fast, seq=SEQ, fixed=0.002, machine_id="m")


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    d = tmp_path_factory.mktemp("placement")
    secret = write_secret(d / "secret")

    def one(name):
        strategy, world, placement, extra = RUNS[name]
        args = [
            "run",
            "--strategy",
            strategy,
            "--local",
            str(world),
            "--steps",
            str(STEPS),
            "--batch",
            str(BATCH),
            "--seq",
            str(SEQ),
            "--seed",
            "3",
            "--secret-file",
            str(secret),
            "--out",
            str(d),
            "--json",
            str(d / f"{name}.json"),
            *extra,
        ]
        if placement == "compute":
            (d / "compute.json").write_text(json.dumps(compute_doc([f"rank{r}" for r in range(world)])))
            args += ["--placement", "auto", "--compute", str(d / "compute.json")]
        elif placement is not None:
            (d / f"{name}-placement.json").write_text(json.dumps(dict(placement, mode="auto", strategy=strategy)))
            args += ["--placement", str(d / f"{name}-placement.json")]
        p = smoltrain(*args, timeout=300)
        if p.returncode != 0:
            return RuntimeError(f"{name}: exit {p.returncode}: {p.stdout[-800:]} {p.stderr[-800:]}")
        return json.loads((d / f"{name}.json").read_text())

    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(zip(RUNS, pool.map(one, RUNS)))


def _get(reports, name):
    r = reports[name]
    if isinstance(r, Exception):
        raise r
    return r


@pytest.mark.parametrize("name", [n for n in RUNS if n != "ref"])
def test_uneven_placement_matches_local_1(reports, name):
    ref = [s["loss"] for s in _get(reports, "ref")["steps"]]
    doc = _get(reports, name)
    got = [s["loss"] for s in doc["steps"]]
    assert len(got) == STEPS
    for a, b in zip(got, ref):
        assert abs(a - b) <= REL_TOL * abs(b), (name, got, ref)
    assert doc["placement"]["order"] == doc["config"]["names"]


def test_reports_record_the_placement(reports):
    assert _get(reports, "pp4-even")["placement"]["layers"] == [[0, 2], [2, 4], [4, 5], [5, 6]]
    assert _get(reports, "tp4-even")["placement"]["heads"] == [[0, 2], [2, 4], [4, 5], [5, 6]]
    auto = _get(reports, "dp-auto")["placement"]
    assert auto["mode"] == "auto" and auto["shares"][0] > auto["shares"][1]
    assert _get(reports, "mp")["placement"]["layers"] == RUNS["mp"][2]["layers"]


def test_unfit_placement_is_refused_before_anything_starts(tmp_path):
    doc = compute_doc(["rank0", "rank1"])
    for h in doc["hosts"]:
        h["usable_memory_bytes"] = 1000
    (tmp_path / "c.json").write_text(json.dumps(doc))
    pp2 = ["run", "--strategy", "pp", "--local", "2", "--steps", "1", "--out", tmp_path]
    p = smoltrain(*pp2, "--placement", "auto", "--compute", tmp_path / "c.json", timeout=60)
    assert p.returncode == 2 and "no host has memory" in p.stderr and p.stderr.strip().count("\n") == 0
    bad = {"order": ["rank0", "rank1"], "layers": [[0, 2], [3, 6]]}
    (tmp_path / "p.json").write_text(json.dumps(bad))
    p = smoltrain(*pp2, "--placement", tmp_path / "p.json", timeout=60)
    assert p.returncode == 2 and "layers" in p.stderr
