"""The plan's bottleneck in words (capacity, a down link, bandwidth, latency or compute),
and the human units the planner writes numbers in."""

from __future__ import annotations

from smoltrain import registry


def human_bytes(n: float) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= k:
            return f"{n / k:.3g} {unit}"
    return f"{n:.0f} B"


def human_s(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def bottleneck(tr, per_rank, names, lm, link_b, link_s, compute_s, comm_s, cc, down, bubble=0.0):
    unfit = [p for p in per_rank if not p["fits"]]
    if unfit:
        p = max(unfit, key=lambda p: p["memory"]["total"] / max(1, p["memory_available"]))
        return "capacity", (
            f"rank {p['rank']} ({p['name']}, {p['device']}) needs "
            f"{human_bytes(p['memory']['total'])} of {human_bytes(p['memory_available'])} "
            f"usable memory"
        )
    if down:
        s, d = down[0]
        return "link", f"link {names[s]} -> {names[d]} is down; the plan cannot run over it"
    if comm_s > compute_s and link_b:
        (s, d), sec = max(link_s.items(), key=lambda kv: kv[1])
        ln = lm.get(names[s], names[d])
        if cc.alpha_s > (cc.total_s - cc.alpha_s):
            msgs = tr.link_msgs().get((s, d), 0)
            return "latency", (
                f"{msgs} messages per step wait {ln.rtt_us:.0f} us round trips on "
                f"{names[s]} -> {names[d]}; "
                f"latency is {human_s(cc.alpha_s)} of {human_s(comm_s)} communication"
            )
        lim = cc.limiter if "link" in cc.limiter or "lin" in cc.limiter else f"link {names[s]} -> {names[d]}"
        if "link " in lim:
            return "link", (
                f"{lim} ({ln.rate_mbit or 0:.0f} Mbit/s) carries "
                f"{human_bytes(link_b[(s, d)])} per step, busy {human_s(sec)} against "
                f"{human_s(compute_s)} of compute"
            )
        return "link", (
            f"{lim} carries the star's traffic, {human_s(comm_s)} per step against {human_s(compute_s)} of compute"
        )
    p = max(per_rank, key=lambda p: p["compute_s"])
    what = "FLOPs" if p["bound"] == "compute" else "memory traffic"
    what += " per step" if tr.mode == "train" else " per token"
    if registry.get(tr.strategy).splits == "layers" and tr.world > 1:
        how = (
            "decode runs the stages one after another"
            if tr.mode == "infer"
            else f"pipeline bubble {bubble:.0%} of the step"
        )
        return p["bound"], (
            f"{tr.world} stages, slowest rank {p['rank']} ({p['name']}, {p['device']}) "
            f"with {human_s(p['compute_s'])} of {what}; {how}; "
            f"communication adds {human_s(comm_s)}"
        )
    return p["bound"], (
        f"rank {p['rank']} ({p['name']}, {p['device']}): {human_s(p['compute_s'])} of "
        f"{what}; communication adds {human_s(comm_s)}"
    )
