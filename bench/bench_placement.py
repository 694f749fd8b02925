"""Placement bench: dp and pp tokens/s under `--placement auto` vs `even` on mismatched ranks.

The compute-capped home sim is not on this branch, so the mismatch is made here with
cgroup-v1 CPU quotas on loopback ranks (needs root and a writable /sys/fs/cgroup/cpu):
rank0 gets FAST cores, rank1 and rank2 SLOW cores each (small quotas by default, so
the caps, not other load on a shared machine, set the speeds). Each rank's training speed is then
*measured* inside its cgroup (timed steps of the model at two batch sizes, the shape of
`smoltrain calibrate`), written as a smoltrain.compute/1 report, and both `smoltrain plan`
(predicted gain) and `smoltrain run --placement auto|even` (measured gain) read it. The
workers are started by this script, each inside its cgroup, against a `--external` run.

Targets (issue 13): dp auto >= 1.5x even, pp auto >= 1.2x even; the plan's predicted gains
within 25% of the measured ones. Results: BENCHMARKS.md, "Placement by measured speed".

    sudo .venv/bin/python bench/bench_placement.py [--steps 12] [--fast 0.2] [--slow 0.03]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CG = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000
MEASURE = r"""
import json, sys, time, torch
from smoltrain.models.gpt import build_model, loss_sum
from smoltrain.models.spec import get_model
torch.set_num_threads(1)
spec, seq = get_model(sys.argv[1]), int(sys.argv[2])
m = build_model(spec, 0)
rows = []
for b in (2, 8):
    x = torch.randint(0, spec.vocab, (b, seq))
    loss_sum(m(x), x, b * seq).backward()  # warm-up
    n, t0 = 0, time.perf_counter()
    while n < 3 or time.perf_counter() - t0 < 2.0:  # mean over many CFS periods: a quota throttles on average
        loss_sum(m(x), x, b * seq).backward()
        m.zero_grad()
        n += 1
    rows.append({"model": spec.name, "batch": b, "seq": seq, "seconds": (time.perf_counter() - t0) / n})
print(json.dumps(rows))
"""


def cgroup(name: str, cores: float) -> Path:
    g = CG / f"smol-place-{name}"
    g.mkdir(exist_ok=True)
    (g / "cpu.cfs_period_us").write_text(str(PERIOD_US))
    (g / "cpu.cfs_quota_us").write_text(str(int(cores * PERIOD_US)))
    return g


def in_group(g: Path, argv: list[str]) -> list[str]:
    return ["sh", "-c", f'echo $$ > {g}/cgroup.procs && exec "$@"', "sh", *argv]


def measure(groups, model: str, seq: int) -> dict:
    """All ranks at once, as they will run: on a shared machine the others' load is part of the speed."""
    procs = [
        subprocess.Popen(
            in_group(g, [sys.executable, "-c", MEASURE, model, str(seq)]), stdout=subprocess.PIPE, text=True
        )
        for g in groups
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("measuring a rank's speed failed")
    hosts = []
    for r, (g, out) in enumerate(zip(groups, outs)):
        hosts.append(
            {
                "name": f"rank{r}",
                "machine_id": "bench",
                "cores": os.cpu_count(),
                "cpu_limit_cores": float((g / "cpu.cfs_quota_us").read_text()) / PERIOD_US,
                "flops": {},
                "mem_bw_bytes_s": None,
                "train_step": json.loads(out),
                "usable_memory_bytes": 4e9,
            }
        )
    return {
        "schema": "smoltrain.compute/1",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "hosts": hosts,
    }


def one_run(strategy, placement, groups, compute, secret, args, d) -> dict:
    port = 7800 + secrets.randbelow(1000)
    out = d / f"{strategy}-{placement}.json"
    ctl = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "smoltrain",
            "run",
            "--strategy",
            strategy,
            "--local",
            str(len(groups)),
            "--external",
            "--control-port",
            str(port),
            "--secret-file",
            str(secret),
            "--steps",
            str(args.steps),
            "--batch",
            str(args.batch),
            "--seq",
            str(args.seq),
            "--microbatches",
            str(args.microbatches),
            "--placement",
            placement,
            "--compute",
            str(compute),
            "--json",
            str(out),
            "--out",
            str(d),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    time.sleep(3)  # the control channel opens after the plan; workers retry their connection anyway
    workers = [
        subprocess.Popen(
            in_group(
                g, [sys.executable, "-m", "smoltrain", "worker", "--control", f"127.0.0.1:{port}", "--rank", str(r)]
            ),
            stdin=open(secret),  # noqa: SIM115 (the child reads it)
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for r, g in enumerate(groups)
    ]
    log, _ = ctl.communicate(timeout=1800)
    for w in workers:
        w.wait(timeout=60)
    if ctl.returncode != 0:
        raise SystemExit(f"{strategy} {placement}: exit {ctl.returncode}: {log[-1500:]}")
    doc = json.loads(out.read_text())
    steps = doc["steps"][2:]  # the first steps warm up
    s = sum(x["step_s"] for x in steps) / len(steps)
    return {"tokens_per_s": args.batch * args.seq / s, "step_s": s, "placement": doc["placement"]}


def predicted(strategy, compute, args, d) -> dict:
    out = d / f"plan-{strategy}.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "smoltrain",
            "plan",
            "--strategy",
            strategy,
            "--world",
            "3",
            "--batch",
            str(args.batch),
            "--seq",
            str(args.seq),
            "--microbatches",
            str(args.microbatches if strategy == "pp" else 1),
            "--compute",
            str(compute),
            "--placement",
            "auto",
            "--no-what-if",
            "--json",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return json.loads(out.read_text())["placement"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--fast", type=float, default=0.2, help="cores of rank0")
    ap.add_argument("--slow", type=float, default=0.03, help="cores of rank1 and rank2")
    ap.add_argument("--json", default="reports/bench-placement.json")
    args = ap.parse_args()
    if not os.access(CG, os.W_OK):
        raise SystemExit(f"{CG} is not writable: run as root on a cgroup-v1 host (unmeasured otherwise)")
    d = Path(tempfile.mkdtemp(prefix="bench-place-"))
    secret = d / "secret"
    secret.write_text(secrets.token_hex(32) + "\n")
    os.chmod(secret, 0o600)
    groups = [cgroup("r0", args.fast), cgroup("r1", args.slow), cgroup("r2", args.slow)]
    try:
        compute = d / "compute.json"
        compute.write_text(json.dumps(measure(groups, "tiny", args.seq)))
        rows = []
        for strategy, target in (("dp", 1.5), ("pp", 1.2)):
            even = one_run(strategy, "even", groups, compute, secret, args, d)
            auto = one_run(strategy, "auto", groups, compute, secret, args, d)
            plan = predicted(strategy, compute, args, d)
            gain = auto["tokens_per_s"] / even["tokens_per_s"]
            row = {
                "strategy": strategy,
                "even_tokens_per_s": even["tokens_per_s"],
                "auto_tokens_per_s": auto["tokens_per_s"],
                "measured_gain": gain,
                "predicted_even_tokens_per_s": plan["predicted"]["even"]["tokens_per_s"],
                "predicted_auto_tokens_per_s": plan["predicted"]["auto"]["tokens_per_s"],
                "predicted_gain": plan["speedup"],
                "target": target,
                "auto_placement": auto["placement"],
            }
            row["prediction_error"] = abs(row["predicted_gain"] - gain) / gain
            rows.append(row)
            print(
                f"{strategy}: even {even['tokens_per_s']:,.0f} tok/s, auto {auto['tokens_per_s']:,.0f} tok/s, "
                f"gain {gain:.2f}x (target >= {target}x: {'ok' if gain >= target else 'MISSED'}); plan predicted "
                f"{plan['speedup']:.2f}x ({row['prediction_error']:.0%} off; target within 25%)",
                flush=True,
            )
        doc = {
            "fast_cores": args.fast,
            "slow_cores": args.slow,
            "steps": args.steps,
            "batch": args.batch,
            "seq": args.seq,
            "microbatches": args.microbatches,
            "compute": json.loads(compute.read_text()),
            "rows": rows,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.json}")
    finally:
        for g in groups:
            try:
                g.rmdir()
            except OSError:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
