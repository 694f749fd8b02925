"""The calibration probe's figures against each other, on this machine: what the tests no
longer compare, because a busy machine can reorder any two measured times.

Bar: on one host, in the tiny model, the optimizer update takes less than the training step
it is part of (both batches), and a one-token decode step less than a batch-2 training step.
(A layer's cost beyond its products never falls with more rows by the probe's own rule:
tests/test_calibrate_cluster.py checks that rule.) Each is measured `--rounds` times (the
probe's own medians); the bar holds when every round holds.

    .venv/bin/python bench/bench_calibrate.py [--rounds 2] [--seconds 0.1]

Writes bench/results/calibrate.json; exits 1 when the bar is missed.
"""

from __future__ import annotations

import argparse
import sys

from common import exit_code, write_result

from smolnet.inventory import Host
from smoltrain.calibration.cluster import calibrate_hosts

BAR = "calibrate on one host: optimizer update < its training step, one-token decode step < a training step"


def checks(h: dict) -> dict:
    """Each ordering the bar asks of one host's report, True where it holds."""
    steps = h["train_step"]
    out = {f"optimizer < step (batch {s['batch']})": s["optimizer_seconds"] < s["seconds"] for s in steps}
    out["decode step < batch-2 training step"] = h["decode_step"][0]["seconds"] < steps[0]["seconds"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=0.1, help="each kernel's timing window")
    a = ap.parse_args()
    if a.rounds < 1 or a.seconds <= 0:
        ap.error("--rounds must be at least 1 and --seconds positive")
    here = Host(name="here", address="127.0.0.1", cluster_ip="127.0.0.1", local=True, python=sys.executable)
    rounds = []
    for _ in range(a.rounds):
        (h,) = calibrate_hosts([here], "tiny", a.seconds)["hosts"]
        if h.get("status") != "ok":
            raise SystemExit(f"the probe failed: {h.get('error')}")
        figures = {
            "train_step": [{k: s[k] for k in ("batch", "seconds", "optimizer_seconds")} for s in h["train_step"]],
            "decode_step_s": h["decode_step"][0]["seconds"],
        }
        rounds.append({"checks": checks(h), "figures": figures})
    held = sum(all(r["checks"].values()) for r in rounds)
    met = held == len(rounds)
    missed = sorted({k for r in rounds for k, ok in r["checks"].items() if not ok})
    headline = f"{held} of {len(rounds)} rounds hold every ordering" + (
        f"; missed: {', '.join(missed)}" if missed else ""
    )
    path = write_result("calibrate", BAR, met, headline, {"rounds": rounds})
    print(f"{headline} ({path})")
    return exit_code(met)


if __name__ == "__main__":
    sys.exit(main())
