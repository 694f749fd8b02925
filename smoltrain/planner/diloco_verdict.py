"""A diloco run against its plan, and the low-communication verdict of `plan --strategy all`.

Split from planner.diloco (which counts the bytes and picks H): `plan --compare` checks a
run's bytes per outer step exactly and its pace over whole outer steps; the verdict says,
when every synchronous strategy is slower than the best single host, which outer-step
setting (H, sync dtype) would beat it and by how much, or that none would.
"""

from __future__ import annotations

from smoltrain.comm.layout import SYNC_BYTES
from smoltrain.planner.bottleneck import human_bytes
from smoltrain.planner.diloco import TARGET_COMM

NEAR = 0.95  # the verdict's setting: the fewest bytes per token among those within 5% of the fastest


def compare_outer(cmp: dict, plan: dict, run: dict) -> None:
    """Bytes per outer step per link, exact; step time per inner step from whole outer steps
    (ranks run their inner steps apart, so only an outer step's wall time is the run's pace),
    the first outer step (connections, allocator) left out as warm-up."""
    outer = run.get("outer_steps") or []
    n = len(outer)
    predicted = {(ln["src"], ln["dst"]): ln.get("bytes_per_outer_step", 0) for ln in plan["links"]}
    measured: dict[tuple[str, str], int] = {}
    for b in run.get("bytes") or []:
        measured[(b["src"], b["dst"])] = measured.get((b["src"], b["dst"]), 0) + int(b["bytes"])
    exact = True
    for row in cmp["links"]:
        key = (row["src"], row["dst"])
        row["predicted_bytes_per_outer_step"] = predicted.get(key, 0)
        row["measured_bytes_per_outer_step"] = measured.get(key, 0) / n if n else None
        row["exact"] = n > 0 and measured.get(key, 0) == predicted.get(key, 0) * n
        exact = exact and row["exact"]
    cmp["bytes_exact"] = exact
    settled = outer[1:] if n > 1 else outer
    steps = [_inner_steps_in(o, outer, plan["inner_steps"], run) for o in settled]
    wall = sum(o["seconds"] for o in settled)
    per_step = wall / sum(steps) if settled and sum(steps) else None
    tokens = (plan.get("batch") or 0) * (plan.get("seq") or 0)
    syncs = sorted(o["sync_s"] for o in settled)
    cmp["step_s"]["measured"] = per_step
    cmp["comm_s"]["measured"] = syncs[len(syncs) // 2] / plan["inner_steps"] if syncs else None
    cmp["tokens_per_s"]["measured"] = tokens / per_step if per_step else None
    cmp["outer"] = {
        "inner_steps": plan["inner_steps"],
        "sync_dtype": plan.get("sync_dtype"),
        "outer_steps": n,
        "sync_s": {
            "predicted": (plan.get("outer") or {}).get("sync_s"),
            "measured": syncs[len(syncs) // 2] if syncs else None,
        },
        "wait_s": {o["step"]: {r["name"]: r["wait_s"] for r in o.get("ranks") or []} for o in outer},
    }


def _inner_steps_in(o: dict, outer: list, h: int, run: dict) -> int:
    """Inner steps the outer step ending at o["step"] covered (the last may be short)."""
    i = outer.index(o)
    prev = outer[i - 1]["step"] if i > 0 else int((run.get("config") or {}).get("start_step") or 0) - 1
    return o["step"] - prev


def chosen_placement(plan: dict) -> dict | None:
    """The split the plan's placement section chose (what `run` would execute), as a placement document."""
    sec = plan.get("placement") or {}
    if not sec or "error" in sec:
        return None
    return {k: sec[k] for k in ("mode", "strategy", "order", "shares") if k in sec}


def low_comm_verdict(plans: list[dict], replan, target_comm: float = TARGET_COMM) -> dict | None:
    """When every synchronous strategy is slower than the best single host: the outer-step
    setting (H, sync dtype) that would beat that host, and by how much, or that none would.
    Each dtype at the smallest H keeping communication within min(target_comm, 1 - NEAR) of
    the step (a stricter --target-comm is kept), the fewest bytes per token among the near-fastest.
    `replan(strategy, outer) -> plan` plans an outer-step strategy with those settings."""
    from smoltrain import registry
    from smoltrain.planner.placement_plan import placed_tokens_per_s

    def info(p):
        return registry.REGISTRY.get(p["strategy"])

    sync = [p for p in plans if info(p) and info(p).trains and info(p).synchronous]
    lowcomm = [p for p in plans if info(p) and info(p).outer_steps]
    one = next((p["single_host"] for p in plans if p.get("single_host")), None)
    if not sync or not lowcomm or not one or not one.get("fits") or not one.get("tokens_per_s"):
        return None
    alone, host = one["tokens_per_s"], one["name"]
    best_sync = max(sync, key=placed_tokens_per_s)
    sync_ratio = placed_tokens_per_s(best_sync) / alone
    if sync_ratio >= 1.0:
        return None
    name = lowcomm[0]["strategy"]
    # a setting is "as fast" within 1 - NEAR of the fastest, so each dtype's H keeps communication
    # within that share of its step: within 5% of the pace with no communication at all
    target = min(target_comm, 1 - NEAR)
    rows = []
    for dtype in SYNC_BYTES:
        d = replan(name, {"sync_dtype": dtype, "target_comm": target})
        rows.append(
            {
                "sync_dtype": dtype,
                "inner_steps": d["inner_steps"],
                "tokens_per_s": d["tokens_per_s"] or 0.0,
                "bytes_per_token": d["bytes_per_token"],
                "vs_single_host": (d["tokens_per_s"] or 0.0) / alone,
            }
        )
    # at the same target every dtype runs about as fast: the fewest bytes let H shrink, and a
    # smaller H is a fresher average (less staleness), so among the near-fastest take the leanest
    fastest = max(r["tokens_per_s"] for r in rows)
    best = min((r for r in rows if r["tokens_per_s"] >= NEAR * fastest), key=lambda r: r["bytes_per_token"])
    head = f"Every synchronous strategy is slower than {host} alone (best: {best_sync['strategy']}, {sync_ratio:.2g}x)"
    note = "; int8 needs --backend socket" if best["sync_dtype"] == "int8" else ""
    if best["vs_single_host"] > 1.0:
        sentence = (
            f"{head}; {name} with H={best['inner_steps']} and {best['sync_dtype']} pseudo-gradients would run "
            f"{best['vs_single_host']:.2g}x {host} alone ({best['tokens_per_s']:,.1f} vs {alone:,.1f} tokens/s, "
            f"{human_bytes(best['bytes_per_token'])} per token{note})."
        )
    else:
        sentence = (
            f"{head}; no {name} setting would beat it either (best: H={best['inner_steps']}, "
            f"{best['sync_dtype']}, {best['vs_single_host']:.2g}x): the other hosts add too little compute."
        )
    return {
        "strategy": name,
        "single_host": host,
        "best_synchronous": best_sync["strategy"],
        "best": best,
        "settings": rows,
        "beats_single_host": best["vs_single_host"] > 1.0,
        "target_comm": target,
        "sentence": sentence,
    }
