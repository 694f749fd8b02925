"""Placement by the plan's own numbers: the question (Ask), the search for a split and a rank
order (each kind of split in placement_search.py), and the plan's `placement` section (the
chosen split, why, its predicted step next to the other mode's).

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
from smoltrain.planner.placement import (
    MODES,
    Placement,
    PlacementError,
    avoid_down,
    candidate_orders,
    slowest_edge,
)
from smoltrain.planner.placement_search import SEARCH


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
