"""Matrix wall time: host-disjoint rounds vs --sequential, side by side on a 4-host sim.

    flock /tmp/smol-bench.lock .venv/bin/python bench/bench_matrix.py [--duration 2] [--json FILE]

Needs root (the sim). Uses sim name "m1" (10.213.11.0/24), scenario uniform (4 hosts,
1000 Mbit/s each way), and tears it down. Each mode runs the real CLI end to end
(agents started over SSH, probes, report), twice, alternating.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import exit_code, write_result

from smolnet.files import write_text_atomic
from smolnet.sim import cluster as sim

NAME, SUBNET, INV = "m1", "10.213.11.0/24", "/tmp/bench-m1.yml"


def run_matrix(extra: list[str], duration: float) -> dict:
    with tempfile.TemporaryDirectory() as d:
        t0 = time.monotonic()
        p = subprocess.run(
            [sys.executable, "-m", "smolnet", "matrix", "-i", INV, "--duration", str(duration), "--out", d, *extra],
            capture_output=True,
            text=True,
            timeout=600,
        )
        wall = time.monotonic() - t0
        doc = json.loads(Path(f"{d}/links.json").read_text())
    goodput = [l["throughput_mbit"] for l in doc["links"] if l["throughput_mbit"] is not None]
    return {
        "rc": p.returncode,
        "wall_s": round(wall, 1),
        "min_goodput_mbit": min(goodput),
        "median_goodput_mbit": statistics.median(goodput),
    }


BAR_RATIO = 0.6
BAR = "4-host matrix wall time <= 0.6 of --sequential"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sim.up(name=NAME, scenario="uniform", hosts=4, subnet=SUBNET, inventory=INV)
    try:
        res = {"rounds": [], "sequential": []}
        for _ in range(args.reps):
            res["rounds"].append(run_matrix([], args.duration))
            res["sequential"].append(run_matrix(["--sequential"], args.duration))
            print(res, file=sys.stderr)
    finally:
        sim.down(name=NAME)
    r = statistics.median(x["wall_s"] for x in res["rounds"])
    s = statistics.median(x["wall_s"] for x in res["sequential"])
    out = {
        "duration_s": args.duration,
        "hosts": 4,
        **res,
        "summary": {"rounds_wall_s": r, "sequential_wall_s": s, "ratio": round(r / s, 3)},
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        write_text_atomic(args.json, text + "\n")
    failed = [x for x in res["rounds"] + res["sequential"] if x["rc"] != 0]
    met = not failed and r / s <= BAR_RATIO
    headline = f"{r / s:.2f} ({r:g} s in rounds, {s:g} s sequential" + (f", {len(failed)} failed)" if failed else ")")
    kept = write_result("matrix", BAR, met, headline, out)
    print(f"{headline}: {'met' if met else 'MISSED'} ({kept})")
    return exit_code(met)


if __name__ == "__main__":
    sys.exit(main())
