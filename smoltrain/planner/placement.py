"""Placement: who gets how much of the work, shared by `plan` and `run`.

One document decides it, and the run executes exactly that document:
  {mode, strategy, order (host names by rank), shares (per rank, sum 1) | layers (per rank
   [first, last+1]) | heads + ffn (tp: per rank [first, last+1]), excluded, why}

- batch strategies (dp, fsdp, syncps, edp): whole sequences per rank, as many as keep the
  slowest rank's time lowest (greedy on `fixed + n * seq * s_per_token`, which is optimal for
  a minimax of increasing costs); each rank holds the model and at least one sequence.
- layer strategies (mp, pp): contiguous layer counts by dynamic programming over the rank
  order, minimising the slowest stage (pp) or the sum of stages (mp: one stage runs at a
  time), a stage being its compute plus its boundary transfers, within its memory.
- tp: whole KV groups (so grouped-query attention stays intact) by speed, at least one per
  rank; the MLP columns follow the same proportions.
`even` splits as evenly as the shapes allow (6 layers over 4 stages: 2,2,1,1) in the given
order; `auto` splits by speed and searches the rank order (placement_search). A host with no
memory for the least piece of work gets none, and `excluded` says why; a model that does not
fit at all is refused (PlacementError) before anything starts.

Torch-free: speeds come in as `HostSpeed`s (planner.speeds), links as a function
`link_s(src, dst, nbytes) -> seconds` (None: free, as on one machine).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from smolnet.errors import UsageError
from smoltrain import registry
from smoltrain.models.spec import ModelSpec

MODES = ("even", "auto")
TRAIN_BYTES_PER_PARAM = 16  # fp32 weight, gradient and two AdamW moments
HEADROOM = 0.9  # as planner.capacity: 10% stays for the OS


class PlacementError(UsageError):
    """The model cannot be placed on these hosts."""


@dataclass
class Placement:
    mode: str
    strategy: str
    order: list[str]
    shares: list[float] | None = None
    layers: list[list[int]] | None = None
    heads: list[list[int]] | None = None
    ffn: list[list[int]] | None = None
    excluded: list[dict] = field(default_factory=list)  # [{name, why}]
    why: list[str] = field(default_factory=list)

    @property
    def world(self) -> int:
        return len(self.order)

    def to_dict(self) -> dict:
        d = {"mode": self.mode, "strategy": self.strategy, "order": list(self.order)}
        for k in ("shares", "layers", "heads", "ffn"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        d["excluded"], d["why"] = list(self.excluded), list(self.why)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Placement:
        if not isinstance(d, dict) or not isinstance(d.get("order"), list) or not d["order"]:
            raise PlacementError("placement: expected an object with a non-empty `order`")
        p = cls(
            str(d.get("mode", "even")),
            str(d.get("strategy", "")),
            [str(x) for x in d["order"]],
            d.get("shares"),
            d.get("layers"),
            d.get("heads"),
            d.get("ffn"),
            list(d.get("excluded") or []),
            list(d.get("why") or []),
        )
        for k in ("shares", "layers", "heads", "ffn"):
            v = getattr(p, k)
            if v is not None and (not isinstance(v, list) or len(v) != p.world):
                raise PlacementError(f"placement: {k} must have one entry per rank ({p.world})")
        return p


# --- integer splits ---
def even_counts(n: int, k: int) -> list[int]:
    """n items over k ranks as evenly as possible, the extra ones first: 6 over 4 -> 2,2,1,1."""
    base, extra = divmod(n, k)
    return [base + (1 if i < extra else 0) for i in range(k)]


def greedy_counts(n: int, cost, lo: list[int], hi: list[int]) -> list[int] | None:
    """Counts summing to n, lo <= c <= hi, minimising max_i cost(i, c_i) for costs increasing
    in c: give each next item to the rank that would finish it soonest (ties: lower rank)."""
    c = list(lo)
    if sum(c) > n or sum(hi) < n or any(a > b for a, b in zip(lo, hi)):
        return None
    for _ in range(n - sum(c)):
        i = min((j for j in range(len(c)) if c[j] < hi[j]), key=lambda j: (cost(j, c[j] + 1), j))
        c[i] += 1
    return c


def counts_from_shares(total: int, shares: list[float]) -> list[int]:
    """Whole items per rank from fractional shares (largest remainder): exact when the shares
    came from counts (count / total), so the run gets the plan's counts back."""
    if not shares or any(not isinstance(s, (int, float)) or s <= 0 for s in shares):
        raise PlacementError("placement shares must all be positive numbers")
    tot = float(sum(shares))
    ideal = [total * s / tot for s in shares]
    counts = [int(math.floor(x + 1e-9)) for x in ideal]
    for i in sorted(range(len(ideal)), key=lambda j: (counts[j] - ideal[j], j))[: total - sum(counts)]:
        counts[i] += 1
    return counts


def ranges(counts: list[int]) -> list[list[int]]:
    out, lo = [], 0
    for c in counts:
        out.append([lo, lo + c])
        lo += c
    return out


def split_batch(batch: int, shares: list[float]) -> list[tuple[int, int]]:
    """Cut B sequences into contiguous [lo, hi) ranges proportional to `shares`
    (largest remainder; every rank gets at least one sequence)."""
    n = len(shares)
    if batch < n:
        raise UsageError(f"--batch {batch} is smaller than the {n} ranks sharing it")
    if any(s <= 0 for s in shares):
        raise UsageError("--shares must all be positive")
    total = sum(shares)
    ideal = [batch * s / total for s in shares]
    counts = [max(1, int(x)) for x in ideal]
    while sum(counts) > batch:
        i = max(range(n), key=lambda j: counts[j] - ideal[j] if counts[j] > 1 else -1e9)
        counts[i] -= 1
    while sum(counts) < batch:
        i = max(range(n), key=lambda j: ideal[j] - counts[j])
        counts[i] += 1
    out, lo = [], 0
    for c in counts:
        out.append((lo, lo + c))
        lo += c
    return out


def batch_ranges(batch: int, shares: list[float] | None, world: int) -> list[tuple[int, int]]:
    """[lo, hi) sequences of the global batch per rank: by the placement's shares, else even."""
    counts = counts_from_shares(batch, list(shares)) if shares else even_counts(batch, world)
    if len(counts) != world:
        raise PlacementError(f"placement has {len(counts)} shares for {world} ranks")
    if min(counts) < 1:
        raise PlacementError(f"--batch {batch} leaves a rank without a sequence")
    return [tuple(r) for r in ranges(counts)]


# --- memory, per rank (bytes), for training in fp32 ---
def act_bytes_per_layer(model: ModelSpec, tokens: float, seq: int) -> float:
    """Activations one layer keeps for backward (fp32: twice Korthikanti's 16-bit figure)."""
    return tokens * model.hidden * 2 * (34 + 5 * model.heads * seq / model.hidden)


def _embed_params(model: ModelSpec) -> int:
    return model.vocab * model.hidden + (model.ctx * model.hidden if model.learned_pos else 0)


def _head_params(model: ModelSpec) -> int:
    return model.vocab * model.hidden + 2 * model.hidden


def stage_bytes(model: ModelSpec, n: int, first: bool, last: bool, tokens: float, seq: int) -> float:
    params = n * model.layer_params() + (_embed_params(model) if first else 0) + (_head_params(model) if last else 0)
    logits = tokens * model.vocab * 4 * 2 if last else 0
    return params * TRAIN_BYTES_PER_PARAM + n * act_bytes_per_layer(model, tokens, seq) + logits


def usable(speed) -> float:
    return speed.memory_bytes * HEADROOM


def human_bytes(n: float) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= k:
            return f"{n / k:.3g} {unit}"
    return f"{n:.0f} B"


def place(
    strategy: str,
    mode: str,
    model: ModelSpec,
    names: list[str],
    speeds: dict,
    batch: int,
    seq: int,
    microbatches: int = 1,
    link_s=None,
) -> Placement:
    """The placement of `strategy` over hosts `names` (in their given order for `even`)."""
    if mode not in MODES:
        raise UsageError(f"--placement {mode!r}: choose even or auto")
    splits = registry.get(strategy).splits
    if not names:
        raise PlacementError("no hosts to place the work on")
    from smoltrain.planner import placement_split as split

    if splits == "batch":
        return split.place_batch(strategy, mode, model, names, speeds, batch, seq, link_s)
    if splits == "layers":
        return split.place_layers(strategy, mode, model, names, speeds, batch, seq, microbatches, link_s)
    if splits == "heads":
        return split.place_heads(strategy, mode, model, names, speeds, batch, seq, link_s)
    raise PlacementError(f"{strategy}: placement covers strategies that split the batch, layers or heads")


def named_batch_ranges(batch: int, names: list[str], placement: dict | None) -> dict[str, tuple[int, int]]:
    """The parameter server's split over the members present, by name: the placement's counts
    when every placed host is there; otherwise (a leave or a join) the same speeds renormalised,
    a newcomer weighted as the average member, at least one sequence each."""
    by = dict(zip((placement or {}).get("order") or [], (placement or {}).get("shares") or []))
    if not by:
        weights = [1.0] * len(names)
    else:
        mean = sum(by.values()) / len(by)
        weights = [float(by.get(n, mean)) for n in names]
    counts = counts_from_shares(batch, weights) if batch >= len(names) else []
    if set(names) == set(by) and counts and min(counts) >= 1:
        return dict(zip(names, (tuple(r) for r in ranges(counts))))
    return dict(zip(names, split_batch(batch, weights)))


def validate(doc: dict, strategy: str, model: ModelSpec, batch: int, world: int) -> Placement:
    """Refuse a placement the run cannot execute (a hand-edited file, another model), before
    anything starts."""
    p = Placement.from_dict(doc)
    if len(set(p.order)) != p.world or p.world != world:
        raise PlacementError(f"placement: order {p.order} must name each of the {world} ranks once")
    splits = registry.get(strategy).splits

    def covers(cuts, total, what, step=1):
        if (
            not cuts
            or cuts[0][0] != 0
            or cuts[-1][1] != total
            or any(
                not (isinstance(a, int) and isinstance(b, int)) or b <= a or (a % step) or (b % step) for a, b in cuts
            )
            or any(cuts[i][1] != cuts[i + 1][0] for i in range(len(cuts) - 1))
        ):
            raise PlacementError(
                f"placement: {what} {cuts} must cut 0..{total} into non-empty consecutive "
                f"ranges" + (f" of whole groups of {step}" if step > 1 else "")
            )

    if splits == "batch" and p.shares is not None:
        if min(counts_from_shares(batch, p.shares)) < 1:
            raise PlacementError(f"placement: shares {p.shares} leave a rank without a sequence of --batch {batch}")
    elif splits == "layers" and p.layers is not None:
        covers(p.layers, model.layers, "layers")
    elif splits == "heads" and p.heads is not None:
        covers(p.heads, model.heads, "heads", model.heads // model.kv_heads)
        if p.ffn is not None:
            covers(p.ffn, model.ffn, "ffn")
    elif p.shares is p.layers is p.heads is None:
        pass
    else:
        raise PlacementError(
            f"placement: a {strategy} placement must give its "
            f"{ {'batch': 'shares', 'layers': 'layers', 'heads': 'heads'}.get(splits, splits) }"
        )
    return p
