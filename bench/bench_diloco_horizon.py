"""Which outer settings fit which run length: DiLoCo's held-out loss against dp's at equal tokens.

An in-process simulation with the code `smoltrain run` uses (model, data, optimizers, the
outer step as smoltrain.strategies.diloco applies it), without the transport: W replicas
train H inner steps each on their slice of every global batch, then the outer step; dp is
the same global batches on one replica (what dp computes). For each run length and H it
reports the final held-out loss of each outer setting as a gap to dp's (negative: better).

    .venv/bin/python bench/bench_diloco_horizon.py [--steps 48,96,192,384] [--inner-steps 8]

Defaults follow the issue's reference: the tiny model, 4 workers, batch 8, seq 64, inner
AdamW at lr 1e-3. Results: BENCHMARKS.md, "DiLoCo: outer settings by run length".
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from common import ROOT

from smoltrain.models.data import Batches, load_corpus
from smoltrain.models.gpt import build_model, loss_sum
from smoltrain.models.optim import make_optimizer
from smoltrain.models.spec import get_model
from smoltrain.planner.placement import even_counts, ranges
from smoltrain.strategies import mean_loss
from smoltrain.strategies.parameter_server import flat_params

SETTINGS = {"0.7/0.9": (0.7, 0.9), "1.0/0.0": (1.0, 0.0), "1.0/0.5": (1.0, 0.5), "0.9/0.7": (0.9, 0.7)}


def held_out(model, batches) -> float:
    losses = [mean_loss(model, x, y) for x, y in batches.eval_batches()]
    return sum(losses) / len(losses)


def replica(spec, seed, optimizer, lr):
    model = build_model(spec, seed)
    flat = flat_params(model)
    params = list(model.parameters())
    return model, flat, params, make_optimizer(optimizer, params, lr)


def step(model, params, opt, x, y) -> None:
    loss_sum(model(x), y, y.numel()).backward()
    opt.step([p.grad for p in params])
    for p in params:
        p.grad = None


def dp(spec, batches, steps: int, a) -> float:
    model, _, params, opt = replica(spec, a.seed, a.optimizer, a.lr)
    for k in range(steps):
        step(model, params, opt, *batches.global_batch(k))
    return held_out(model, batches)


def diloco(spec, batches, steps: int, h: int, outer_lr: float, mu: float, a) -> float:
    reps = [replica(spec, a.seed, a.optimizer, a.lr) for _ in range(a.workers)]
    cuts = ranges(even_counts(a.batch, a.workers))
    anchor = reps[0][1].clone()
    momentum = torch.zeros_like(anchor)
    for k in range(steps):
        x, y = batches.global_batch(k)
        for (model, _, params, opt), (lo, hi) in zip(reps, cuts):
            step(model, params, opt, x[lo:hi], y[lo:hi])
        if (k + 1) % h == 0 or k + 1 == steps:
            delta = sum((anchor - flat) * ((hi - lo) / a.batch) for (_, flat, _, _), (lo, hi) in zip(reps, cuts))
            momentum.mul_(mu).add_(delta)
            anchor.sub_(delta.add_(momentum, alpha=mu), alpha=outer_lr)
            for _, flat, _, _ in reps:
                flat.copy_(anchor)
    return held_out(reps[0][0], batches)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="48,96,192,384", help="run lengths, in inner steps")
    ap.add_argument("--inner-steps", default="8", help="H values, comma-separated")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="outer lr/momentum pairs")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "diloco-horizon.json"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    spec = get_model("tiny")
    batches = Batches(load_corpus(None), a.batch, a.seq, a.seed, holdout=True)
    rows = []
    for steps in (int(s) for s in a.steps.split(",")):
        ref = dp(spec, batches, steps, a)
        for h in (int(x) for x in a.inner_steps.split(",")):
            row = {"steps": steps, "inner_steps": h, "outer_steps": -(-steps // h), "dp": ref, "gap": {}}
            for name in a.settings.split(","):
                t0 = time.perf_counter()
                got = diloco(spec, batches, steps, h, *SETTINGS[name], a)
                row["gap"][name] = got / ref - 1
                print(
                    f"steps {steps:4d} H {h:3d} ({row['outer_steps']:3d} outer) {name}: held-out {got:.4f} "
                    f"vs dp {ref:.4f}: {row['gap'][name]:+.1%}  ({time.perf_counter() - t0:.0f}s)",
                    flush=True,
                )
            rows.append(row)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
