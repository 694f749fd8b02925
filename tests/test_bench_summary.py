"""Evidence anyone can re-derive: BENCHMARKS.md's summary is what bench/summary.py makes of
the raw results in bench/results/, each a file bench/common.py wrote, and benches stop with
a non-zero status when they miss their bar."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}_module", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_benchmarks_md_opens_with_the_generated_summary():
    summary = _load("summary")
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert summary.current(text) == summary.table(), "stale: run .venv/bin/python bench/summary.py --write"
    assert text.index(summary.BEGIN) < text.index("\n## "), "the summary is not at the top"


def test_every_row_names_a_file_and_a_command_that_exist():
    summary = _load("summary")
    for bar, src, notebook in summary.ROWS:
        script = re.search(r"(bench/\w+\.py|tests/\w+\.py)", src["command"])
        if src["command"] != "make demo":
            assert script and (ROOT / script.group(1)).exists(), (bar, src)
        if not src.get("test") and not (ROOT / src["file"]).exists():
            assert notebook, f"{bar}: no raw file and no notebook figure to quote"
    for path in sorted((BENCH / "results").glob("*.json")):  # every raw file is some row's
        assert any(src["file"] == f"bench/results/{path.name}" for _, src, _ in summary.ROWS), path.name


def test_a_result_file_becomes_its_row(tmp_path, monkeypatch):
    common, summary = _load("common"), _load("summary")
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    row = next(r for r in summary.ROWS if r[1]["file"] == "bench/results/compute.json")
    assert summary.latest(row, tmp_path).startswith(summary.NOT_RUN)
    path = common.write_result("compute", "a bar", False, "home 5 of 7 (0.70-1.31)", {"runs": [1, 2]}, "cmd --x")
    doc = json.loads(path.read_text())
    assert path == tmp_path / "compute.json" and doc["schema"] == common.RESULT_SCHEMA
    assert (doc["bar"], doc["met"], doc["command"], doc["data"]) == ("a bar", False, "cmd --x", {"runs": [1, 2]})
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", doc["created"]) and len(doc["machine"]["load"]) == 3
    got = summary.latest(row, tmp_path)
    assert got.startswith("**missed**: home 5 of 7 (0.70-1.31) (") and doc["created"][:10] in got
    assert "home 5 of 7" in summary.table(tmp_path)
    assert (common.exit_code(True), common.exit_code(False)) == (0, 1)


@pytest.mark.parametrize(
    "name",
    ["bench_compute", "bench_diloco", "bench_allreduce", "bench_calibrate", "bench_probe", "bench_matrix"]
    + ["bench_plan", "bench_placement", "bench_infer", "bench_decode", "bench_faults", "bench_dtype", "bench_serve"]
    + ["bench_finetune", "bench_demo"],
)
def test_benches_that_judge_a_bar_exit_by_it(name):
    text = (BENCH / f"{name}.py").read_text()
    assert "return exit_code(met" in text and "write_result(" in text


def test_bench_compute_misses_on_any_run_outside_25_percent_or_any_failed_run():
    compute = _load("compute_bars")
    run = {"strategy": "dp", "meas": 1.0, "pred": 1.1, "bytes_ok": True}
    ok = [{"scenario": "home", "sets": {"main": [run, dict(run, strategy="pp", meas=1.2)]}}]
    assert compute.verdict(ok) == (True, "home 2 of 2 (0.91-1.09)")
    slow = [{"scenario": "home", "sets": {"main": [run, dict(run, meas=1.5)]}}]
    failed = [{"scenario": "home", "sets": {"main": [run, {"strategy": "tp", "error": "no report"}]}}]
    bytes_off = [{"scenario": "home", "sets": {"main": [dict(run, bytes_ok=False)]}}]
    terms = [{"scenario": "home", "sets": {"main": [dict(run, outside=["comm on rank 1 (pi5) x6.21"])]}}]
    assert not any(compute.verdict(r)[0] for r in (slow, failed, bytes_off, terms))
    assert compute.verdict(terms)[1] == "home 0 of 1 (0.91-0.91), 1 rank terms outside 25%"
    cal = [{"host": "pi", "cap": 0.15, "ratio": 0.9}, {"host": "mac", "cap": 0.45, "ratio": 1.1}]
    assert compute.calibration_verdict([{"scenario": "home", "calibration": cal}])[0]
    swapped = [dict(cal[0], ratio=4.0), cal[1]]  # the 0.15-core host measured faster than the 0.45
    assert not compute.calibration_verdict([{"scenario": "home", "calibration": swapped}])[0]


def test_no_bench_edits_sys_path():
    hacks = [p.name for p in sorted(BENCH.glob("*.py")) if "sys.path.insert" in p.read_text()]
    assert not hacks, f"{hacks}: import the tree as installed (make setup) and bench/common.py"


def test_bench_compute_draws_its_clusters_from_one_seed_and_a_failed_one_is_a_miss(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # as when the bench runs as a script
    sims, compute = _load("compute_sims"), _load("compute_bars")
    got = sims.keys(["home", "hidden"], 11, 3)
    assert got[:2] == ["home", "hidden"] and got == sims.keys(["home", "hidden"], 11, 3)
    assert len(set(got[2:])) == 3 and all(k.startswith("random:") for k in got[2:])
    assert got[2:] != sims.keys([], 12, 3)
    assert sims.sim_of(got[2]) == sims.DRAWN and sims.describe(got[2]).count("\n") >= 2  # 3-6 hosts
    run = {"strategy": "dp", "meas": 1.0, "pred": 1.1, "bytes_ok": True}
    failed = {"scenario": got[2], "error": "sim up failed", "sets": {}}
    assert compute.verdict([{"scenario": "home", "sets": {"main": [run]}}, failed]) == (
        False,
        f"home 1 of 1 (0.91-0.91); {got[2]} FAILED",
    )


def test_the_fault_and_decode_bars_count_a_miss_as_one():
    faults, decode = _load("faults_bars"), _load("decode_bars")
    cell = {"strategy": "dp", "fault": "sigkill", "detect_s": 2.0, "right_culprit": True}
    assert faults.cell_ok(cell) and faults.cell_ok({"fault": "flood", "legit_served": True})
    assert not faults.cell_ok(dict(cell, detect_s=16.0)) and not faults.cell_ok(dict(cell, right_culprit=False))
    assert not faults.cell_ok(dict(cell, detect_s=None)) and not faults.cell_ok({"fault": "flood"})
    assert not faults.cell_ok({"fault": "ctlstop", "detect_s": 1.0, "blamed": "rank0"})
    ck = {"fault": "ck-bitflip", "rc": 0, "resumed_from": 2, "skipped": "step 4: part 0 digest", "losses_match": True}
    assert (
        faults.ck_ok(ck)
        and faults.ck_ok({"fault": "ck-none", "rc": 2})
        and not faults.ck_ok(dict(ck, rc=1, resumed_from=None))
    )
    assert not faults.ck_ok({"fault": "ck-none", "rc": 0}) and not faults.ck_ok(dict(ck, losses_match=False))
    t = {"fp32": 12.0, "int8": 29.0, "q4": 34.0, "llama.cpp Q8_0": 30.0, "llama.cpp Q4_0": 40.0}
    err = {"int8": 0.0186, "llama.cpp Q8_0": 0.0189}
    run = {"threads": 1, "tokens_per_s": t, "roofline_tokens_per_s": {"fp32": 15.0}, "logit_rms_error_vs_fp32": err}
    assert decode.verdict(run) == (
        True,
        "1 thread(s): fp32 0.80 of the bound; q4 0.85x llama.cpp Q4_0, int8 0.97x Q8_0; int8 logit error 0.98x Q8_0's",
    )
    assert decode.verdict(dict(run, bound_source="64 MB copy"))[1].startswith(
        "1 thread(s): fp32 0.80 of the bound (64 MB copy); "
    )
    assert not decode.verdict(dict(run, roofline_tokens_per_s={"fp32": 20.0}))[0]  # 0.60 of the bound
    assert not decode.verdict(dict(run, tokens_per_s=dict(t, int8=27.0)))[0]  # 0.90x Q8_0
    assert not decode.verdict(dict(run, tokens_per_s=dict(t, q4=30.0)))[0]  # 0.75x Q4_0
    assert not decode.verdict(dict(run, logit_rms_error_vs_fp32=dict(err, int8=0.0317)))[0]  # fbgemm's 1.68x
    no_llama = {k: v for k, v in t.items() if not k.startswith("llama")}
    assert not decode.verdict(dict(run, tokens_per_s=no_llama))[0]


def test_bench_plan_prints_and_compares_through_the_plan_command():
    """No ranks or link models built by hand: the plan it prints and judges is `smoltrain plan`'s."""
    text = (BENCH / "bench_plan.py").read_text()
    assert not re.search(r"make_plan|share_machine|link_model|Rank\(|smoltrain\.planner", text)
    assert '"smoltrain", "plan", "--strategy"' in text and '"smoltrain", "plan", "--compare"' in text


def test_bench_demo_judges_the_time_the_stages_and_decode_against_plan(tmp_path):
    demo = _load("bench_demo")
    (tmp_path / "generate").mkdir()
    stages = "| stage | exit | seconds | ok |\n|---|---|---|---|\n| 5. calibrate: every host | 0 | 150.5 | yes |\n"
    (tmp_path / "REPORT.md").write_text("# report\n\n## Stages\n\n" + stages)
    for strat, got in (("pp", 90.0), ("tp", 12.0)):
        doc = {"decode": {"tokens_per_s": got}, "plan": {"tokens_per_s": 100.0 if strat == "pp" else 10.0}}
        (tmp_path / "generate" / f"generate-{strat}.json").write_text(json.dumps(doc))
    rank = {
        "name": "pi5",
        "compute_s": {"ratio": 2.14, "verdict": "outside"},
        "comm_s": {"ratio": 0.5, "verdict": "small"},
    }
    compare = {"step_s": {"predicted": 1.0, "measured": 1.1}, "ranks": [rank]}
    (tmp_path / "compare-fsdp.json").write_text(json.dumps(compare))
    met, headline, data = demo.judge(tmp_path, 540.0, 90.0)
    assert met and data["stages"] == [{"stage": "5. calibrate: every host", "exit": "0", "seconds": 150.5, "ok": True}]
    assert data["decode"]["pp"]["ratio"] == pytest.approx(0.9) and data["rank_terms_outside"] == [
        "fsdp pi5 compute x2.14"
    ]
    assert "make demo 540 s" in headline and "setup 90 s" in headline and "calibrate 150 s" in headline
    assert not demo.judge(tmp_path, 610.0, 90.0)[0]  # over ten minutes
    (tmp_path / "generate" / "generate-tp.json").write_text(
        json.dumps({"decode": {"tokens_per_s": 13.0}, "plan": {"tokens_per_s": 10.0}})
    )
    assert not demo.judge(tmp_path, 540.0, 90.0)[0]  # tp decode 1.3x its plan
    (tmp_path / "REPORT.md").write_text("# report\n\n## Stages\n\n" + stages.replace("| yes |", "| no |"))
    (tmp_path / "generate" / "generate-tp.json").write_text(
        json.dumps({"decode": {"tokens_per_s": 11.0}, "plan": {"tokens_per_s": 10.0}})
    )
    assert not demo.judge(tmp_path, 540.0, 90.0)[0]  # a stage failed
