"""Placement bench: dp and pp tokens/s under `--placement auto` vs `even` on the CPU-capped
`home` sim, measured, next to the gains the plan predicted.

Brings up sim `pbench` (home scenario: Pi 5, Jetson, Mac mini and laptop capped at
0.15/0.25/0.45/0.65 of a core, 1 Gbit links, 10.42.5.0/24), measures the links (`smolnet
matrix`) and every host's compute (`smoltrain calibrate -i`), then for dp and pp: `plan
--placement auto` (the placement and its predicted gain over even) and `run --placement
even` / `run --placement auto` (the measured gain; warm-up steps excluded). The plan is
made under each placement (planner.plan.make_plan), so it predicts the run that executes it.

Targets (issue 13): dp auto >= 1.5x even, pp auto >= 1.2x even; the predicted gains within
25% of the measured ones. Results: BENCHMARKS.md, "Placement by measured speed".

    flock /tmp/smol-bench.lock .venv/bin/python bench/bench_placement.py [--steps 10] [--batch 16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from common import PY, ROOT, exit_code, write_result
from compute_sims import down, sh, up

from smoltrain.planner.compare import tokens_per_s_after_warmup

NAME, SUBNET = "pbench", "10.42.5.0/24"
TARGETS = {"dp": 1.5, "pp": 1.2}
BAR = "placement auto vs even on the capped home sim: dp >= 1.5x, pp >= 1.2x, plan within 25%"


def run(strategy: str, mode: str, inv: Path, d: Path, a) -> dict:
    out = d / f"{strategy}-{mode}.json"
    sh(
        [PY, "-m", "smoltrain", "run", "--strategy", strategy, "-i", inv, "--model", a.model]
        + ["--steps", a.steps, "--batch", a.batch, "--microbatches", a.microbatches]
        + ["--links", d / "links.json", "--compute", d / "compute.json", "--placement", mode]
        + ["--json", out, "--out", d],
        ok=(0,),
    )
    doc = json.loads(out.read_text())
    return {"tokens_per_s": tokens_per_s_after_warmup(doc), "placement": doc["placement"], "run": str(out)}


def plan(strategy: str, inv: Path, d: Path, a) -> dict:
    out = d / f"plan-{strategy}.json"
    sh(
        [PY, "-m", "smoltrain", "plan", "--strategy", strategy, "-i", inv, "--model", a.model]
        + ["--batch", a.batch, "--microbatches", a.microbatches, "--placement", "auto"]
        + ["--links", d / "links.json", "--compute", d / "compute.json", "--no-what-if", "--json", out]
    )
    return json.loads(out.read_text())["placement"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="10")
    ap.add_argument("--batch", default="16")
    ap.add_argument("--microbatches", default="4")
    ap.add_argument("--model", default="tiny8")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "placement.json"))
    a = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="pbench-"))
    inv = up(d, name=NAME, subnet=SUBNET)
    rows = []
    try:
        sh([PY, "-m", "smolnet", "matrix", "-i", inv, "--duration", "2", "--out", d])
        sh([PY, "-m", "smoltrain", "calibrate", "-i", inv, "--model", a.model, "--out", d / "compute.json"])
        for strategy, target in TARGETS.items():
            p = plan(strategy, inv, d, a)
            even, auto = run(strategy, "even", inv, d, a), run(strategy, "auto", inv, d, a)
            gain = auto["tokens_per_s"] / even["tokens_per_s"]
            row = {
                "strategy": strategy,
                "target": target,
                "even_tokens_per_s": even["tokens_per_s"],
                "auto_tokens_per_s": auto["tokens_per_s"],
                "measured_gain": gain,
                "predicted_even_tokens_per_s": p["predicted"]["even"]["tokens_per_s"],
                "predicted_auto_tokens_per_s": p["predicted"]["auto"]["tokens_per_s"],
                "predicted_gain": p["speedup"],
                "prediction_error": abs(p["speedup"] - gain) / gain,
                "auto_placement": auto["placement"],
            }
            rows.append(row)
            print(
                f"{strategy}: even {even['tokens_per_s']:,.0f} tok/s, auto {auto['tokens_per_s']:,.0f} tok/s, "
                f"gain {gain:.2f}x (target >= {target}x: {'ok' if gain >= target else 'MISSED'}); plan "
                f"{row['predicted_even_tokens_per_s']:,.0f} -> {row['predicted_auto_tokens_per_s']:,.0f} tok/s, "
                f"gain {p['speedup']:.2f}x ({row['prediction_error']:.0%} off; target within 25%)",
                flush=True,
            )
    finally:
        down(NAME)
    doc = {
        "model": a.model,
        "steps": int(a.steps),
        "batch": int(a.batch),
        "microbatches": int(a.microbatches),
        "load_average": os.getloadavg(),
        "compute": json.loads((d / "compute.json").read_text()),
        "rows": rows,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {a.out}")
    met = all(r["measured_gain"] >= r["target"] and r["prediction_error"] <= 0.25 for r in rows)
    headline = ", ".join(
        f"{r['strategy']} {r['measured_gain']:.2f}x (plan {r['predicted_gain']:.2f}x, {r['prediction_error']:.0%} off)"
        for r in rows
    )
    kept = write_result("placement", BAR, met, headline, {k: v for k, v in doc.items() if k != "compute"})
    print(f"{headline}: {'met' if met else 'MISSED'} ({kept})")
    return exit_code(met)


if __name__ == "__main__":
    sys.exit(main())
