"""The demo's report and exit status, without a sim: the tables are built from the documents the
stages leave (plans, compares), say whether they agree, and a failed stage fails the demo."""

from __future__ import annotations

import argparse
import io
import json
import sys

import pytest
from rich.console import Console

from smoltrain.demo import flow, pictures, report

EVEN = {"mode": "even", "order": ["a", "b", "c"], "layers": [[0, 3], [3, 6], [6, 8]]}
AUTO = {"mode": "auto", "order": ["c", "a", "b"], "layers": [[0, 5], [5, 7], [7, 8]], "why": ["c: layers 0..4"]}


def _placement_docs(out, auto_plan: float):
    """What the placement stages leave: the plan's section, and each run with its compare."""
    sec = {"predicted": {"even": {"tokens_per_s": 900.0}, "auto": {"tokens_per_s": 1350.0}}, "speedup": 1.5}
    (out / "plan-placement-pp.json").write_text(json.dumps({"placement": sec}))
    for mode, pl, pred, meas in (("even", EVEN, 900.0, 800.0), ("auto", AUTO, auto_plan, 1300.0)):
        (out / f"run-placement-pp-{mode}.json").write_text(json.dumps({"placement": pl}))
        (out / f"compare-placement-pp-{mode}.json").write_text(
            json.dumps({"tokens_per_s": {"predicted": pred, "measured": meas}})
        )


def test_placement_section_reads_the_compares_and_checks_the_plan(tmp_path):
    assert pictures.work_of(AUTO)[0] == ("c", 5 / 8, "layers 0..4")
    _placement_docs(tmp_path, 1350.0)
    text = "\n".join(report.placement(tmp_path, ["pp"]))
    assert f"batch {flow.PLACE_BATCH} x {flow.SEQ}" in text  # the section states its own batch
    assert "| pp | 900 | 800 | 1,350 | 1,300 | 1.50x | 1.62x |" in text
    assert "agree." in text and "](placement.png)" in text
    assert (tmp_path / "placement.png").stat().st_size > 1000
    _placement_docs(tmp_path, 1400.0)  # a compare whose plan is not the placement plan's
    assert "**The placement plan and the compares disagree.**" in "\n".join(report.placement(tmp_path, ["pp"]))


def _args(tmp_path, **kw):
    a = dict(quick=True, out=str(tmp_path / "demo"), name="qa1", subnet="10.61.1.0/24", keep=False)
    a.update(skip_provision=False, loopback=True, cpu_limit=None, **kw)
    return argparse.Namespace(**a)


def test_a_failed_stage_fails_the_demo_and_the_report_names_it(tmp_path):
    """`sim up` refuses a subnet it cannot use: the demo stops there, exits 1 and its report
    lists the stage as FAILED (the old demo ended "done" over failed runs)."""
    args = _args(tmp_path, subnet="10.61.999.0/24")
    demo = flow.Demo(args, Console(file=io.StringIO()))
    assert demo.run() == 1
    text = (tmp_path / "demo" / "latest" / "REPORT.md").read_text()
    assert "| 1. cluster: build the sim | 2 |" in text and "**FAILED**" in text
    assert (tmp_path / "demo" / "latest").resolve() == demo.out.resolve()


def test_each_demo_run_writes_into_a_fresh_folder_that_latest_points_to(tmp_path):
    """A run never writes beside another's files: an earlier run's figures stay in its own
    folder, the next run starts empty, and `latest` names the newest (failed or not)."""
    import datetime

    from smolnet.errors import UsageError

    base, now = tmp_path / "reports", datetime.datetime(2026, 12, 5, 23, 1, 2, tzinfo=datetime.timezone.utc)
    first = flow.fresh_run_dir(base, now)
    (first / "compare-dp.json").write_text("{}")  # an earlier run's numbers
    second = flow.fresh_run_dir(base, now)  # the same second: a folder of its own all the same
    assert (first.name, second.name) == ("demo-20261205-230102", "demo-20261205-230102-2")
    assert list(second.iterdir()) == [] and (first / "compare-dp.json").exists()
    assert (base / "latest").is_symlink() and (base / "latest").resolve() == second.resolve()
    assert not any(p.name.startswith(".latest") for p in base.iterdir())  # the link was swapped in one rename
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "latest").mkdir()  # an old layout's folder is not overwritten
    with pytest.raises(UsageError, match="is not a link to a run"):
        flow.fresh_run_dir(tmp_path / "old", now)
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == ["latest"]  # nothing half-made left


def test_an_optional_stage_that_fails_is_recorded_not_raised(tmp_path):
    from smoltrain.demo.stages import Stages

    st = Stages(Console(file=io.StringIO()), tmp_path)
    assert st.run("ok", [sys.executable, "-c", "print('fine')"]) is not None
    assert st.run("bad", [sys.executable, "-c", "raise SystemExit(3)"], required=False) is None
    assert [r["stage"] for r in st.failed] == ["bad"] and st.failed[0]["rc"] == 3
