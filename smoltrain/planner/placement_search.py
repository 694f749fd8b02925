"""The search placement runs for each kind of split: which ranks can hold the least piece, how
many pieces each gets (even, or greedy on speed within memory), and for layers and heads the
cuts and rank orders; every candidate is judged by the whole plan (placement_plan.Ask.best).
placement_plan.search picks the split by the registry's `splits`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from smoltrain.planner import capacity, rank_time
from smoltrain.planner.bottleneck import human_bytes, human_s
from smoltrain.planner.placement import (
    Placement,
    PlacementError,
    counts_from_shares,
    even_counts,
    greedy_counts,
    ranges,
)
from smoltrain.planner.split import dtype_bytes

if TYPE_CHECKING:
    from smoltrain.planner.placement_plan import Ask


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
