"""`make demo` on a fresh clone, timed, and judged on what its report shows.

    flock /tmp/smol-sim.lock .venv/bin/python bench/bench_demo.py
    .venv/bin/python bench/bench_demo.py --from DIR --wall-s S --setup-s S   # a demo already run

The first clones this tree's HEAD into a temporary folder and runs `make demo` there, the way a
new user does: the venv made from scratch (pip takes this machine's download cache, which a fresh
machine does not have: say so when quoting the time), the capped home sim, every stage. The
second judges the report folder of a `make demo` run by hand, with its wall time and how much
of it was setup (`make setup`), as the person who ran it measured them.

Bars (issue #36): the whole `make demo` under 10 minutes, every stage ok, and pp and tp decode
tokens/s within 25% of their plan. Also recorded, not bars here: each training run's step time
against its plan and the per-rank compute and communication terms outside 25% (the bar for
those is bench_compute's, on many clusters). Keeps bench/results/demo.json; exits 1 on a miss.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
import time
from pathlib import Path

from common import ROOT, exit_code, write_result

LIMIT_S = 600.0  # make demo on a fresh clone, setup included
DECODE_BAND = (0.75, 1.25)


def stages(report: str) -> list[dict]:
    """The Stages table of REPORT.md: what ran, its exit, its seconds, ok."""
    part = report.split("## Stages", 1)[-1]
    rows = re.findall(r"^\| (.+?) \| (-?\d+|-) \| ([\d.]+) \| (\w+) \|$", part, flags=re.M)
    return [{"stage": s.strip(), "exit": e, "seconds": float(t), "ok": ok == "yes"} for s, e, t, ok in rows]


def judge(folder: Path, wall_s: float, setup_s: float | None) -> tuple[bool, str, dict]:
    report = (folder / "REPORT.md").read_text()
    ran = stages(report)
    decode = {}
    for strat in ("pp", "tp"):
        path = folder / "generate" / f"generate-{strat}.json"
        if path.exists():
            g = json.loads(path.read_text())
            got, plan = g["decode"]["tokens_per_s"], g["plan"]["tokens_per_s"]
            decode[strat] = {"tokens_per_s": got, "plan_tokens_per_s": plan, "ratio": got / plan}
    steps, outside = {}, []
    for path in sorted(folder.glob("compare-*.json")):
        c = json.loads(path.read_text())
        tag = path.stem.removeprefix("compare-")
        steps[tag] = c["step_s"]["measured"] / c["step_s"]["predicted"]
        for r in c.get("ranks") or []:  # the compare's own verdict per term (it leaves timer-noise terms out)
            for term in ("compute_s", "comm_s"):
                t = r.get(term) or {}
                if t.get("verdict") == "outside":
                    outside.append(f"{tag} {r['name']} {term.removesuffix('_s')} x{t['ratio']:.2f}")
    in_band = {s: DECODE_BAND[0] <= d["ratio"] <= DECODE_BAND[1] for s, d in decode.items()}
    all_ok = bool(ran) and all(s["ok"] for s in ran)
    met = wall_s <= LIMIT_S and all_ok and len(decode) == 2 and all(in_band.values())
    calibrate = next((s["seconds"] for s in ran if "calibrate" in s["stage"]), None)
    headline = (
        f"make demo {wall_s:.0f} s on a fresh clone (bar {LIMIT_S:.0f}"
        + (f"; setup {setup_s:.0f} s" if setup_s is not None else "")
        + (f", calibrate {calibrate:.0f} s" if calibrate is not None else "")
        + f"); stages {'all ok' if all_ok else 'FAILED'}; decode/plan "
        + ", ".join(f"{s} {d['ratio']:.2f}" for s, d in decode.items())
        + f"; training steps {sum(0.75 <= v <= 1.25 for v in steps.values())} of {len(steps)} within 25%"
        + f"; per-rank terms outside 25%: {len(outside)}"
    )
    data = {
        "wall_s": wall_s,
        "setup_s": setup_s,
        "limit_s": LIMIT_S,
        "stages": ran,
        "decode": decode,
        "step_ratio": steps,
        "rank_terms_outside": outside,
        "folder": str(folder),
    }
    return met, headline, data


def fresh_run(keep: Path) -> tuple[Path, float, float]:
    """Clone HEAD, `make setup` then `make demo` there, timed; returns (report folder, wall, setup)."""
    tree = keep / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(tree)], check=True)
    t0 = time.monotonic()
    setup = subprocess.run(["make", "setup"], cwd=tree, capture_output=True, text=True)
    setup_s = time.monotonic() - t0
    if setup.returncode != 0:
        raise SystemExit(f"make setup failed: {(setup.stdout + setup.stderr)[-800:]}")
    demo = subprocess.run(["make", "demo"], cwd=tree, capture_output=True, text=True)
    wall = time.monotonic() - t0
    (keep / "demo.log").write_text(demo.stdout + demo.stderr)
    if not (tree / "reports" / "latest" / "REPORT.md").exists():
        raise SystemExit(f"make demo wrote no report (exit {demo.returncode}): {demo.stdout[-800:]}")
    return (tree / "reports" / "latest").resolve(), wall, setup_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="folder", type=Path, help="judge this finished demo's report folder")
    ap.add_argument("--wall-s", type=float, help="with --from: the whole make demo's wall seconds")
    ap.add_argument("--setup-s", type=float, help="with --from: how many of them were make setup")
    a = ap.parse_args()
    if a.folder:
        if a.wall_s is None:
            ap.error("--from needs --wall-s (the run's own wall time)")
        folder, wall, setup_s = a.folder.resolve(), a.wall_s, a.setup_s
    else:
        folder, wall, setup_s = fresh_run(Path(tempfile.mkdtemp(prefix="bench-demo-")))
    met, headline, data = judge(folder, wall, setup_s)
    path = write_result(
        "demo", "make demo on a fresh clone under 10 min; pp and tp decode within 25% of plan", met, headline, data
    )
    print(headline)
    print(f"wrote {path.relative_to(ROOT)}")
    return exit_code(met)


if __name__ == "__main__":
    raise SystemExit(main())
