"""Time per step: compute per rank (FLOPs or memory traffic, whichever is slower), and the
alpha-beta cost of each communication phase on the links it uses.

A phase costs, per round, the slowest of: each transfer (messages x alpha + bytes / goodput),
and each host NIC shared by several transfers (bytes out / its egress goodput, bytes in / its
ingress goodput); so the slowest link rules a ring and the server NIC rules a star.
Overlap: gradient buckets (1 MB in smoltrain's dp; DDP uses 25 MB) hide behind the backward
pass, except the last bucket. Pipelines: GPipe schedule, bubble (p-1)/(m+p-1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from smoltrain.planner.links import LinkModel
from smoltrain.planner.traffic import Phase, Traffic


@dataclass
class PhaseCost:
    seconds: float  # per step, all rounds
    alpha_s: float  # of which latency
    limiter: str  # "link a -> b", "a's uplink", "2 hops in series"
    limiter_kind: str = ""  # what the limiter names: link, nic or series


def transfer_seconds(t, names: list[str], lm: LinkModel) -> tuple[float, float]:
    """(latency, whole time) of one transfer on its link: messages x alpha + bytes / goodput."""
    ln = lm.get(names[t.src], names[t.dst])
    return t.msgs * ln.alpha_s, ln.seconds(t.nbytes, t.msgs)


def phase_cost(ph: Phase, names: list[str], lm: LinkModel) -> PhaseCost:
    best, best_alpha, limiter, kind = 0.0, 0.0, "", ""
    out_b: dict[int, float] = {}
    in_b: dict[int, float] = {}
    if ph.serial:  # hops one after another: the round costs their sum
        secs = [transfer_seconds(t, names, lm) for t in ph.transfers]
        return PhaseCost(
            sum(s for _, s in secs) * ph.repeat,
            sum(a for a, _ in secs) * ph.repeat,
            f"{len(secs)} hops in series",
            "series",
        )
    for t in ph.transfers:
        alpha, sec = transfer_seconds(t, names, lm)
        if sec > best:
            best, best_alpha, limiter, kind = sec, alpha, f"link {names[t.src]} -> {names[t.dst]}", "link"
        out_b[t.src] = out_b.get(t.src, 0.0) + t.nbytes
        in_b[t.dst] = in_b.get(t.dst, 0.0) + t.nbytes
    peers = list(names)
    for table, rate_of, word in ((out_b, lm.egress_bytes_per_s, "uplink"), (in_b, lm.ingress_bytes_per_s, "downlink")):
        for r, b in table.items():
            if sum(1 for t in ph.transfers if (t.src if word == "uplink" else t.dst) == r) < 2:
                continue
            rate = rate_of(names[r], peers)
            sec = (b / rate if rate else math.inf) + best_alpha
            if sec > best:
                best, limiter, kind = sec, f"{names[r]}'s {word}", "nic"
    return PhaseCost(best * ph.repeat, best_alpha * ph.repeat, limiter, kind)


@dataclass
class CommCost:
    total_s: float
    alpha_s: float
    overlappable_s: float
    last_bucket_s: float
    limiter: str
    limiter_s: float
    limiter_kind: str = ""  # PhaseCost.limiter_kind of the costliest phase


def comm_cost(tr: Traffic, names: list[str], lm: LinkModel, skip: set[int] = frozenset()) -> CommCost:
    total = alpha = ov = last = 0.0
    limiter, limiter_s, kind = "", -1.0, ""
    for i, ph in enumerate(tr.phases):
        if i in skip:
            continue
        c = phase_cost(ph, names, lm)
        total += c.seconds
        alpha += c.alpha_s
        if ph.overlap_backward:
            ov += c.seconds
            last = c.seconds / ph.buckets
        if c.seconds > limiter_s:
            limiter, limiter_s, kind = c.limiter, c.seconds, c.limiter_kind
    return CommCost(total, alpha, ov, last, limiter, limiter_s, kind)


def staggered_saving(tr: Traffic, names: list[str], lm: LinkModel, compute_s: list[float]) -> float:
    """Seconds an `after_compute` phase (a server's gather) hides on uneven hosts: each worker
    pushes when its own backward ends, so a fast host's push on a slow uplink overlaps the
    slowest host's compute. The phase then ends at the latest of (a worker's compute + its
    transfer) and (the first push + everything through the server's downlink), not at
    "slowest compute, then the whole phase". Equal compute hides nothing."""
    saved = 0.0
    slowest = max(compute_s)
    for ph in tr.phases:
        if not ph.after_compute or ph.repeat != 1 or not ph.transfers:
            continue
        full = phase_cost(ph, names, lm).seconds
        ends, alpha, worst = [], 0.0, -1.0
        for t in ph.transfers:
            a, sec = transfer_seconds(t, names, lm)
            if not math.isfinite(sec):  # a link is down
                return 0.0
            ends.append(compute_s[t.src] + sec)
            if sec > worst:
                worst, alpha = sec, a
        for dst in {t.dst for t in ph.transfers}:
            into = [t for t in ph.transfers if t.dst == dst]
            rate = lm.ingress_bytes_per_s(names[dst], list(names)) if len(into) > 1 else 0.0
            if rate:
                first = min(compute_s[t.src] for t in into)
                ends.append(first + sum(t.nbytes for t in into) / rate + alpha)
        saved += max(0.0, full - max(0.0, max(ends) - slowest))
    return saved


def exposed_overlap(comm_s: float, last_bucket_s: float, backward_s: float) -> float:
    """Buckets start when their gradients are ready; the last one is always exposed."""
    if comm_s <= 0:
        return 0.0
    return last_bucket_s + max(0.0, comm_s - last_bucket_s - backward_s)


def link_seconds(tr: Traffic, names: list[str], lm: LinkModel) -> dict[tuple[int, int], float]:
    """How long each directed link is busy per step: messages x alpha + bytes / goodput."""
    out: dict[tuple[int, int], float] = {}
    for ph in tr.phases:
        for t in ph.transfers:
            sec = ph.repeat * lm.get(names[t.src], names[t.dst]).seconds(t.nbytes, t.msgs)
            out[(t.src, t.dst)] = out.get((t.src, t.dst), 0.0) + sec
    return out


def pipeline(
    stage_s: list[float],
    hop_f: list[float],
    hop_b: list[float],
    m: int,
    train: bool,
    update_s: list[float] | None = None,
) -> tuple[float, float]:
    """GPipe step: returns (compute seconds on the critical path, communication seconds).

    Forward: the first microbatch crosses every stage and hop; the other m-1 follow one slot
    behind, a slot being the slowest stage or hop. Backward likewise with 2/3 of the compute.
    update_s: of each stage's compute, its optimizer update. A stage updates once its own last
    backward is done, while the stages before it still run theirs, so the updates are not in
    series: the step ends when the latest of them does (the first stage's at the least).
    Without it, each stage's whole compute is laid out as forward and backward.
    """
    if update_s is not None:
        work = [max(0.0, s - u) for s, u in zip(stage_s, update_s)]
        comp, comm = pipeline(work, hop_f, hop_b, m, train)
        return comp + (update_tail(work, update_s, hop_b, m) if train else 0.0), comm
    if train:
        tf = [s / 3 / m for s in stage_s]
        tb = [2 * s / 3 / m for s in stage_s]
    else:
        tf, tb = [s / m for s in stage_s], []
    comp = sum(tf) + (m - 1) * max(tf)
    total = sum(tf) + sum(hop_f) + (m - 1) * max(tf + hop_f)
    if train:
        comp += sum(tb) + (m - 1) * max(tb)
        total += sum(tb) + sum(hop_b) + (m - 1) * max(tb + hop_b)
    return comp, total - comp


def critical_path(stage_s: list[float], update_s: list[float], m: int) -> float:
    """A training chain's compute critical path: its stages' compute on the GPipe schedule with
    free hops, each stage's update after its own last backward. The run reads a stage's
    communication as the step beyond it (run/timings.py), and the plan predicts it so (steps.py)."""
    free = [0.0] * (len(stage_s) - 1)
    return pipeline(stage_s, free, free, m, True, update_s)[0]


def update_tail(work_s: list[float], update_s: list[float], hop_b: list[float], m: int) -> float:
    """Seconds the stages' updates add after the first stage's last backward: stage r's last
    backward ends earlier by the backward of the last microbatch through the stages (and hops)
    before it, and its update runs from there."""
    tail, lead = 0.0, 0.0
    for r, u in enumerate(update_s):
        tail = max(tail, u - lead)
        lead += 2 * work_s[r] / 3 / m + (hop_b[r] if r < len(hop_b) else 0.0)
    return tail
