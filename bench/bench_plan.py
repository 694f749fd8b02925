"""Predicted against measured step time and bytes on the sim's shaped links, with the plan
exactly as `smoltrain plan` prints it.

Brings up sim `p1` (uniform scenario, 10.213.61.0/24, shaped to --rate-mbit), measures the
links with `smolnet matrix` and every host's compute with `smoltrain calibrate -i` (the sim
hosts share this machine's CPU, which the plan knows from their shared boot id), then for each
strategy prints `smoltrain plan` on those files (the one resolver: no ranks built here), runs
it with `smoltrain run -i` and compares with `smoltrain plan --compare`. Target: measured /
predicted step time within 0.75..1.25, bytes within 2%, every strategy; exits 1 otherwise and
keeps the result in bench/results/plan.json.

Run under the shared benchmark lock:
    flock /tmp/smol-sim.lock .venv/bin/python bench/bench_plan.py --rate-mbit 100
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
from pathlib import Path

import common
from common import PY, ROOT, exit_code, write_result

from smolnet.sim import cluster as sim

BAR = "predicted step time within 25% on shaped sim links, bytes within 2% (measured compute, every strategy)"
sh = functools.partial(common.sh, ok=(0, 4), timeout=600)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate-mbit", type=float, default=100)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--strategies", default="dp,fsdp,syncps,mp,pp,tp")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "plan-results.json"))
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-plan-"))
    inv = work / "p1.yml"
    results = {"rate_mbit": a.rate_mbit, "hosts": a.hosts, "steps": a.steps, "runs": []}
    shape = ["--model", "tiny", "--batch", "8", "--seq", "64", "--microbatches", "2"]
    try:
        sim.up(name="p1", scenario="uniform", hosts=a.hosts, subnet="10.213.61.0/24", inventory=str(inv),
               rate_mbit=a.rate_mbit)  # fmt: skip
        sh([PY, "-m", "smolnet", "matrix", "-i", inv, "--duration", "3", "--out", work])
        sh([PY, "-m", "smoltrain", "calibrate", "-i", inv, "--model", "tiny", "--out", work / "compute.json"])
        files = ["-i", inv, "--links", work / "links.json", "--compute", work / "compute.json"]
        for s in a.strategies.split(","):
            printed = sh([PY, "-m", "smoltrain", "plan", "--strategy", s, *shape, *files, "--no-what-if"]).stdout
            print(printed, flush=True)  # what `smoltrain plan` prints, as it prints it
            rep, cmp = work / f"run-{s}.json", work / f"cmp-{s}.json"
            sh([PY, "-m", "smoltrain", "run", "--strategy", s, *shape, *files, "--steps", a.steps]
               + ["--json", rep, "--out", work])  # fmt: skip
            sh([PY, "-m", "smoltrain", "plan", "--compare", rep, *files, "--no-what-if", "--json", cmp])
            c = json.loads(cmp.read_text())
            row = {
                "strategy": s,
                "step_predicted": c["step_s"]["predicted"],
                "step_measured": c["step_s"]["measured"],
                "comm_predicted": c["comm_s"]["predicted"],
                "comm_measured": c["comm_s"]["measured"],
                "bytes_ratio_max_dev": max(abs((r["ratio"] or 0) - 1) for r in c["links"]),
                "bottleneck": c["plan"]["bottleneck"],
                "outside": c.get("outside") or [],
                "plan_printed": printed,
            }
            row["step_ratio"] = row["step_measured"] / row["step_predicted"]
            results["runs"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "plan_printed"}), flush=True)
    finally:
        sim.down(name="p1")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=2) + "\n")
    print(markdown(results))
    runs = results["runs"]
    ok = [r for r in runs if 0.75 <= r["step_ratio"] <= 1.25 and r["bytes_ratio_max_dev"] <= 0.02]
    met = bool(runs) and len(ok) == len(runs)
    q = [r["step_ratio"] for r in runs]
    headline = f"{len(ok)} of {len(runs)} runs" + (f", {min(q):.2f}-{max(q):.2f}" if q else "")
    kept = write_result("plan", BAR, met, headline, results)
    print(f"{headline}: {'met' if met else 'MISSED'} ({kept})")
    return exit_code(met)


def markdown(results: dict) -> str:
    """The table BENCHMARKS.md shows: measured / predicted, 1.00 = the plan was exact."""
    lines = [
        f"{results['hosts']} hosts, {results['rate_mbit']:g} Mbit/s, {results['steps']} steps (median after the first)",
        "",
        "| strategy | bottleneck (plan) | step predicted | step measured | measured/predicted | bytes max deviation |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        lines.append(
            f"| {r['strategy']} | {r['bottleneck']} | {r['step_predicted'] * 1e3:.0f} ms | "
            f"{r['step_measured'] * 1e3:.0f} ms | {r['step_ratio']:.2f} | "
            f"{r['bytes_ratio_max_dev']:.2%} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
