"""Placement, the document and its arithmetic: who gets how much of the work, in which rank order.

One document decides it, and the run executes exactly that document:
  {mode, strategy, order (host names by rank), shares (per rank, sum 1) | layers (per rank
   [first, last+1]) | heads + ffn (tp: per rank [first, last+1]), excluded, why}

Here: the document and its checks, the integer splits (even counts, a greedy minimax split,
shares back to counts) and the rank-order search. A strategy's transfers follow a topology
of rank numbers: a ring (rank r sends to r+1, the last back to 0), a chain (neighbours both
ways) or a star (rank 0 serves every other rank). An order costs (slowest edge, sum of
edges) for ring and chain; a star's hub serialises its edges, so it costs their sum. A down
link costs infinity, so an order that avoids it wins wherever one exists. Up to
EXHAUSTIVE_MAX hosts every order is scored; beyond, a greedy walk from each start host, then
2-opt swaps. The first order of the input wins ties, so equal links keep the inventory's.

Which split is best is the plan's to say: placement_plan.py searches with the plan's own
cost model (rank_time and make_plan). This module imports nothing of the planner's.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from smolnet.errors import UsageError
from smoltrain import registry
from smoltrain.models.spec import ModelSpec

MODES = ("even", "auto")
EXHAUSTIVE_MAX = 8  # hosts up to which every rank order is scored


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


def paced_ranges(batch: int, steps: int, counts: list[int]) -> list[list[tuple[int, int]]]:
    """Per rank, its [lo, hi) of each of `steps` global batches, given the sequences each rank
    trains over all of them (`counts`, summing to steps x batch): every rank floor(c / steps)
    or one more in each step (so its inner steps stay alike), the extras dealt out in turn
    over the steps so each step's ranges cover its batch exactly, ranks in order."""
    if sum(counts) != steps * batch or min(counts, default=0) < 0:
        raise PlacementError(f"paced counts {counts} do not cover {steps} batches of {batch}")
    per = [[c // steps] * steps for c in counts]
    k = 0
    for r, c in enumerate(counts):  # each rank's extras land on consecutive steps, modulo steps
        for _ in range(c % steps):
            per[r][k % steps] += 1
            k += 1
    by_step = [ranges([p[j] for p in per]) for j in range(steps)]
    return [[tuple(by_step[j][r]) for j in range(steps)] for r in range(len(counts))]


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


# --- rank order ---
def edges(n: int, topology: str) -> list[tuple[int, int]]:
    """Directed rank pairs that carry the strategy's traffic."""
    if n < 2:
        return []
    if topology == "star":
        return [(0, r) for r in range(1, n)] + [(r, 0) for r in range(1, n)]
    pairs = [(r, r + 1) for r in range(n - 1)]
    if topology == "ring" and n > 2:
        pairs.append((n - 1, 0))
    else:
        pairs += [(r + 1, r) for r in range(n - 1)]
    return pairs


def _table(names: list[str], link_s, nbytes: float) -> dict[tuple[str, str], float]:
    return {(a, b): link_s(a, b, nbytes) for a in names for b in names if a != b}


def order_cost(order, topology: str, table) -> tuple[float, float]:
    costs = [table[(order[s], order[d])] for s, d in edges(len(order), topology)]
    if not costs:
        return (0.0, 0.0)
    total = sum(costs)
    return (total, total) if topology == "star" else (max(costs), total)


def _greedy(names, topology, table) -> list[list[str]]:
    """One order per start host: walk to the cheapest next host; then 2-opt swaps."""
    out = []
    for start in names:
        order, left = [start], [n for n in names if n != start]
        while left:
            nxt = min(left, key=lambda n: table[(order[-1], n)] + table[(n, order[-1])])
            order.append(nxt)
            left.remove(nxt)
        best = order_cost(order, topology, table)
        improved = True
        while improved:
            improved = False
            for i, j in itertools.combinations(range(len(order)), 2):
                cand = list(order)
                cand[i], cand[j] = cand[j], cand[i]
                c = order_cost(cand, topology, table)
                if c < best:
                    order, best, improved = cand, c, True
        out.append(order)
    return out


def candidate_orders(names: list[str], topology: str, link_s, nbytes: float, keep: int = 6) -> list[list[str]]:
    """Up to `keep` distinct orders, cheapest links first; the given order when links are free."""
    names = list(names)
    if link_s is None or len(names) < 2:
        return [names]
    table = _table(names, link_s, nbytes)
    if len(names) <= EXHAUSTIVE_MAX:
        pool = (list(p) for p in itertools.permutations(names))
    else:
        pool = iter(_greedy(names, topology, table) + [names])
    scored = sorted(((order_cost(o, topology, table), i, o) for i, o in enumerate(pool)), key=lambda t: (t[0], t[1]))
    out, seen = [], set()
    for _, _, o in scored:
        if tuple(o) not in seen:
            seen.add(tuple(o))
            out.append(o)
        if len(out) >= keep:
            break
    return out


def slowest_edge(order: list[str], topology: str, link_s, nbytes: float) -> tuple[str, str, float] | None:
    """The edge that paces the order (for the plan's words)."""
    if link_s is None or len(order) < 2:
        return None
    s, d = max(edges(len(order), topology), key=lambda e: link_s(order[e[0]], order[e[1]], nbytes))
    return order[s], order[d], link_s(order[s], order[d], nbytes)


def down_edge(order: list[str], topology: str, link_s) -> tuple[str, str] | None:
    """The first edge of this order whose link is down (infinite time), else None."""
    if link_s is None:
        return None
    for s, d in edges(len(order), topology):
        if not math.isfinite(link_s(order[s], order[d], 1.0)):
            return order[s], order[d]
    return None


def avoid_down(names: list[str], topology: str, link_s) -> list[str]:
    """The given order, or the cheapest one that avoids every down link when the given one
    crosses one; PlacementError naming the link when no order avoids them all."""
    names = list(names)
    bad = down_edge(names, topology, link_s)
    if bad is None:
        return names
    best = candidate_orders(names, topology, link_s, 1.0, keep=1)[0]
    if down_edge(best, topology, link_s) is not None:
        raise PlacementError(
            f"link {bad[0]} -> {bad[1]} is down and no {topology} order of {', '.join(names)} avoids every "
            "down link (fix it, e.g. `make provision` for an MTU fault, and run `smolnet matrix` again)"
        )
    return best


def read_placement_file(path: str) -> dict:
    """A placement document, or a plan / run report that carries one."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"--placement {path}: not a readable placement JSON ({e})") from None
    if isinstance(doc, dict) and isinstance(doc.get("placement"), dict):
        doc = doc["placement"]
    Placement.from_dict(doc)
    return doc
