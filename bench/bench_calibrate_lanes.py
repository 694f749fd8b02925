"""calibrate's hosts of one machine two at a time against one after another, on the home sim.

    .venv/bin/python bench/bench_calibrate_lanes.py [--pairs 2] [--repeat 3]

The home sim's four capped hosts share 2 CPUs; calibration/together.py probes two at a time
there (two one-thread probes, the two largest caps 1.1 cores), where it probed one after
another. Each pair runs `smoltrain calibrate -i --repeat N` both ways on one sim, taking turns
which goes first (ABBA), and times each. Bar: the lanes take at most 0.75 of the sequential
wall time, and every host's training step (batch 2 and 8) and fp32 rate, the median over the
lanes runs, lies within 25% of the median over the sequential runs (the sequential runs' own
spread is recorded beside it: a busy machine moves both). Keeps
bench/results/calibrate-lanes.json; exits 1 on a miss.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from common import PY, exit_code, sh, write_result
from compute_sims import down, up

BAR = "calibrate two at a time on the home sim: wall <= 0.75 of one after another; steps and fp32 within 25%"
SIM, SUBNET = "sclanes", "10.66.29.0/24"
WALL_BAR, FIGURE_BAR = 0.75, 0.25


def figures(doc: dict) -> dict:
    """The figures judged, per host: fp32 FLOP/s and each training step's seconds."""
    out = {}
    for h in doc["hosts"]:
        f = {"fp32_flops": h["flops"]["fp32"]}
        f.update({f"step_s_batch{s['batch']}": s["seconds"] for s in h["train_step"]})
        out[h["name"]] = f
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=2, help="runs of each way (taking turns which goes first)")
    ap.add_argument("--repeat", type=int, default=3, help="calibrate --repeat (the demo's)")
    a = ap.parse_args()
    if a.pairs < 1 or a.repeat < 1:
        ap.error("--pairs and --repeat must be at least 1")
    d = Path(tempfile.mkdtemp(prefix="bench-lanes-"))
    inv = up(d, "home", name=SIM, subnet=SUBNET)
    runs: list[dict] = []
    try:
        for i in range(a.pairs):
            for way in ("lanes", "sequential") if i % 2 == 0 else ("sequential", "lanes"):
                out = d / f"compute-{len(runs)}-{way}.json"
                argv = [PY, "-m", "smoltrain", "calibrate", "-i", inv, "--model", "tiny8"]
                argv += ["--repeat", str(a.repeat), "--out", out] + (["--sequential"] if way == "sequential" else [])
                t0 = time.monotonic()
                sh(argv, timeout=1800)
                doc = json.loads(out.read_text())
                (m,) = doc["machines"]
                runs.append(
                    {"way": way, "wall_s": time.monotonic() - t0, "lanes": m.get("lanes"), "why": m["why"]}
                    | {"hosts": figures(doc)}
                )
                print(f"{way:10s} {runs[-1]['wall_s']:6.1f} s  {m['why']}", flush=True)
    finally:
        down(SIM)
    met, headline, data = judge(runs)
    path = write_result("calibrate-lanes", BAR, met, headline, data)
    print(headline)
    print(f"wrote {path}")
    return exit_code(met)


def judge(runs: list[dict]) -> tuple[bool, str, dict]:
    lanes = [r for r in runs if r["way"] == "lanes"]
    seq = [r for r in runs if r["way"] == "sequential"]
    two = all(r["lanes"] and r["lanes"] > 1 for r in lanes)  # the busy reading can keep them one by one
    wall = statistics.median(r["wall_s"] for r in lanes) / statistics.median(r["wall_s"] for r in seq)
    ratios: dict[str, dict] = {}
    for host in seq[0]["hosts"]:
        ratios[host] = {}
        for k in seq[0]["hosts"][host]:
            s = [r["hosts"][host][k] for r in seq]
            lane = statistics.median(r["hosts"][host][k] for r in lanes)
            ratios[host][k] = {
                "lanes_over_sequential": lane / statistics.median(s),
                "sequential_spread": max(s) / min(s),
            }
    off = [
        f"{h} {k} {v['lanes_over_sequential']:.2f}"
        for h, ks in ratios.items()
        for k, v in ks.items()
        if abs(v["lanes_over_sequential"] - 1) > FIGURE_BAR
    ]
    met = two and wall <= WALL_BAR and not off
    each = [v["lanes_over_sequential"] for ks in ratios.values() for v in ks.values()]
    headline = (
        f"two at a time {wall:.2f} of one after another's wall time (bar {WALL_BAR}); figures lanes/sequential "
        f"{min(each):.2f}-{max(each):.2f}"
        + (f"; outside 25%: {', '.join(off)}" if off else "; all within 25%")
        + ("" if two else "; a lanes run went one after another (the machine read busy)")
    )
    return met, headline, {"runs": runs, "wall_ratio": wall, "ratios": ratios}


if __name__ == "__main__":
    raise SystemExit(main())
