"""Decode rate over one round against over five, pp and tp on the home sim.

    .venv/bin/python bench/bench_decode_rounds.py [--runs 5] [--rounds 5]

A 48-token decode on the home sim lasts a fraction of a second, a dozen of the 0.15-core Pi's
17 ms CFS periods, and its rate turns on where the throttles fall (twelve one-round pp runs of
one tree on one sim read 0.78-1.43 of the plan). `generate --rounds N` decodes the same request
N times and reports the rate over all of them. One sim, one calibration (`--repeat 3`), then
`--runs` generate runs of each strategy with `--rounds`; each round's own rate is a one-round
sample. Bar: every run's rate over its rounds within 25% of its plan, for pp and tp; the rounds'
own spread is recorded beside it. Keeps bench/results/decode-rounds.json; exits 1 on a miss.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from common import PY, exit_code, sh, write_result
from compute_decode import checkpoint, run_decode, spread
from compute_sims import down, up

BAR = "generate --rounds 5 on the home sim: every run's decode tokens/s within 25% of its plan, pp and tp"
SIM, SUBNET = "scrounds", "10.66.28.0/24"
MISS = 0.25


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5, help="generate runs of each strategy")
    ap.add_argument("--rounds", type=int, default=5, help="generate --rounds")
    a = ap.parse_args()
    if a.runs < 1 or a.rounds < 2:
        ap.error("--runs must be at least 1 and --rounds at least 2")
    d = Path(tempfile.mkdtemp(prefix="bench-rounds-"))
    inv = up(d, "home", name=SIM, subnet=SUBNET)
    runs: list[dict] = []
    try:
        sh([PY, "-m", "smolnet", "matrix", "-i", inv, "--duration", "2", "--out", d], ok=(0, 4))
        sh([PY, "-m", "smoltrain", "calibrate", "-i", inv, "--model", "tiny8", "--repeat", "3"]
           + ["--out", d / "compute.json"], ok=(0, 4), timeout=1800)  # fmt: skip
        model = checkpoint(d)
        for i in range(a.runs):
            for row in run_decode(inv, d, model, rounds=a.rounds):
                if "pred" not in row:
                    raise SystemExit(f"{row['strategy']} run {i}: {row.get('error') or row.get('skipped')}")
                runs.append(
                    {"strategy": row["strategy"], "plan_tokens_per_s": row["pred"], "tokens_per_s": row["meas"]}
                    | {"rounds_tokens_per_s": row["rounds"], "order": row["order"]}
                )
                print(f"{row['strategy']} run {i}: {row['meas'] / row['pred']:.2f} of plan; rounds {spread(row)}")
    finally:
        down(SIM)
    met, headline, data = judge(runs, a.rounds)
    path = write_result("decode-rounds", BAR, met, headline, data)
    print(headline)
    print(f"wrote {path}")
    return exit_code(met)


def judge(runs: list[dict], rounds: int) -> tuple[bool, str, dict]:
    parts, met, summary = [], True, {}
    for s in ("pp", "tp"):
        rs = [r for r in runs if r["strategy"] == s]
        whole = [r["tokens_per_s"] / r["plan_tokens_per_s"] for r in rs]
        one = [x / r["plan_tokens_per_s"] for r in rs for x in r["rounds_tokens_per_s"]]
        inside = sum(abs(q - 1) <= MISS for q in whole)
        one_in = sum(abs(q - 1) <= MISS for q in one)
        met = met and inside == len(whole)
        summary[s] = {"runs_within": inside, "runs": len(whole), "rounds_within": one_in, "rounds": len(one)}
        summary[s] |= {"run_ratios": whole, "round_ratios": one, "round_median": statistics.median(one)}
        parts.append(
            f"{s}: {inside} of {len(whole)} runs over {rounds} rounds within 25% ({min(whole):.2f}-{max(whole):.2f}), "
            f"single rounds {one_in} of {len(one)} ({min(one):.2f}-{max(one):.2f})"
        )
    return met, "; ".join(parts), {"rounds": rounds, "summary": summary, "runs": runs}


if __name__ == "__main__":
    raise SystemExit(main())
