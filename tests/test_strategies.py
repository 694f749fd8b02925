"""Every synchronous strategy reproduces the `--local 1` loss curve, and sends exactly
the bytes its docstring (and the planner) says.

Runs are real: `smoltrain run` with worker processes on loopback. To fit the
test budget they run a few at a time from one module fixture, share one
reference run, and use a small batch (6 x 32 bytes of the tiny model).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from smoltrain.models.spec import get_model
from smoltrain.schema import check_any

BATCH, SEQ = 6, 32
REL_TOL = 1e-5
# name: (strategy, world, backend, steps, extra args)
RUNS = {
    "ref": ("dp", 1, "socket", 20, []),
    "dp2": ("dp", 2, "socket", 20, []),
    "dp2-after": ("dp", 2, "socket", 10, ["--threads", "2"]),  # no core to spare: buckets after backward
    "fsdp2": ("fsdp", 2, "socket", 10, []),
    "syncps2": ("syncps", 2, "socket", 10, []),
    "mp2": ("mp", 2, "socket", 10, []),
    "pp2-gpipe": ("pp", 2, "socket", 10, ["--microbatches", "3", "--schedule", "gpipe"]),
    "tp2": ("tp", 2, "socket", 10, []),
    "dp3-shares": ("dp", 3, "socket", 6, ["--shares", "3,2,1"]),
    "fsdp3": ("fsdp", 3, "socket", 6, []),
    "syncps3": ("syncps", 3, "socket", 6, []),
    "mp3": ("mp", 3, "socket", 6, []),
    "pp3-1f1b": ("pp", 3, "socket", 6, ["--microbatches", "6", "--schedule", "1f1b"]),
    "tp3": ("tp", 3, "socket", 6, []),
    "dp2-torch": ("dp", 2, "torch", 6, []),
    "pp2-torch": ("pp", 2, "torch", 6, ["--microbatches", "3"]),
    "tp2-torch": ("tp", 2, "torch", 6, []),
}


def run_cli(args: list[str], timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "smoltrain", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    d = tmp_path_factory.mktemp("strategies")
    secret = d / "secret"
    secret.write_text(secrets.token_hex(32))
    os.chmod(secret, 0o600)

    def one(name):
        strategy, world, backend, steps, extra = RUNS[name]
        out = d / f"{name}.json"
        p = run_cli(
            [
                "run",
                "--strategy",
                strategy,
                "--local",
                str(world),
                "--backend",
                backend,
                "--steps",
                str(steps),
                "--batch",
                str(BATCH),
                "--seq",
                str(SEQ),
                "--seed",
                "7",
                "--secret-file",
                str(secret),
                "--out",
                str(d),
                "--json",
                str(out),
                "--eval-every",
                "5",
                *extra,
            ],
            env={"SMOL_CHARTS": "1"} if name == "dp2" else None,  # the suite draws no loss curve but this one
        )
        if p.returncode != 0:
            return RuntimeError(f"{name}: exit {p.returncode}: {p.stdout[-600:]} {p.stderr[-600:]}")
        return json.loads(out.read_text())

    with ThreadPoolExecutor(max_workers=3) as pool:
        results = dict(zip(RUNS, pool.map(one, RUNS)))
    return results


def _get(reports, name):
    r = reports[name]
    if isinstance(r, Exception):
        raise r
    return r


def expected_total_bytes(strategy: str, world: int, steps: int, extra: list[str]) -> int:
    """Payload bytes summed over every link, from the counting conventions."""
    spec = get_model("tiny")
    P, act = spec.params(), BATCH * SEQ * spec.hidden * 4
    if strategy == "dp":
        return steps * 2 * (world - 1) * P * 4
    if strategy == "fsdp":
        from smoltrain.models.gpt import build_model

        units = build_model(spec, 0).units
        padded = sum(-(-sum(p.numel() for p in u.parameters()) // world) * world for u in units)
        return steps * 3 * (world - 1) * padded * 4
    if strategy == "syncps":
        return steps * 2 * (world - 1) * P * 4
    if strategy in ("mp", "pp"):
        return steps * 2 * (world - 1) * act
    if strategy == "tp":
        return steps * spec.layers * 4 * 2 * (world - 1) * act
    raise AssertionError(strategy)


@pytest.mark.parametrize("name", [n for n in RUNS if n != "ref"])
def test_reproduces_the_single_process_loss_curve(reports, name):
    ref, got = _get(reports, "ref"), _get(reports, name)
    strategy, world, backend, steps, extra = RUNS[name]
    assert got["strategy"] == strategy and got["world_size"] == world and got["backend"] == backend
    assert [s["step"] for s in got["steps"]] == list(range(steps))
    worst = max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(ref["steps"], got["steps"]))
    assert worst < REL_TOL, f"{name}: loss differs from --local 1 by {worst:.2e} relative"
    assert got["steps"][-1]["loss"] < got["steps"][0]["loss"]  # it learns


@pytest.mark.parametrize("name", [n for n in RUNS if n != "ref"])
def test_held_out_loss_matches_the_single_process_one(reports, name):
    """--eval-every on every strategy: the same weights give the same held-out loss, and
    evaluating sends nothing the step's bytes count (checked by the test below)."""
    ref = {e["step"]: e["loss"] for e in _get(reports, "ref")["evals"]}
    got = {e["step"]: e["loss"] for e in _get(reports, name)["evals"]}
    steps = RUNS[name][3]
    assert set(got) == {s for s in range(steps) if (s + 1) % 5 == 0 or s + 1 == steps}
    common = sorted(set(got) & set(ref))
    assert common and all(abs(got[s] - ref[s]) <= REL_TOL * ref[s] for s in common), (got, ref)


@pytest.mark.parametrize("name", [n for n in RUNS if n != "ref"])
def test_measured_bytes_follow_the_counting_conventions(reports, name):
    got = _get(reports, name)
    strategy, world, backend, steps, extra = RUNS[name]
    total = sum(b["bytes"] for b in got["bytes"])
    assert total == expected_total_bytes(strategy, world, steps, extra)
    names = {f"rank{r}" for r in range(world)}
    assert all(b["src"] in names and b["dst"] in names and b["src"] != b["dst"] for b in got["bytes"])
    if strategy in ("mp", "pp"):  # peer to peer between neighbours, never through a hub
        assert all(abs(int(b["src"][4:]) - int(b["dst"][4:])) == 1 for b in got["bytes"])


@pytest.mark.parametrize("name", ["dp2", "fsdp2", "tp2", "pp2-gpipe", "mp2", "syncps3", "fsdp3"])
def test_planner_predicts_the_measured_bytes(reports, name):
    got = _get(reports, name)
    plan = got.get("plan")
    assert plan is not None, "the run report lacks its plan: the planner failed inside `smoltrain run`"
    steps = len(got["steps"])
    sent: dict[str, int] = {}
    for b in got["bytes"]:
        sent[b["src"]] = sent.get(b["src"], 0) + b["bytes"]
    busiest = max(sent.values()) / steps
    assert abs(busiest - plan["bytes_per_step"]) <= 0.02 * plan["bytes_per_step"], (busiest, plan["bytes_per_step"])


def test_report_schema_and_png(reports, tmp_path_factory):
    got = _get(reports, "dp2")
    for key in (
        "strategy",
        "backend",
        "world_size",
        "config",
        "steps",
        "bytes",
        "events",
        "final_loss",
        "tokens_per_s",
    ):
        assert key in got
    assert got["schema"] == "smoltrain.run/1"
    check_any(got)
    s = got["steps"][0]
    assert set(s) >= {"step", "loss", "step_s", "comm_s", "tokens"} and s["tokens"] == BATCH * SEQ
    assert s["comm_s"] >= 0 and s["step_s"] > 0  # how they compare is for bench, not a test
    assert got["final_loss"] == got["steps"][-1]["loss"] and got["tokens_per_s"] > 0
    pngs = list(tmp_path_factory.getbasetemp().glob("strategies*/run-dp-socket-2.png"))
    assert pngs and pngs[0].stat().st_size > 1000  # SMOL_CHARTS=1
    assert not (pngs[0].parent / "run-fsdp-socket-2.png").exists()  # SMOL_CHARTS=0, the suite's
