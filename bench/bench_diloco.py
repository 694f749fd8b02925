"""DiLoCo on the capped home sim, side by side with dp and the best single host alone, at equal tokens.

Brings up sim `dl1` (home scenario: Pi 5, Jetson with its 300 Mbit/s uplink, Mac mini and
laptop, CPU-capped at 0.15/0.25/0.45/0.65 of a core scaled to this machine, 10.62.1.0/24),
measures the links (`smolnet matrix`) and every host's compute (`smoltrain calibrate -i`),
asks `plan --strategy all` for its verdict and the diloco setting it recommends (H and the
sync dtype), then trains the same global batches for the same number of steps three ways,
each with `--placement auto` and `--eval-every`:

  dp      across the four hosts (a ring all-reduce of the gradients every step);
  diloco  across the four hosts, at the plan's H and sync dtype (outer lr/momentum: `run`'s
          default for the run's length);
  alone   dp on the best single host only (a placement that names just that host).

Targets (issue 24): diloco tokens/s >= 3x dp's and >= 1.3x the single host's; bytes per token
<= dp's / 20; held-out loss at the end within 5% of dp's (equal tokens); plan vs measured step
time within 25% (`plan --compare`). Also reported: the held-out loss at equal wall-clock.
Results: BENCHMARKS.md, "DiLoCo on the home sim".

    flock /tmp/smol-sim.lock .venv/bin/python bench/bench_diloco.py [--steps 96] [--batch 8]

Keeps its result in bench/results/diloco.json (bench/common.py); exits 1 when a target is missed.
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

from smoltrain.demo.diloco import (
    busiest_bytes_per_token,
    loss_at,
    measured_tokens_per_s,
    wall_clock,
)

NAME, SUBNET = "dl1", "10.62.1.0/24"
BAR = (
    "diloco on the capped home sim: >= 3x dp, >= 1.3x the best host alone, <= dp's bytes / 20, "
    "held-out within 5% of dp, plan within 25%"
)


def train(tag: str, strategy: str, inv: Path, d: Path, a, extra: list) -> dict:
    out = d / f"{tag}.json"
    sh(
        [PY, "-m", "smoltrain", "run", "--strategy", strategy, "-i", inv, "--model", a.model]
        + ["--steps", a.steps, "--batch", a.batch, "--seq", a.seq, "--eval-every", a.eval_every]
        + ["--links", d / "links.json", "--compute", d / "compute.json", "--json", out, "--out", d]
        + extra,
        ok=(0,),
        timeout=3600,
    )
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    out = str(ROOT / "bench" / "out" / "diloco.json")
    for flag, default in (("--steps", "96"), ("--batch", "8"), ("--seq", "64"), ("--model", "tiny"), ("--out", out)):
        ap.add_argument(flag, default=default)
    a = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="dlbench-"))
    print(f"working in {d}", flush=True)
    inv = up(d, name=NAME, subnet=SUBNET)
    try:
        sh([PY, "-m", "smolnet", "matrix", "-i", inv, "--duration", "2", "--out", d])
        sh([PY, "-m", "smoltrain", "calibrate", "-i", inv, "--model", a.model, "--out", d / "compute.json"])
        plans = d / "plans.json"
        sh(
            [PY, "-m", "smoltrain", "plan", "--strategy", "all", "-i", inv, "--model", a.model, "--batch", a.batch]
            + ["--seq", a.seq, "--links", d / "links.json", "--compute", d / "compute.json", "--json", plans]
        )
        doc = json.loads(plans.read_text())
        low = doc.get("low_communication")
        diloco_plan = next(p for p in doc["plans"] if p["strategy"] == "diloco")
        if low:  # the verdict's setting
            h, dtype = low["best"]["inner_steps"], low["best"]["sync_dtype"]
        else:  # no verdict (a synchronous strategy beats the host): the plan's H for int8 under auto placement
            dtype, one = "int8", d / "plan-diloco.json"
            sh(
                [PY, "-m", "smoltrain", "plan", "--strategy", "diloco", "-i", inv, "--model", a.model, "--batch"]
                + [a.batch, "--seq", a.seq, "--links", d / "links.json", "--compute", d / "compute.json"]
                + ["--placement", "auto", "--sync-dtype", dtype, "--no-what-if", "--json", one]
            )
            h = json.loads(one.read_text())["inner_steps"]
        host = diloco_plan["single_host"]["name"]
        print(f"plan: {low['sentence'] if low else diloco_plan['verdict']}", flush=True)
        a.eval_every = h * -(-8 // h)  # every strategy's held-out loss at diloco's outer steps, every 8+ steps
        a.steps = str(-(-int(a.steps) // h) * h)  # whole outer steps, the same tokens for all three
        alone_placement = d / "alone.json"
        alone_placement.write_text(json.dumps({"mode": "even", "strategy": "dp", "order": [host], "shares": [1.0]}))
        runs = {
            "dp": train("dp", "dp", inv, d, a, ["--placement", "auto"]),
            "diloco": train(
                "diloco", "diloco", inv, d, a, ["--placement", "auto", "--inner-steps", h, "--sync-dtype", dtype]
            ),
            "alone": train("alone", "dp", inv, d, a, ["--placement", alone_placement]),
        }
        cmp_path = d / "compare-diloco.json"
        sh(
            [PY, "-m", "smoltrain", "plan", "--compare", d / "diloco.json", "-i", inv, "--links", d / "links.json"]
            + ["--compute", d / "compute.json", "--no-what-if", "--json", cmp_path]
        )
        cmp = json.loads(cmp_path.read_text())
    finally:
        down(NAME)
    tps = {k: measured_tokens_per_s(v) for k, v in runs.items()}
    bpt = {k: busiest_bytes_per_token(v) for k, v in runs.items() if k != "alone"}
    final = {k: v["evals"][-1]["loss"] for k, v in runs.items()}
    t_diloco = wall_clock(runs["diloco"])[runs["diloco"]["steps"][-1]["step"]]
    dp_then, dp_step = loss_at(runs["dp"], t_diloco)
    alone_then, alone_step = loss_at(runs["alone"], t_diloco)
    step_ratio = cmp["step_s"]["measured"] / cmp["step_s"]["predicted"]
    result = {
        "inner_steps": h,
        "sync_dtype": dtype,
        "outer": [runs["diloco"]["config"][k] for k in ("outer_lr", "outer_momentum")],
        "single_host": host,
        "tokens_per_s": tps,
        "diloco_vs_dp": tps["diloco"] / tps["dp"],
        "diloco_vs_alone": tps["diloco"] / tps["alone"],
        "bytes_per_token": bpt,
        "dp_bytes_over_diloco": bpt["dp"] / bpt["diloco"],
        "held_out_final": final,
        "held_out_gap_vs_dp": final["diloco"] / final["dp"] - 1,
        "equal_wall_clock": {
            "seconds": t_diloco,
            "diloco": final["diloco"],
            "dp": dp_then,
            "dp_step": dp_step,
            "alone": alone_then,
            "alone_step": alone_step,
        },
        "step_s": cmp["step_s"],
        "step_s_ratio": step_ratio,
        "bytes_exact": cmp.get("bytes_exact"),
        "waits": cmp["outer"]["wait_s"],
        "verdict": low,
        "load_average": os.getloadavg(),
    }
    checks = [
        ("diloco tokens/s >= 3x dp", result["diloco_vs_dp"] >= 3),
        (f"diloco tokens/s >= 1.3x {host} alone", result["diloco_vs_alone"] >= 1.3),
        ("bytes per token <= dp's / 20", result["dp_bytes_over_diloco"] >= 20),
        ("held-out loss within 5% of dp's", result["held_out_gap_vs_dp"] <= 0.05),
        ("plan vs measured step time within 25%", abs(step_ratio - 1) <= 0.25),
    ]
    print(
        f"diloco H={h} {dtype} outer {result['outer']}: {tps['diloco']:,.0f} tok/s; dp {tps['dp']:,.0f}; "
        f"{host} alone {tps['alone']:,.0f} ({result['diloco_vs_dp']:.2f}x dp, {result['diloco_vs_alone']:.2f}x alone)"
    )
    print(
        f"bytes/token: diloco {bpt['diloco']:,.1f}, dp {bpt['dp']:,.1f} ({result['dp_bytes_over_diloco']:.0f}x less); "
        f"held-out at {a.steps} steps: diloco {final['diloco']:.4f}, dp {final['dp']:.4f} "
        f"({result['held_out_gap_vs_dp']:+.1%}), alone {final['alone']:.4f}"
    )
    print(
        f"at equal wall-clock ({t_diloco:.1f} s, diloco's end): dp {dp_then} (step {dp_step}), "
        f"alone {alone_then} (step {alone_step}); step time plan {cmp['step_s']['predicted'] * 1e3:.1f} ms vs "
        f"measured {cmp['step_s']['measured'] * 1e3:.1f} ms (x{step_ratio:.2f}); bytes exact: {cmp.get('bytes_exact')}"
    )
    for what, ok in checks:
        print(f"  {'ok    ' if ok else 'MISSED'} {what}")
    result["checks"] = {what: ok for what, ok in checks}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    met = all(ok for _, ok in checks)
    missed = [what for what, ok in checks if not ok]
    headline = (
        f"{result['diloco_vs_dp']:.2f}x dp, {result['diloco_vs_alone']:.2f}x {host} alone, "
        f"{result['dp_bytes_over_diloco']:.0f}x fewer bytes, held-out {result['held_out_gap_vs_dp']:+.1%}, "
        f"plan x{step_ratio:.2f}" + (f"; missed: {', '.join(missed)}" if missed else "")
    )
    kept = write_result("diloco", BAR, met, headline, result)
    print(f"wrote {out} and {kept}; {sum(ok for _, ok in checks)} of {len(checks)} targets met")
    return exit_code(met)


if __name__ == "__main__":
    sys.exit(main())
