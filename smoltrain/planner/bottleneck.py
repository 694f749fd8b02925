"""What limits a plan, as a record (capacity, a down link, bandwidth, latency, an outer step
or compute), and the words it is shown in; plus the human units the planner writes numbers in.

Why a record: the verdict, the diloco phase and the renderers ask *what* the limit is (which
rank, which link, how many seconds); they read these fields, and only `words` (the plan's
`bottleneck_where`) and `head` (its first clause, for the verdict's sentence) turn it into prose.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

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


CAUSES = ("memory", "down", "latency", "bandwidth", "nic", "outer", "stages", "rank")


@dataclass(frozen=True)
class Bottleneck:
    """The plan's limit. `kind` is the doc's `bottleneck`; `cause` says which of its forms:
    memory (a rank does not fit), down (a link it needs), latency, bandwidth (the busiest link),
    nic (a host's uplink or downlink under a star), outer (an amortised outer step),
    stages (the slowest pipeline stage), rank (the slowest rank)."""

    kind: str  # capacity | link | latency | compute | memory-bandwidth
    cause: str
    rank: int | None = None
    host: str | None = None
    device: str | None = None
    src: str | None = None  # the link's endpoints (down, latency, bandwidth)
    dst: str | None = None
    limiter: str | None = None  # timing's name for what limits the costliest phase (link, NIC)
    seconds: float | None = None  # per step: the rank's compute, the link's busy time, the sync per step
    share: float | None = None  # seconds over the step time
    compute_s: float | None = None  # the step's compute
    comm_s: float | None = None  # the step's communication
    nbytes: float | None = None  # per step on the link (bandwidth); per outer step (outer)
    needs: float | None = None  # memory (capacity)
    usable: float | None = None
    rate_mbit: float | None = None
    rtt_us: float | None = None
    messages: int | None = None  # per step on the link (latency)
    alpha_s: float | None = None  # of comm_s, latency (latency)
    work: str | None = None  # "FLOPs" or "memory traffic" (compute)
    per: str | None = None  # "step" or "token"
    stages: int | None = None
    bubble: float | None = None  # stages in training; None in decode
    every: int | None = None  # an amortised phase's steps per run (diloco's H)
    sync_dtype: str | None = None  # outer: the pseudo-gradient's dtype
    sync_s: float | None = None  # outer: one outer step's communication and update
    outer_bytes: float | None = None  # bytes per run of the amortised phase (busiest rank)
    with_outer_state: bool = False  # capacity: the memory includes the outer step's anchor and momentum
    axis: str | None = None  # a mesh plan's axis (mesh_plan) whose link is down or whose communication limits

    def to_dict(self) -> dict:
        """The doc's bottleneck_detail: the fields that apply (a down link's infinite time is left out)."""
        d = dataclasses.asdict(self)
        return {
            k: v
            for k, v in d.items()
            if v is not None and v is not False and not (isinstance(v, float) and not math.isfinite(v))
        }

    @classmethod
    def from_dict(cls, d: dict) -> Bottleneck:
        return cls(**d)


def clauses(b: Bottleneck) -> list[str]:
    """The record in words, clause by clause (joined by "; " it is the plan's bottleneck_where)."""
    if b.cause == "memory":
        where = f"rank {b.rank} ({b.host}, {b.device}) needs {human_bytes(b.needs)} of {human_bytes(b.usable)}"
        where += " usable memory"
        return [where + (", with the outer step's anchor and momentum" if b.with_outer_state else "")]
    if b.cause == "down":
        return [f"link {b.src} -> {b.dst} is down", "the plan cannot run over it"]
    if b.cause == "latency":
        return [
            f"{b.messages} messages per step wait {b.rtt_us:.0f} us round trips on {b.src} -> {b.dst}",
            f"latency is {human_s(b.alpha_s)} of {human_s(b.comm_s)} communication",
        ]
    if b.cause == "bandwidth":
        return [
            f"{b.limiter} ({b.rate_mbit or 0:.0f} Mbit/s) carries {human_bytes(b.nbytes)} per step, busy "
            f"{human_s(b.seconds)} against {human_s(b.compute_s)} of compute"
        ]
    if b.cause == "nic":
        per_step = f"{human_s(b.comm_s)} per step against {human_s(b.compute_s)} of compute"
        return [f"{b.limiter} carries the star's traffic, {per_step}"]
    if b.cause == "outer":
        return [
            f"{b.limiter}: one {human_bytes(b.outer_bytes)} {b.sync_dtype} all-reduce every {b.every} steps takes "
            f"{human_s(b.sync_s)}, {human_s(b.comm_s)} per step against {human_s(b.compute_s)} of compute"
        ]
    what = f"{b.work} per {b.per}"
    adds = f"communication adds {human_s(b.comm_s)}"
    if b.every is not None:  # an amortised outer step: its share per step, and how often it runs
        adds += f" per step ({human_bytes(b.outer_bytes)} every {b.every} steps)"
    if b.cause == "stages":
        how = (
            "decode runs the stages one after another"
            if b.bubble is None
            else f"pipeline bubble {b.bubble:.0%} of the step"
        )
        return [
            f"{b.stages} stages, slowest rank {b.rank} ({b.host}, {b.device}) with {human_s(b.seconds)} of {what}",
            how,
            adds,
        ]
    return [f"rank {b.rank} ({b.host}, {b.device}): {human_s(b.seconds)} of {what}", adds]


def words(b: Bottleneck) -> str:
    return "; ".join(clauses(b))


def head(b: Bottleneck) -> str:
    """The first clause: where the limit is, without the rest of the step."""
    return clauses(b)[0]


@dataclass
class Parts:
    """What `find` weighs: the step's parts and the traffic over its links."""

    tr: object  # the inner step's traffic (planner.traffic.Traffic)
    per_rank: list[dict]  # the plan's ranks entries (memory with every phase's state)
    names: list[str]
    lm: object  # the links as the ranks' CPUs see them
    link_b: dict  # per step on each directed link (every phase, amortised)
    link_s: dict
    link_m: dict
    compute_s: float
    comm_s: float
    cc: object  # the inner step's timing.CommCost
    down: list  # links with traffic that are down
    bubble: float = 0.0
    outer: object = None  # an amortised phase (planner.phases.Amortised), or None


def _share(seconds: float, s: Parts) -> float | None:
    total = s.compute_s + s.comm_s
    return seconds / total if total > 0 and total != float("inf") else None


def out_of_memory(per_rank: list[dict], with_outer_state: bool) -> Bottleneck | None:
    """The rank furthest over its memory, as the record (None when every rank fits)."""
    unfit = [p for p in per_rank if not p["fits"]]
    if not unfit:
        return None
    p = max(unfit, key=lambda p: p["memory"]["total"] / max(1, p["memory_available"]))
    return Bottleneck(
        "capacity",
        "memory",
        rank=p["rank"],
        host=p["name"],
        device=p["device"],
        needs=p["memory"]["total"],
        usable=p["memory_available"],
        with_outer_state=with_outer_state,
    )


def find(s: Parts) -> Bottleneck:
    """The plan's limit, as a record: memory first, then a down link, then communication when it
    takes longer than compute (latency, the busiest link, a star's NIC, an outer step), else the
    slowest rank (or stage)."""
    unfit = out_of_memory(s.per_rank, s.outer is not None)
    if unfit:
        return unfit
    names, lm, cc, out = s.names, s.lm, s.cc, s.outer
    if s.down:
        a, d = s.down[0]
        return Bottleneck("link", "down", src=names[a], dst=names[d])
    if s.comm_s > s.compute_s and out is not None:
        return Bottleneck(
            "link",
            "outer",
            limiter=out.cc.limiter,
            seconds=s.comm_s,
            share=_share(s.comm_s, s),
            compute_s=s.compute_s,
            comm_s=s.comm_s,
            every=out.every,
            sync_dtype=out.dtype,
            sync_s=out.sync_s,
            outer_bytes=out.busiest,
        )
    if s.comm_s > s.compute_s and s.link_b:
        (a, d), sec = max(s.link_s.items(), key=lambda kv: kv[1])
        ln = lm.get(names[a], names[d])
        if cc.alpha_s > (cc.total_s - cc.alpha_s):
            return Bottleneck(
                "latency",
                "latency",
                src=names[a],
                dst=names[d],
                seconds=cc.alpha_s,
                share=_share(cc.alpha_s, s),
                comm_s=s.comm_s,
                messages=s.link_m.get((a, d), 0),
                rtt_us=ln.rtt_us,
                alpha_s=cc.alpha_s,
            )
        common = dict(compute_s=s.compute_s, comm_s=s.comm_s)
        if cc.limiter_kind == "nic":
            return Bottleneck("link", "nic", limiter=cc.limiter, seconds=s.comm_s, share=_share(s.comm_s, s), **common)
        lim = cc.limiter if cc.limiter_kind == "link" else f"link {names[a]} -> {names[d]}"
        return Bottleneck(
            "link",
            "bandwidth",
            src=names[a],
            dst=names[d],
            limiter=lim,
            seconds=sec,
            share=_share(sec, s),
            nbytes=s.link_b[(a, d)],
            rate_mbit=ln.rate_mbit,
            **common,
        )
    p = max(s.per_rank, key=lambda p: p["compute_s"])
    tr = s.tr
    rec = dict(
        rank=p["rank"],
        host=p["name"],
        device=p["device"],
        seconds=p["compute_s"],
        share=_share(p["compute_s"], s),
        compute_s=s.compute_s,
        comm_s=s.comm_s,
        work="FLOPs" if p["bound"] == "compute" else "memory traffic",
        per="step" if tr.mode == "train" else "token",
    )
    if out is not None:
        rec.update(every=out.every, outer_bytes=out.busiest)
    if registry.get(tr.strategy).splits == "layers" and tr.world > 1:
        bubble = None if tr.mode == "infer" else s.bubble
        return Bottleneck(p["bound"], "stages", stages=tr.world, bubble=bubble, **rec)
    return Bottleneck(p["bound"], "rank", **rec)
