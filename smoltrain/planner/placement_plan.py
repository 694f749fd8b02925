"""Placement by the plan's own numbers: the search for a split and a rank order, and the plan's
`placement` section (the chosen split, why, its predicted step next to the other mode's).

Every candidate piece of work (a batch share, a layer cut, a slice of heads) is costed by
rank_time, the plan's compute model, in the dtype that runs, and every hop on the links the
plan uses (CPU-adjusted, compute.cpu_links). Candidates are then judged by the whole plan
(plan.make_plan): the split and order whose plan predicts the shortest step win, so what
placement chose and what the plan reports are one number. `even` keeps the given order
(unless it crosses a down link) and splits as evenly as the shapes allow; `auto` splits by
speed within each host's memory and searches the order:

- batch (dp, fsdp, syncps, edp): whole sequences per rank, greedy on the rank's compute
  for c sequences (optimal for a minimax of increasing costs), at least one each;
- layers (mp, pp): contiguous layer counts by dynamic programming over the rank order,
  minimising the slowest stage (a pipeline) or the sum of stages (mp, and any decode: one
  stage runs at a time), a stage being its compute plus its boundary hops;
- heads (tp): whole KV groups by speed, at least one per rank; the MLP columns follow.
A host without memory for the least piece gets none (`excluded` says why); a model that
fits nowhere is refused (PlacementError) before anything starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property

from smolnet.errors import UsageError
from smoltrain import registry
from smoltrain.models.spec import ModelSpec
from smoltrain.planner import capacity, rank_time
from smoltrain.planner.bottleneck import human_bytes, human_s
from smoltrain.planner.placement import (
    MODES,
    Placement,
    PlacementError,
    avoid_down,
    candidate_orders,
    counts_from_shares,
    even_counts,
    greedy_counts,
    ranges,
    slowest_edge,
)
from smoltrain.planner.traffic import dtype_bytes


def applies(strategy: str, task: str = "train") -> bool:
    """Strategies whose work placement splits: in training by batch, layers or heads; in
    decode the layers (a pipeline's stages) and heads (tp's ring order)."""
    splits = registry.get(strategy).splits
    return splits in (("batch", "layers", "heads") if task == "train" else ("layers", "heads"))


def default_mode(mode: str | None, measured: bool) -> str:
    return mode or ("auto" if measured else "even")


@dataclass
class Ask:
    """One placement question: this strategy and shape over these ranks and links."""

    strategy: str
    mode: str  # even or auto
    model: ModelSpec
    ranks: list  # planner.ranks.Rank, in the given order
    lm: object  # the links (planner.links.LinkModel)
    task: str = "train"  # train or infer
    dtype: str = "fp32"
    batch: int = 8
    seq: int = 64
    microbatches: int = 1
    overlap: bool = True
    widths: dict | None = None  # compute_dtype, quantize, wire_dtype (planner.widths), as the plan's
    lanes: int = 1  # decode steps in flight through a pp chain (serve keeps one per stage)

    @property
    def info(self):
        return registry.get(self.strategy)

    @property
    def train(self) -> bool:
        return self.task == "train"

    @property
    def passes(self) -> int:
        return self.microbatches if self.info.microbatched and self.train else 1

    @cached_property
    def shape(self) -> rank_time.Shape:
        w = self.widths or {}
        batch = self.batch if self.train else 1
        return rank_time.Shape(
            self.strategy,
            self.task,
            self.model,
            self.dtype,
            batch,
            self.seq,
            self.passes,
            w.get("compute_dtype"),
            w.get("quantize"),
            w.get("tuning"),
        )

    @cached_property
    def cpu(self):
        from smoltrain.planner.compute import cpu_links

        return cpu_links(self.lm, self.ranks)

    def link_s(self, a: str, b: str, nbytes: float) -> float:
        return self.cpu.get(a, b).seconds(nbytes)

    def orders(self, names: list[str], topology: str, nbytes: float) -> list[list[str]]:
        if self.mode == "even" or len(names) < 2:
            return [avoid_down(names, topology, self.link_s)]
        got = candidate_orders(names, topology, self.link_s, nbytes)
        return got + ([names] if names not in got else [])

    def plan(self, placement: dict) -> dict:
        from smoltrain.planner.plan import make_plan

        return make_plan(
            self.strategy,
            self.model,
            len(placement["order"]),
            self.dtype,
            self.batch,
            self.seq,
            self.microbatches,
            self.task,
            self.ranks,
            self.lm,
            self.overlap,
            single=False,
            placement=placement,
            **(self.widths or {}),
        )

    def best(self, candidates: list[dict], excluded: list[dict], describe) -> Placement:
        """The candidate whose whole plan predicts the shortest step, or with lanes the shortest
        round (ties: the first)."""
        scored = []
        for i, c in enumerate(candidates):
            p = self.plan(c)
            ok = all(r["fits"] for r in p["ranks"])
            step = p["step_s"] if self.train else lane_round(p, self.lanes)
            step = float(f"{step:.9g}") if step is not None else math.inf  # near-ties: the first
            scored.append(((not ok, step, i), c, p))
        (unfit, _, _), c, p = min(scored, key=lambda t: t[0])
        if unfit:
            raise PlacementError(f"{self.strategy}: {self.model.name} does not fit: {p['bottleneck_where']}")
        why = [describe(r, c, i) for i, r in enumerate(p["ranks"])]
        nbytes = sum(ln["bytes_per_step"] for ln in p["links"]) / max(1, len(p["links"]))
        topology = self.info.topology if self.train or self.info.splits != "layers" else "ring"
        return Placement(
            self.mode,
            self.strategy,
            list(c["order"]),
            shares=c.get("shares"),
            layers=c.get("layers"),
            heads=c.get("heads"),
            ffn=c.get("ffn"),
            excluded=excluded + list(c.get("idle") or []),
            why=why + _order_words(c["order"], topology, self.link_s, nbytes),
        )

    def fits(self, rk, w: capacity.RankWork) -> bool:
        return rank_time.fits(rk, rank_time.memory(w, self.shape))

    def need(self, w: capacity.RankWork) -> float:
        return rank_time.memory(w, self.shape).total

    def seconds(self, rk, w: capacity.RankWork) -> float:
        return rank_time.seconds(rk, w, self.shape).compute_s


def place(
    strategy: str,
    mode: str,
    model: ModelSpec,
    ranks: list,
    lm=None,
    *,
    task: str = "train",
    dtype: str = "fp32",
    batch: int = 8,
    seq: int = 64,
    microbatches: int = 1,
    overlap: bool = True,
) -> Placement:
    """The placement of `strategy` over these ranks (planner.ranks.Rank, in the given order)."""
    from smoltrain.planner.links import from_class

    return search(
        Ask(
            strategy, mode, model, list(ranks), lm or from_class("1gbe"), task, dtype, batch, seq, microbatches, overlap
        )
    )


def search(a: Ask) -> Placement:
    if a.mode not in MODES:
        raise UsageError(f"--placement {a.mode!r}: choose even or auto")
    if not a.ranks:
        raise PlacementError("no hosts to place the work on")
    if not applies(a.strategy, a.task):
        raise PlacementError(f"{a.strategy}: placement covers strategies that split the batch, layers or heads")
    return SEARCH[a.info.splits](a)


def _kept(a: Ask, least, what: str) -> tuple[list, list[dict]]:
    """The ranks with memory for the least piece of work, and why the others get none."""
    excluded = [
        {
            "name": rk.name,
            "why": f"needs {human_bytes(a.need(least))} for {what}, has {human_bytes(rank_time.available(rk))}",
        }
        for rk in a.ranks
        if not a.fits(rk, least)
    ]
    out = {e["name"] for e in excluded}
    kept = [rk for rk in a.ranks if rk.name not in out]
    if not kept:
        raise PlacementError(f"{a.strategy}: no host has memory for {what} of {a.model.name} ({excluded[0]['why']})")
    return kept, excluded


def _cap(a: Ask, rk, piece, top: int) -> int:
    """The most units (sequences, KV groups) whose piece fits on this rank."""
    n = 0
    while n < top and a.fits(rk, piece(n + 1)):
        n += 1
    return n


def _split(a: Ask, kept: list, piece, total: int, what: str, least: int = 1) -> list[list[int]]:
    """Candidate counts per kept rank: the even split (when it fits) and, for auto, the
    greedy split by the ranks' compute for each count (at least `least` each)."""
    hi = [_cap(a, rk, piece, total) for rk in kept]
    out = []
    even = even_counts(total, len(kept))
    if all(c <= h for c, h in zip(even, hi)):
        out.append(even)
    elif a.mode == "even":
        raise PlacementError(
            f"{a.strategy}: an even split of {total} {what} does not fit in memory (at most {hi} per rank); "
            "try --placement auto"
        )
    if a.mode == "auto":
        got = greedy_counts(total, lambda i, c: a.seconds(kept[i], piece(c)), [least] * len(kept), hi)
        if got is None:
            raise PlacementError(f"{a.strategy}: {total} {what} do not fit in the hosts' memory (at most {sum(hi)})")
        out.insert(0, got)
    return out


def _batch(a: Ask) -> Placement:
    worker = capacity.layout(a.strategy, "train", a.model, len(a.ranks), a.batch, a.seq)[-1]

    def piece(c: int) -> capacity.RankWork:
        return replace(worker, tokens=c * a.seq)

    kept, excluded = _kept(a, piece(1), "the model and one sequence")
    if a.batch < len(kept):
        raise PlacementError(f"{a.strategy}: --batch {a.batch} is smaller than the {len(kept)} ranks sharing it")
    names = [rk.name for rk in kept]
    # replicas that sync only every H steps (diloco) may leave a host out: one whose single
    # sequence takes longer than the others' whole step would only make them wait at the sync
    least = 0 if a.info.outer_steps else 1
    cands = []
    for counts in _split(a, kept, piece, a.batch, "sequences", least):
        by = {n: c for n, c in zip(names, counts) if c}
        idle = [_idle(a, rk, piece, by) for rk, c in zip(kept, counts) if not c]
        for order in a.orders(list(by), a.info.topology, 4 * a.model.params() / len(by)):
            shares = [by[n] / a.batch for n in order]
            cands.append({"mode": a.mode, "strategy": a.strategy, "order": order, "shares": shares, "idle": idle})

    def describe(r, c, i):
        n, t = counts_from_shares(a.batch, c["shares"])[i], human_s(r["compute_s"])
        if "sequences_per_step" in r:  # paced over the outer step (planner.pace_plan): what runs
            k = r["sequences_per_step"]
            return f"{r['name']}: {n} of {a.batch} sequences, paced to {k:.2f} a step ({t} of compute)"
        return f"{r['name']}: {n} of {a.batch} sequences ({t} of compute)"

    return a.best(cands, excluded, describe)


def _idle(a: Ask, rk, piece, counts: dict) -> dict:
    """Why a replica of an outer-step strategy gets no sequence."""
    by = {r.name: r for r in a.ranks}
    step = max(a.seconds(by[n], piece(c)) for n, c in counts.items())
    one = a.seconds(rk, piece(1))
    return {
        "name": rk.name,
        "why": f"one sequence takes it {one * 1e3:.0f} ms, the others' whole step {step * 1e3:.0f} ms",
    }


def _cut(a: Ask, order: list, stage, hop_bytes: float) -> list[int] | None:
    """Best contiguous layer counts for this order (dynamic programming), or None when they
    cannot fit: the slowest stage (a training pipeline, or decode with several lanes in
    flight) or the sum of stages (mp, batch-1 decode)."""
    N, L = len(order), a.model.layers
    by = {rk.name: rk for rk in a.ranks}
    pipelined = (a.info.microbatched and a.train) or a.lanes > 1
    best = {0: (0.0, [])}
    for r, name in enumerate(order):
        rk = by[name]
        hop = sum(a.link_s(name, order[j], hop_bytes) for j in (r - 1, r + 1) if 0 <= j < N)
        nxt = {}
        for k, (obj, counts) in best.items():
            for n in range(1, L - k - (N - r - 1) + 1):
                w = stage(r, n, N)
                if not a.fits(rk, w):
                    break
                if r == N - 1 and k + n != L:
                    continue
                t = a.seconds(rk, w) + hop
                o = max(obj, t) if pipelined else obj + t
                if k + n not in nxt or o < nxt[k + n][0]:
                    nxt[k + n] = (o, counts + [n])
        best = nxt
    got = best.get(L)
    return got[1] if got else None


def _layers(a: Ask) -> Placement:
    L = a.model.layers

    def stage(r: int, n: int, N: int) -> capacity.RankWork:
        return capacity.stage_work(a.model, r, N, n, a.task, a.batch, a.seq, a.microbatches, a.info.microbatched)

    kept, excluded = _kept(a, stage(1, 1, 3), "one layer")
    if len(kept) > L:
        raise PlacementError(f"{a.strategy}: {a.model.name} has {L} layers, fewer than {len(kept)} ranks")
    names = [rk.name for rk in kept]
    by = {rk.name: rk for rk in kept}
    tokens = a.batch * a.seq if a.train else 1
    hop_bytes = tokens * a.model.hidden * dtype_bytes(a.dtype)
    even = even_counts(L, len(kept))
    cands = []
    # decode closes the chain: the last stage sends the sampled token back to the first
    for order in a.orders(names, "chain" if a.train else "ring", hop_bytes):
        even_fits = all(a.fits(by[n], stage(r, c, len(order))) for r, (n, c) in enumerate(zip(order, even)))
        if a.mode == "even" and not even_fits:
            r, n = next((r, n) for r, n in enumerate(order) if not a.fits(by[n], stage(r, even[r], len(order))))
            raise PlacementError(
                f"{a.strategy}: an even cut gives {n} {even[r]} layer(s) needing "
                f"{human_bytes(a.need(stage(r, even[r], len(order))))}, it has "
                f"{human_bytes(rank_time.available(by[n]))}; try --placement auto"
            )
        cuts = ([even] if even_fits else []) + ([_cut(a, order, stage, hop_bytes)] if a.mode == "auto" else [])
        for counts in cuts:
            if counts is not None:
                cands.append({"mode": a.mode, "strategy": a.strategy, "order": order, "layers": ranges(counts)})
    if not cands:
        total = a.need(stage(0, L, 1))
        raise PlacementError(
            f"{a.strategy}: {a.model.name} ({human_bytes(total)} at batch {a.batch}) does not fit in the memory "
            f"of {', '.join(names)}"
        )

    def describe(r, c, i):
        lo, hi = c["layers"][i]
        return f"{r['name']}: layers {lo}..{hi - 1} ({hi - lo} of {L}; {human_s(r['compute_s'])} of compute)"

    return a.best(cands, excluded, describe)


def _heads(a: Ask) -> Placement:
    G, gsize = a.model.kv_heads, a.model.heads // a.model.kv_heads

    def piece(g: int) -> capacity.RankWork:
        return capacity.heads_work(a.model, g / G, g / G, a.task, a.batch, a.seq)

    kept, excluded = _kept(a, piece(1), f"{gsize} head(s) of every layer")
    if len(kept) > G:
        raise PlacementError(
            f"{a.strategy}: {a.model.name} has {a.model.heads} heads in {G} KV groups, fewer than {len(kept)} ranks"
        )
    names = [rk.name for rk in kept]
    tokens = a.batch * a.seq if a.train else 1
    cands = []
    # decode splits the heads evenly (the infer ranks' check_tp); auto still searches the ring order
    for groups in _split(a if a.train else replace(a, mode="even"), kept, piece, G, "head groups"):
        by = dict(zip(names, groups))
        for order in a.orders(names, "ring", tokens * a.model.hidden * dtype_bytes(a.dtype) / len(kept)):
            heads = [by[n] * gsize for n in order]
            ffn = counts_from_shares(a.model.ffn, heads)
            cands.append(
                {"mode": a.mode, "strategy": a.strategy, "order": order, "heads": ranges(heads), "ffn": ranges(ffn)}
            )

    def describe(r, c, i):
        (lo, hi), (f0, f1) = c["heads"][i], c["ffn"][i]
        return f"{r['name']}: heads {lo}..{hi - 1} and {f1 - f0} MLP columns ({human_s(r['compute_s'])} of compute)"

    return a.best(cands, excluded, describe)


SEARCH = {"batch": _batch, "layers": _layers, "heads": _heads}  # by the registry's `splits`


def _order_words(order, topology, link_s, nbytes) -> list[str]:
    e = slowest_edge(order, topology, link_s, nbytes)
    if e is None or len(order) < 2:
        return []
    return [
        f"rank order {' -> '.join(order)} ({topology}); its slowest hop {e[0]} -> {e[1]} "
        f"takes {e[2] * 1e3:.2f} ms per {nbytes / 1e6:.2f} MB"
    ]


# --- the plan's `placement` section ---
# compute_s: a paced run's own paces (planner.pacing), so `plan --compare` predicts the split it ran
KEEP = ("mode", "strategy", "order", "shares", "layers", "heads", "ffn", "compute_s")


def lane_round(plan: dict, lanes: int) -> float | None:
    """Seconds between one lane's decode steps when `lanes` steps are in flight through a
    chain: a step's trip through every stage and hop (the infer plan's step), or, when the
    lanes keep every stage busy, `lanes` times the slowest stage's work."""
    return None if plan["step_s"] is None else max(plan["step_s"], lanes * max(plan["compute_s_per_rank"]))


def predicted_of(plan: dict) -> dict:
    """What the placement section shows of a plan made under one placement."""
    return {
        "step_s": plan["step_s"],
        "tokens_per_s": plan["tokens_per_s"],
        "compute_s_per_rank": plan["compute_s_per_rank"],
        "comm_s": plan["comm_s_per_step"],
    }


def section(a: Ask, chosen: Placement, plan: dict) -> dict:
    """The plan's `placement`: the chosen split, why, and its predicted step (this very plan)
    next to the other mode's; each host's speed alone (the single-host verdict's figure)."""
    from smoltrain.planner import verdict

    out = chosen.to_dict()
    kinds = {"measured" if rk.measured else "nominal" for rk in a.ranks}
    out["speed_source"] = kinds.pop() if len(kinds) == 1 else "mixed"
    w = a.widths or {}
    kw = dict(dtype=a.dtype, batch=a.shape.batch, seq=a.seq, mode=a.task)
    kw.update(compute_dtype=w.get("compute_dtype"), quantize=w.get("quantize"), tuning=w.get("tuning"))
    out["speeds"] = [
        {
            "name": rk.name,
            "tokens_per_s": verdict.alone(rk, a.model, **kw)["tokens_per_s"],
            "memory_bytes": rk.memory_bytes,
            "source": "measured" if rk.measured else "nominal",
        }
        for rk in a.ranks
    ]
    pred = {chosen.mode: predicted_of(plan)}
    other = "even" if chosen.mode == "auto" else "auto"
    try:
        pred[other] = predicted_of(a.plan(place_dict(search(replace(a, mode=other)))))
    except PlacementError as e:
        pred[other] = {"error": str(e)}
    out["predicted"] = pred
    ev, au = pred.get("even", {}).get("step_s"), pred.get("auto", {}).get("step_s")
    out["speedup"] = ev / au if ev and au and math.isfinite(ev) and math.isfinite(au) else None
    return out


def place_dict(p: Placement | dict) -> dict:
    """The part of a placement the plan and the run execute."""
    d = p.to_dict() if isinstance(p, Placement) else p
    return {k: d[k] for k in KEEP if k in d}


def placed_tokens_per_s(plan: dict) -> float:
    """The plan's tokens/s under the better of its placements (even or auto, as its section
    predicted them); the plan's own figure where it has no section."""
    pred = (plan.get("placement") or {}).get("predicted") or {}
    best = [p.get("tokens_per_s") for p in pred.values() if p.get("tokens_per_s")]
    return max(best + [plan.get("tokens_per_s") or 0.0])
