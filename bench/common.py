"""What every bench shares: where the tree is, how a step runs, and how a result is kept.

A bench keeps its raw result as one small JSON file under bench/results/ (committed), written
by `write_result`: the bar it is judged on, whether it met it, a one-line headline, the command
that produced it, when and on what machine, and the figures behind the headline. The summary
table at the top of BENCHMARKS.md is generated from these files (bench/summary.py). A bench
ends with `sys.exit(exit_code(met))`: non-zero when it missed its bar, so a miss cannot pass
for a run that worked.

Benches run as scripts (`.venv/bin/python bench/bench_x.py`): the bench folder is first on
sys.path, so `from common import ...` finds this module, and smolcluster is installed in the
venv (`make setup`), so no bench edits sys.path.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PY = sys.executable
RESULT_SCHEMA = "smolcluster.bench.result/1"


def sh(argv, ok=(0,), timeout=900, env=None) -> subprocess.CompletedProcess:
    """Run a command from the tree's root (in `env`, else this environment); stop the bench with
    its tail when it fails."""
    r = subprocess.run([str(a) for a in argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode not in ok:
        raise SystemExit(f"{' '.join(map(str, argv))} failed ({r.returncode}): {(r.stdout + r.stderr)[-800:]}")
    return r


def this_command() -> str:
    """The command line that ran this bench, as a reader would type it from the tree's root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    return " ".join([".venv/bin/python", str(script), *sys.argv[1:]])


def write_result(name: str, bar: str, met: bool, headline: str, data: dict, command: str | None = None) -> Path:
    """Keep a bench's result as bench/results/<name>.json (the latest run replaces the last;
    git keeps the history)."""
    from smolnet.files import write_json_atomic

    doc = {
        "schema": RESULT_SCHEMA,
        "bench": name,
        "bar": bar,
        "met": bool(met),
        "headline": headline,
        "command": command or this_command(),
        "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {"cpus": os.cpu_count(), "load": [round(x, 2) for x in os.getloadavg()], "os": platform.platform()},
        "data": data,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    write_json_atomic(path, doc, indent=1)
    return path


def exit_code(met: bool) -> int:
    """A bench's exit status: 0 when it met its bar, 1 when it missed it (an error exits 2)."""
    return 0 if met else 1
