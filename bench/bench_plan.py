"""Predicted against measured step time and bytes on the sim's shaped links.

Brings up sim `p1` (uniform scenario, 10.213.61.0/24, shaped to --rate-mbit), measures the
links with `smolnet matrix`, calibrates this machine with `smoltrain calibrate`'s measurement,
runs each strategy with `smoltrain run -i`, and compares with the plan made from the measured
links and the calibration. The sim hosts share this machine's CPU, so each rank gets 1/N of
the calibrated FLOP/s (as the plan does for --local).

Run under the shared benchmark lock:
    flock /tmp/smol-bench.lock .venv/bin/python bench/bench_plan.py --rate-mbit 100
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from pathlib import Path

import common
from common import ROOT

from smolnet.inventory import load_inventory
from smolnet.sim import cluster as sim
from smoltrain.commands.calibrate import calibrate
from smoltrain.models.spec import get_model
from smoltrain.planner.compare import compare
from smoltrain.planner.devices import profile_from_calibration
from smoltrain.planner.plan import Rank, busy_ranks, link_model, make_plan, share_machine

SMOL = [sys.executable, "-m"]


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
    inv_path = work / "p1.yml"
    results = {"rate_mbit": a.rate_mbit, "hosts": a.hosts, "steps": a.steps, "runs": []}
    try:
        sim.up(
            name="p1",
            scenario="uniform",
            hosts=a.hosts,
            subnet="10.213.61.0/24",
            inventory=str(inv_path),
            rate_mbit=a.rate_mbit,
        )
        sh(SMOL + ["smolnet", "matrix", "-i", str(inv_path), "--duration", "3", "--out", str(work / "links")])
        links = json.loads((work / "links" / "links.json").read_text())
        inv = load_inventory(inv_path)
        hosts = [inv.coordinator] + [h for h in inv.hosts if h.name != inv.coordinator.name]
        results["calibration"] = []
        for s in a.strategies.split(","):
            # calibrate right before and right after each run: the machine is shared with
            # other work and its speed drifts; the plan takes the mean of the two
            before = calibrate(seconds=1.0, model="tiny", batch=8, seq=64)
            rep = work / f"run-{s}.json"
            sh(
                SMOL
                + [
                    "smoltrain",
                    "run",
                    "--strategy",
                    s,
                    "-i",
                    str(inv_path),
                    "--steps",
                    str(a.steps),
                    "--microbatches",
                    "2",
                    "--json",
                    str(rep),
                    "--out",
                    str(work),
                ]
            )
            after = calibrate(seconds=1.0, model="tiny", batch=8, seq=64)
            cal = dict(before, train_efficiency=(before["train_efficiency"] + after["train_efficiency"]) / 2)
            results["calibration"].append(
                {
                    "strategy": s,
                    "flops_fp32": cal["flops_fp32"],
                    "train_step_s": [before["train"]["step_s"], after["train"]["step_s"]],
                }
            )
            prof = profile_from_calibration(cal)
            ranks = share_machine(
                [Rank(h.name, prof, prof.memory_bytes) for h in hosts], busy=busy_ranks(s, len(hosts), 2)
            )
            lm = link_model([r.name for r in ranks], hosts, links, None)
            run = json.loads(rep.read_text())
            plan = make_plan(s, get_model("tiny"), len(hosts), batch=8, seq=64, microbatches=2, ranks=ranks, lm=lm)
            c = compare(plan, run)
            row = {
                "strategy": s,
                "step_predicted": c["step_s"]["predicted"],
                "step_measured": c["step_s"]["measured"],
                "comm_predicted": c["comm_s"]["predicted"],
                "comm_measured": c["comm_s"]["measured"],
                "bytes_ratio_max_dev": max(abs((r["ratio"] or 0) - 1) for r in c["links"]),
                "bottleneck": plan["bottleneck"],
            }
            row["step_ratio"] = row["step_measured"] / row["step_predicted"]
            results["runs"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        sim.down(name="p1")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=2) + "\n")
    print(markdown(results))
    print(f"wrote {a.out}")
    return 0


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
