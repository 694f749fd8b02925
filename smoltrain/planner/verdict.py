"""Is the cluster worth it? The best single host alone, and one sentence on what limits the plan.

Why: the first question a person with several machines has is whether splitting the work
beats the fastest machine on its own; the plan answers it before anything is run.
"""

from __future__ import annotations

import math

from smoltrain import registry
from smoltrain.planner import capacity, rank_time
from smoltrain.planner.bottleneck import Bottleneck, head

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
    """One sentence: faster than the best single host or not, and the limit, in words (from the
    plan's bottleneck record)."""
    one = plan.get("single_host") or {}
    tps = plan.get("tokens_per_s") or 0.0
    bn = Bottleneck.from_dict(plan["bottleneck_detail"])
    what = WORDS.get(bn.kind, bn.kind)
    where = head(bn)
    n, s = plan.get("world_size"), plan.get("strategy")
    if bn.kind == "capacity":
        return f"{s} on {n} ranks does not fit: {where}."
    if bn.cause == "down":  # a link it needs is down
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
    if bn.kind in ("link", "latency"):
        fix = "use faster links"
    elif plan.get("placement_mode") == "auto":  # already split by speed: the hosts are too slow
        fix = "add faster hosts"
    else:
        fix = "give the slowest host less work (--placement auto)"
    return (
        f"The cluster is slower than {one['name']} alone ({tps:,.1f} vs {alone:,.1f} tokens/s, {ratio:.2g}x): "
        f"{what} limits it ({where}); train on {one['name']} alone or {fix}."
    )


def shortfall(plan: dict) -> dict | None:
    """The rank whose host misses the plan's memory by the most: {rank, name, needs, usable, short}
    in bytes; None when every rank fits."""
    worst = None
    for p in plan.get("ranks") or []:
        short = p["memory"]["total"] - p["memory_available"]
        if not p["fits"] and (worst is None or short > worst["short"]):
            worst = {
                "rank": p["rank"],
                "name": p["name"],
                "needs": p["memory"]["total"],
                "usable": p["memory_available"],
            }
            worst["short"] = short
    return worst


def refusal(plan: dict, short: dict) -> str:
    """One line: which host the layout does not fit, and by how much."""
    from smoltrain.planner.bottleneck import human_bytes

    return (
        f"{setup_name(plan)} on {plan['world_size']} rank{'s' * (plan['world_size'] != 1)} does not fit host "
        f"{short['name']}: it needs "
        f"{human_bytes(short['needs'])} of its {human_bytes(short['usable'])} usable memory, "
        f"{human_bytes(short['short'])} short"
    )


def setup_name(plan: dict) -> str:
    lora = (plan.get("tuning") or {}).get("lora")
    q = (plan.get("tuning") or {}).get("quantize")
    how = f"LoRA r={lora['rank']}" + (f" on a {q} base" if q else "") if lora else "full"
    return f"{plan['strategy']} ({how})"


def setups(plans: list[dict]) -> dict:
    """Fine-tuning setups (strategy x full or LoRA) compared: the fastest that fits on the cluster,
    the best single host alone under any of them, and the ratio (None where either is missing)."""
    fits = [p for p in plans if p.get("step_s") and not shortfall(p)]
    best = max(fits, key=lambda p: p["tokens_per_s"], default=None)
    alone = [(p["single_host"], p) for p in plans if (p.get("single_host") or {}).get("fits")]
    one, of = max(alone, key=lambda x: x[0]["tokens_per_s"], default=(None, None))

    def rec(p: dict) -> dict:
        lora = (p.get("tuning") or {}).get("lora")
        hosts = [r["name"] for r in p["ranks"]]
        return {
            "strategy": p["strategy"],
            "lora_rank": lora["rank"] if lora else None,
            "quantize": (p.get("tuning") or {}).get("quantize"),
            "world": p["world_size"],
            "hosts": hosts,
            "tokens_per_s": p["tokens_per_s"],
            "step_s": p["step_s"],
        }

    out = {"best": rec(best) if best else None, "single_host": None, "speedup": None}
    if one is not None:
        out["single_host"] = dict(one, **{k: rec(of)[k] for k in ("lora_rank", "quantize")})
        if best and one["tokens_per_s"] > 0:
            out["speedup"] = best["tokens_per_s"] / one["tokens_per_s"]
    return out


def setups_sentence(v: dict) -> str:
    """The setups record in words."""

    def how(r):
        return (
            (f"LoRA r={r['lora_rank']}" + (f" on a {r['quantize']} base" if r["quantize"] else ""))
            if r["lora_rank"]
            else "full"
        )

    b, one = v["best"], v["single_host"]
    if b is None:
        return "No setup fits the cluster's memory (try LoRA, a quantised base or --checkpoint-activations)."
    head = (
        f"Fastest setup that fits: {b['strategy']} with {how(b)} on {b['world']} rank{'s' * (b['world'] > 1)} "
        f"({', '.join(b['hosts'])}), {b['tokens_per_s']:,.1f} tokens/s"
    )
    if one is None:
        return head + "; no single host fits it alone."
    alone = f"{one['name']} alone ({how(one)}, {one['tokens_per_s']:,.1f} tokens/s)"
    if v["speedup"] >= 1.05:
        return f"{head}, {v['speedup']:.2g}x the best single host, {alone}."
    return f"{head}: no faster than the best single host, {alone}; train there."
