"""Is the cluster worth it? The best single host alone, and one sentence on what limits the plan.

Why: the first question a person with several machines has is whether splitting the work
beats the fastest machine on its own; the plan answers it before anything is run.
"""

from __future__ import annotations

from collections.abc import Callable

WORDS = {
    "capacity": "memory capacity",
    "link": "link bandwidth",
    "latency": "link latency",
    "compute": "compute",
    "memory-bandwidth": "memory bandwidth",
}


def single_host(make_plan: Callable, model, ranks: list, **kw) -> dict:
    """The best host alone (one rank, nothing crosses a link): {name, fits, step_s, tokens_per_s}."""
    best = None
    seen = set()
    for rk in ranks:
        if rk.name in seen:
            continue
        seen.add(rk.name)
        d = make_plan("dp", model, 1, ranks=[rk], single=False, **kw)
        row = {
            "name": rk.name,
            "fits": bool(d["ranks"][0]["fits"]),
            "step_s": d["step_s"],
            "tokens_per_s": d["tokens_per_s"] if d["ranks"][0]["fits"] else 0.0,
            "memory_needed": d["ranks"][0]["memory"]["total"],
        }
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
