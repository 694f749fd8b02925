"""Per-rank parameter + optimizer memory of fsdp vs dp, measured on real runs.

Each run reports, per rank, the bytes of the tensors the strategy keeps between
steps (parameters, and the AdamW moments), read off the live tensors at the end
of the run. dp keeps everything on every rank; fsdp (ZeRO-3) keeps 1/N of it.

    flock /tmp/smol-bench.lock .venv/bin/python bench/bench_fsdp_memory.py [--model tiny|FILE.json] [--out bench/fsdp-memory.json]

Bar: fsdp / dp within 5% of 1/N at every N; kept in bench/results/fsdp-memory.json, exit 1 when missed.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile

from common import exit_code, write_result

BAR = "fsdp per-rank parameter + optimizer memory within 5% of 1/N of dp's"


def run(strategy: str, world: int, model: str, secret: str, work: str) -> dict:
    out = os.path.join(work, f"{strategy}{world}.json")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "smoltrain",
            "run",
            "--strategy",
            strategy,
            "--local",
            str(world),
            "--model",
            model,
            "--steps",
            "2",
            "--batch",
            "6",
            "--seq",
            "32",
            "--secret-file",
            secret,
            "--json",
            out,
            "--out",
            work,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if p.returncode:
        raise SystemExit(f"{strategy} x{world} failed: {p.stderr.strip() or p.stdout[-400:]}")
    return json.load(open(out))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--worlds", default="1,2,3")
    ap.add_argument("--out", help="also write the rows as JSON here")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="bench-fsdp-")
    secret = os.path.join(work, "secret")
    with open(secret, "w") as f:
        f.write(secrets.token_hex(32))
    os.chmod(secret, 0o600)
    rows = []
    for world in [int(w) for w in args.worlds.split(",")]:
        per = {}
        for strategy in ("dp", "fsdp"):
            doc = run(strategy, world, args.model, secret, work)
            sb = doc["state_bytes"]
            per[strategy] = max(v["params"] + v["optimizer"] for v in sb.values())
        rows.append(
            {
                "world": world,
                "dp_bytes": per["dp"],
                "fsdp_bytes": per["fsdp"],
                "ratio": per["fsdp"] / per["dp"],
                "ideal": 1 / world,
            }
        )
    print(f"model {args.model}: per-rank parameter + AdamW state, the largest rank")
    print("| ranks | dp (MB) | fsdp (MB) | fsdp / dp | 1/N |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['world']} | {r['dp_bytes'] / 1e6:.3f} | {r['fsdp_bytes'] / 1e6:.3f} | {r['ratio']:.3f} | "
            f"{r['ideal']:.3f} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "rows": rows}, f, indent=1)
    met = all(abs(r["ratio"] / r["ideal"] - 1) <= 0.05 for r in rows)
    headline = ", ".join(f"{r['ratio']:.3f} (N={r['world']})" for r in rows)
    print(
        f"{headline}: {'met' if met else 'MISSED'} ({write_result('fsdp-memory', BAR, met, headline, {'rows': rows})})"
    )
    return exit_code(met)


if __name__ == "__main__":
    sys.exit(main())
