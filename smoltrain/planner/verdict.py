"""Is the cluster worth it? The best single host alone, and one sentence on what limits the plan.

Why: the first question a person with several machines has is whether splitting the work
beats the fastest machine on its own; the plan answers it before anything is run.
"""

from __future__ import annotations

import math

from smoltrain import registry
from smoltrain.planner import capacity, rank_time

WORDS = {
    "capacity": "memory capacity",
    "link": "link bandwidth",
    "latency": "link latency",
    "compute": "compute",
    "memory-bandwidth": "memory bandwidth",
}


def _replica() -> str:
    """The plain replica (a batch split that neither shards nor serves): one host alone."""
    return next(
        s.name
        for s in registry.REGISTRY.values()
        if s.splits == "batch" and not s.parameter_server and not s.shards_params
    )


def alone(
    rk, model, *, dtype: str, batch: int, seq: int, mode: str, compute_dtype=None, quantize=None, tuning=None
) -> dict:
    """One host training the whole global batch by itself: in one pass when it fits, else
    with gradient accumulation (the fewest passes whose share of the batch fits; each pass
    pays the per-pass costs, the update is paid once)."""
    sh = rank_time.Shape(_replica(), mode, model, dtype, batch, seq, 1, compute_dtype, quantize, tuning)
    w = capacity.layout(sh.strategy, mode, model, 1, batch, seq)[0]
    passes = range(1, batch + 1) if mode == "train" else (1,)
    for k in passes:
        per = math.ceil(batch / k)
        if k > 1 and math.ceil(batch / (k - 1)) == per:
            continue  # the same share as fewer passes
        wk = capacity.RankWork(**{**w.__dict__, "in_flight": per * seq if k > 1 else 0.0})
        mem = rank_time.memory(wk, sh)
        if rank_time.fits(rk, mem):
            t = rank_time.seconds(rk, wk, rank_time.Shape(**{**sh.__dict__, "passes": k}))
            toks = batch * seq if mode == "train" else 1
            return {"fits": True, "step_s": t.compute_s, "tokens_per_s": toks / t.compute_s, "accumulation": k}
    mem = rank_time.memory(w, sh)
    return {"fits": False, "step_s": None, "tokens_per_s": 0.0, "accumulation": None, "memory_needed": mem.total}


def single_host(model, ranks: list, **kw) -> dict:
    """The best host alone (one rank, nothing crosses a link), with gradient accumulation
    where the global batch does not fit at once: {name, fits, step_s, tokens_per_s,
    accumulation}."""
    best = None
    seen = set()
    for rk in ranks:
        if rk.name in seen:
            continue
        seen.add(rk.name)
        row = {"name": rk.name, **alone(rk, model, **kw)}
        key = (row["fits"], row["tokens_per_s"], rk.memory_bytes)
        if best is None or key > best[0]:
            best = (key, row)
    row = best[1] if best else {"name": None, "fits": False, "step_s": None, "tokens_per_s": 0.0}
    row.pop("memory_needed", None)
    return row


def sentence(plan: dict) -> str:
    """One sentence: faster than the best single host or not, and the limit, in words."""
    one = plan.get("single_host") or {}
    tps = plan.get("tokens_per_s") or 0.0
    what = WORDS.get(plan.get("bottleneck"), plan.get("bottleneck") or "?")
    where = plan.get("bottleneck_where") or ""
    where = where.split(";")[0]
    n, s = plan.get("world_size"), plan.get("strategy")
    if plan.get("bottleneck") == "capacity":
        return f"{s} on {n} ranks does not fit: {where}."
    if plan.get("bottleneck") == "link" and "is down" in where:  # a link it needs is down
        return f"{s} on {n} ranks cannot run here: {where}."
    if not one.get("name"):
        return f"{s} on {n} ranks runs {tps:,.1f} tokens/s, limited by {what} ({where})."
    if not one.get("fits"):
        return (
            f"The model does not fit on any single host (best: {one['name']}), so the cluster is what makes "
            f"it run: {s} on {n} ranks gives {tps:,.1f} tokens/s, limited by {what} ({where})."
        )
    alone = one.get("tokens_per_s") or 0.0
    if alone <= 0:
        return f"{s} on {n} ranks runs {tps:,.1f} tokens/s, limited by {what} ({where})."
    ratio = tps / alone
    k = one.get("accumulation") or 1
    if k > 1:  # the host alone needs several passes per step; name it as the host it is
        one = dict(one, name=f"{one['name']} (accumulating {k} passes per step)")
    if ratio >= 1.05:
        return (
            f"The cluster is {ratio:.2g}x faster than {one['name']} alone ({tps:,.1f} vs {alone:,.1f} tokens/s); "
            f"{what} limits it ({where})."
        )
    if ratio > 0.95:
        return (
            f"The cluster is no faster than {one['name']} alone ({tps:,.1f} vs {alone:,.1f} tokens/s); "
            f"{what} limits it ({where})."
        )
    if plan.get("bottleneck") in ("link", "latency"):
        fix = "use faster links"
    elif plan.get("placement_mode") == "auto":  # already split by speed: the hosts are too slow
        fix = "add faster hosts"
    else:
        fix = "give the slowest host less work (--placement auto)"
    return (
        f"The cluster is slower than {one['name']} alone ({tps:,.1f} vs {alone:,.1f} tokens/s, {ratio:.2g}x): "
        f"{what} limits it ({where}); train on {one['name']} alone or {fix}."
    )
