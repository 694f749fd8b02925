"""Training in bf16 against fp32 on this machine: tokens/s and the loss curves side by side, one run.

`smoltrain run --dtype bf16` runs the matmuls in bf16 (autocast) and keeps fp32 master weights,
gradients and AdamW state. Both dtypes train the same model from the same seed on the same
data, one rank (`--local 1`) at the same threads; rounds alternate fp32 and bf16 so a slow
spell of a shared machine hits both; tokens/s is each run's median step after a warm-up of
a quarter of the steps, and the figure is the median over rounds. The model (hidden 512,
8 layers, 26M parameters, batch 8 x 128) is big enough that its matmuls, not per-operation
overhead, set the step time.

    flock /tmp/smol-sim.lock .venv/bin/python bench/bench_dtype.py --rounds 2 --steps 40 --png bench/out/dtype.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from common import ROOT, exit_code, write_result

BAR = "bf16 training tokens/s >= fp32's (26M model, 1 thread)"
SHAPE = {"vocab": 256, "layers": 8, "hidden": 512, "heads": 8, "kv_heads": 8, "ffn": 2048, "ctx": 128}


def train(model: str, dtype: str, steps: int, threads: int, out: str) -> dict:
    argv = [sys.executable, "-m", "smoltrain", "run", "--strategy", "dp", "--local", "1", "--model", model]
    argv += ["--steps", str(steps), "--batch", "8", "--seq", "128", "--lr", "3e-4", "--dtype", dtype]
    argv += ["--threads", str(threads), "--json", out, "--out", os.path.dirname(out)]
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{dtype} run failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    with open(out) as f:
        return json.load(f)


def steady_tokens_per_s(doc: dict) -> float:
    steps = doc["steps"][max(2, len(doc["steps"]) // 4) :]
    return statistics.median(s["tokens"] / s["step_s"] for s in steps)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--png", help="loss curves of both dtypes here")
    p.add_argument("--json")
    a = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-dtype-")
    model = os.path.join(tmp, "mid26m.json")
    with open(model, "w") as f:
        json.dump(dict(SHAPE, name="mid26m", tied_embeddings=False), f)
    runs: dict[str, list[dict]] = {"fp32": [], "bf16": []}
    for r in range(a.rounds):
        for dtype in ("fp32", "bf16"):
            doc = train(model, dtype, a.steps, a.threads, os.path.join(tmp, f"{dtype}-{r}.json"))
            runs[dtype].append(doc)
            print(f"round {r + 1}: {dtype} {steady_tokens_per_s(doc):,.0f} tok/s, final loss {doc['final_loss']:.4f}")
    tps = {d: statistics.median(steady_tokens_per_s(x) for x in docs) for d, docs in runs.items()}
    curves = {d: [s["loss"] for s in docs[0]["steps"]] for d, docs in runs.items()}
    gap = max(abs(x - y) / x for x, y in zip(curves["fp32"], curves["bf16"]))
    print(
        f"\nbf16 / fp32 training tokens/s: {tps['bf16'] / tps['fp32']:.2f}x ({tps['bf16']:,.0f} vs {tps['fp32']:,.0f}, "
        f"{a.threads} thread(s), medians of {a.rounds} rounds); loss curves differ by at most {gap:.1%}"
    )
    print("step  fp32 loss  bf16 loss")
    for i in range(0, a.steps, max(1, a.steps // 10)):
        print(f"{i + 1:>4}  {curves['fp32'][i]:>9.4f}  {curves['bf16'][i]:>9.4f}")
    if a.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for d, c in curves.items():
            ax.plot(range(1, len(c) + 1), c, label=f"{d} ({tps[d]:,.0f} tok/s)")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title("dp --local 1, same seed and data: fp32 vs bf16 matmuls")
        ax.legend()
        os.makedirs(os.path.dirname(os.path.abspath(a.png)), exist_ok=True)
        fig.savefig(a.png, dpi=120, bbox_inches="tight")
    doc = {"tokens_per_s": tps, "curves": curves, "max_rel_gap": gap, "threads": a.threads, "rounds": a.rounds}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    met = tps["bf16"] >= tps["fp32"]
    headline = f"{tps['bf16'] / tps['fp32']:.2f}x ({a.threads} thread(s)); loss curves within {gap:.1%}"
    kept = write_result("dtype", BAR, met, headline, doc)
    print(f"{headline}: {'met' if met else 'MISSED'} ({kept})")
    return exit_code(met)


if __name__ == "__main__":
    sys.exit(main())
