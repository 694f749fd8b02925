"""The three ways to split work by speed (batch, layers, heads) and the step time they predict.

Costs: a host's measured time for n tokens of the whole model is `fixed_s + n * s_per_token`
(planner.speeds); a piece of the model costs its share of the matmul parameters (a layer:
layer_params / (L * layer_params + vocab * hidden); the LM head: vocab * hidden of it), which
is what a training step's FLOPs follow. See planner.placement for the rules.
"""

from __future__ import annotations

import math

from smoltrain import registry
from smoltrain.models.spec import ModelSpec
from smoltrain.planner.placement import (
    TRAIN_BYTES_PER_PARAM,
    Placement,
    PlacementError,
    act_bytes_per_layer,
    even_counts,
    greedy_counts,
    human_bytes,
    ranges,
    stage_bytes,
    usable,
)
from smoltrain.planner.placement_search import candidate_orders, slowest_edge


def fractions(model: ModelSpec) -> tuple[float, float]:
    """(one layer, the LM head) as shares of a training step's matmul work."""
    lp, head = model.layer_params(), model.vocab * model.hidden
    total = model.layers * lp + head
    return lp / total, head / total


def _rate(sp, tokens: float) -> float:
    """Seconds for `tokens` tokens of the whole model on this host."""
    return sp.fixed_s + tokens * sp.s_per_token


def _describe(sp) -> str:
    return f"{sp.tokens_per_s:,.0f} tokens/s {sp.source}"


def _zero(link_s):
    return link_s or (lambda a, b, n: 0.0)


# --- dp, fsdp, syncps, edp ---
def _model_bytes(strategy: str, model: ModelSpec, n: int) -> float:
    p = model.params()
    if registry.get(strategy).shards_params:
        return p * TRAIN_BYTES_PER_PARAM / n + 2 * 4 * max(model.layer_params(), model.vocab * model.hidden)
    if registry.get(strategy).parameter_server:
        return p * (TRAIN_BYTES_PER_PARAM + 8)  # the server's master copy and AdamW, and a worker copy
    return p * TRAIN_BYTES_PER_PARAM


def place_batch(strategy, mode, model, names, speeds, batch, seq, link_s) -> Placement:
    per_seq = model.layers * act_bytes_per_layer(model, seq, seq) + seq * model.vocab * 8
    caps, excluded = {}, []
    held = _model_bytes(strategy, model, len(names))
    for n in names:
        room = usable(speeds[n]) - held
        caps[n] = int(room // per_seq) if room > 0 else 0
        if caps[n] < 1:
            excluded.append(
                {
                    "name": n,
                    "why": f"needs {human_bytes(held + per_seq)} for the model and one "
                    f"sequence, has {human_bytes(usable(speeds[n]))}",
                }
            )
    kept = [n for n in names if caps[n] >= 1]
    if not kept:
        raise PlacementError(f"{strategy}: {model.name} fits on no host ({excluded[0]['why']})")
    if batch < len(kept):
        raise PlacementError(f"{strategy}: --batch {batch} is smaller than the {len(kept)} ranks sharing it")
    hi = [min(caps[n], batch) for n in kept]
    if mode == "even":
        counts = even_counts(batch, len(kept))
        if any(c > h for c, h in zip(counts, hi)):
            raise PlacementError(
                f"{strategy}: an even split of {batch} sequences does not fit in memory "
                f"(at most {hi} per rank); try --placement auto"
            )
    else:
        # replicas that sync only every H steps (diloco) may leave a host out: one whose single
        # sequence takes longer than the others' whole step would only make them wait at the sync
        lo = 0 if registry.get(strategy).outer_steps else 1
        counts = greedy_counts(batch, lambda i, c: _rate(speeds[kept[i]], c * seq), [lo] * len(kept), hi)
        if counts is None:
            raise PlacementError(
                f"{strategy}: {batch} sequences of {seq} do not fit in the hosts' memory (at most {sum(hi)})"
            )
        slow = [n for n, c in zip(kept, counts) if c == 0]
        step = max(_rate(speeds[n], c * seq) for n, c in zip(kept, counts) if c)
        for n in slow:
            one = _rate(speeds[n], seq)
            excluded.append(
                {
                    "name": n,
                    "why": f"one sequence takes it {one * 1e3:.0f} ms, the others' whole step {step * 1e3:.0f} ms",
                }
            )
        kept, counts = [n for n in kept if n not in slow], [c for c in counts if c]
    by_host = dict(zip(kept, counts))
    topo = registry.get(strategy).topology
    order = kept if mode == "even" else candidate_orders(kept, topo, link_s, 4 * model.params() / len(kept))[0]
    counts = [by_host[n] for n in order]
    why = [f"{n}: {c} of {batch} sequences ({_describe(speeds[n])})" for n, c in zip(order, counts)]
    return Placement(
        mode,
        strategy,
        order,
        shares=[c / batch for c in counts],
        excluded=excluded,
        why=why + _order_words(order, topo, link_s, 4 * model.params() / len(kept)),
    )


# --- mp, pp ---
def _stage_s(model, sp, n, last, tokens) -> float:
    f_layer, f_head = fractions(model)
    return _rate(sp, tokens) * (n * f_layer + (f_head if last else 0.0))


def _hops(order, r, link_s, nbytes) -> float:
    ls, out = _zero(link_s), 0.0
    if r + 1 < len(order):
        out += ls(order[r], order[r + 1], nbytes)
    if r > 0:
        out += ls(order[r], order[r - 1], nbytes)
    return out


def _cut(order, model, speeds, tokens, seq, act, link_s, objective):
    """Best contiguous layer counts for this order (DP), or None when it cannot fit."""
    N, L = len(order), model.layers
    best = {0: (0.0, [])}
    for r, name in enumerate(order):
        sp, first, last = speeds[name], r == 0, r == N - 1
        hop = _hops(order, r, link_s, act)
        nxt = {}
        for k, (obj, counts) in best.items():
            for n in range(1, L - k - (N - r - 1) + 1):
                if stage_bytes(model, n, first, last, tokens, seq) > usable(sp):
                    break
                if last and k + n != L:
                    continue
                t = _stage_s(model, sp, n, last, tokens) + hop
                o = max(obj, t) if objective == "max" else obj + t
                if k + n not in nxt or o < nxt[k + n][0]:
                    nxt[k + n] = (o, counts + [n])
        best = nxt
    return best.get(L)


def place_layers(strategy, mode, model, names, speeds, batch, seq, microbatches, link_s) -> Placement:
    tokens = batch * seq
    act = tokens * model.hidden * 4
    excluded = []
    for n in names:
        need = stage_bytes(model, 1, False, False, tokens, seq)
        if need > usable(speeds[n]):
            excluded.append(
                {"name": n, "why": f"needs {human_bytes(need)} for one layer, has {human_bytes(usable(speeds[n]))}"}
            )
    kept = [n for n in names if n not in {e["name"] for e in excluded}]
    if not kept:
        raise PlacementError(f"{strategy}: no host has memory for one layer of {model.name} ({excluded[0]['why']})")
    if len(kept) > model.layers:
        raise PlacementError(f"{strategy}: {model.name} has {model.layers} layers, fewer than {len(kept)} ranks")
    objective = "max" if registry.get(strategy).microbatched else "sum"  # a pipeline overlaps its stages
    if mode == "even":
        order, counts = kept, even_counts(model.layers, len(kept))
        for r, (n, c) in enumerate(zip(order, counts)):
            need = stage_bytes(model, c, r == 0, r == len(order) - 1, tokens, seq)
            if need > usable(speeds[n]):
                raise PlacementError(
                    f"{strategy}: an even cut gives {n} {c} layer(s) needing {human_bytes(need)}, "
                    f"it has {human_bytes(usable(speeds[n]))}; try --placement auto"
                )
    else:
        found = None
        for o in candidate_orders(kept, "chain", link_s, act) + [kept]:
            got = _cut(o, model, speeds, tokens, seq, act, link_s, objective)
            if got is not None and (found is None or got[0] < found[0][0]):
                found = (got, o)
        if found is None:
            total = stage_bytes(model, model.layers, True, True, tokens, seq)
            raise PlacementError(
                f"{strategy}: {model.name} ({human_bytes(total)} to train at batch {batch}) does "
                f"not fit in the memory of {', '.join(kept)}"
            )
        (_, counts), order = found
    why = [
        f"{n}: layers {lo}..{hi - 1} ({hi - lo} of {model.layers}; {_describe(speeds[n])})"
        for n, (lo, hi) in zip(order, ranges(counts))
    ]
    return Placement(
        mode,
        strategy,
        list(order),
        layers=ranges(counts),
        excluded=excluded,
        why=why + _order_words(order, "chain", link_s, act),
    )


# --- tp ---
def place_heads(strategy, mode, model, names, speeds, batch, seq, link_s) -> Placement:
    G, gsize = model.kv_heads, model.heads // model.kv_heads
    tokens = batch * seq
    f_layer, f_head = fractions(model)
    repl = (model.vocab * model.hidden * 2 + model.ctx * model.hidden) * TRAIN_BYTES_PER_PARAM

    def need(g):
        return (
            repl
            + model.layers
            * (model.layer_params() * g / G * TRAIN_BYTES_PER_PARAM + act_bytes_per_layer(model, tokens, seq))
            + tokens * model.vocab * 8
        )

    excluded = [
        {
            "name": n,
            "why": f"needs {human_bytes(need(1))} for {gsize} head(s) of every layer, has "
            f"{human_bytes(usable(speeds[n]))}",
        }
        for n in names
        if need(1) > usable(speeds[n])
    ]
    kept = [n for n in names if n not in {e["name"] for e in excluded}]
    if not kept:
        raise PlacementError(f"tp: no host has memory for a slice of {model.name} ({excluded[0]['why']})")
    if len(kept) > G:
        raise PlacementError(f"tp: {model.name} has {model.heads} heads in {G} KV groups, fewer than {len(kept)} ranks")
    hi = [max(g for g in range(1, G + 1) if need(g) <= usable(speeds[n])) for n in kept]
    if mode == "even":
        counts = even_counts(G, len(kept))
        if any(c > h for c, h in zip(counts, hi)):
            raise PlacementError(f"tp: an even split of {G} head groups does not fit in memory; try --placement auto")
    else:

        def cost(i, g):
            return _rate(speeds[kept[i]], tokens) * (f_head + model.layers * f_layer * g / G)

        counts = greedy_counts(G, cost, [1] * len(kept), hi)
        if counts is None:
            raise PlacementError(f"tp: {model.name} does not fit in the memory of {', '.join(kept)}")
    by_host = dict(zip(kept, counts))
    act = tokens * model.hidden * 4 / len(kept)
    order = kept if mode == "even" else candidate_orders(kept, "ring", link_s, act)[0]
    groups = [by_host[n] for n in order]
    heads = [g * gsize for g in groups]
    from smoltrain.planner.placement import counts_from_shares

    ffn = counts_from_shares(model.ffn, heads)
    why = [
        f"{n}: heads {lo}..{hi - 1} and {f} MLP columns ({_describe(speeds[n])})"
        for n, (lo, hi), f in zip(order, ranges(heads), ffn)
    ]
    return Placement(
        mode,
        strategy,
        order,
        heads=ranges(heads),
        ffn=ranges(ffn),
        excluded=excluded,
        why=why + _order_words(order, "ring", link_s, act),
    )


def _order_words(order, topology, link_s, nbytes) -> list[str]:
    e = slowest_edge(order, topology, link_s, nbytes)
    if e is None or len(order) < 2:
        return []
    return [
        f"rank order {' -> '.join(order)} ({topology}); its slowest hop {e[0]} -> {e[1]} "
        f"takes {e[2] * 1e3:.2f} ms per {nbytes / 1e6:.2f} MB"
    ]


# --- prediction ---
def predict(
    p: Placement, model: ModelSpec, speeds: dict, batch: int, seq: int, microbatches: int = 1, link_s=None
) -> dict:
    """Compute per rank and a step time for this placement (communication: the strategy's
    topology at its slowest edge; dp's overlap with backward is not counted)."""
    ls, N, tokens = _zero(link_s), p.world, batch * seq
    sp = [speeds[n] for n in p.order]
    P4 = 4 * model.params()
    info = registry.get(p.strategy)
    topo = info.topology
    if p.layers is not None:
        act = tokens * model.hidden * 4
        stage = [_stage_s(model, s, hi - lo, r == N - 1, tokens) for r, (s, (lo, hi)) in enumerate(zip(sp, p.layers))]
        hops = [_hops(p.order, r, link_s, act) for r in range(N)]
        t = [a + b for a, b in zip(stage, hops)]
        if not info.microbatched or N == 1:
            step, comm = sum(t), sum(hops)
        else:
            m = max(1, microbatches)
            step, comm = max(t) * (m + N - 1) / m, max(hops) * (m + N - 1) / m
        compute = stage
    else:
        if p.heads is not None:
            f_layer, f_head = fractions(model)
            compute = [
                _rate(s, tokens) * (f_head + f_layer * model.layers * (hi - lo) / model.heads)
                for s, (lo, hi) in zip(sp, p.heads)
            ]
            msgs, nbytes = 4 * model.layers * 2 * (N - 1), tokens * model.hidden * 4 / max(N, 1)
        else:
            from smoltrain.planner.placement import counts_from_shares

            counts = counts_from_shares(batch, p.shares) if p.shares else even_counts(batch, N)
            compute = [_rate(s, c * seq) for s, c in zip(sp, counts)]
            msgs = {"ring": 2 * (N - 1), "star": 1}.get(topo, 2 * (N - 1)) * (1.5 if info.shards_params else 1)
            nbytes = P4 / N if topo == "ring" else P4
        if N < 2:
            comm = 0.0
        elif topo == "star":
            comm = sum(ls(p.order[0], o, nbytes) + ls(o, p.order[0], nbytes) for o in p.order[1:]) * msgs
        else:
            comm = msgs * max(ls(p.order[s], p.order[d], nbytes) for s, d in [(r, (r + 1) % N) for r in range(N)])
        step = max(compute) + comm
    return {
        "compute_s_per_rank": compute,
        "comm_s": comm,
        "step_s": step,
        "tokens_per_s": tokens / step if step > 0 and math.isfinite(step) else 0.0,
    }
