"""`plan --mode serve`: with C requests at once, is it better to split the model over every host,
to run R whole replicas on groups of hosts, or to serve from the single best host?

Decode reads every weight once per step whatever the batch, so a step of n requests
costs about one request's weight read plus n requests' compute and KV cache reads:
`t(n) = max((weights + n * kv) / bandwidth, n * flops / FLOP/s)` per rank (n >= 4 rows
in the matrix products: decode pads its batches to 4). A group
serves its share of the requests batched (at most `max_batch`):

- one host: a step is t(n).
- pp over k hosts: the requests are dealt into k lanes that follow each other through
  the stages, so a lane's step takes the sum of the stages and hops, and a stage is busy
  k lanes' worth per round: round = max(sum of stages + hops, k * slowest stage); every
  request makes one token per round.
- tp over k hosts: every rank works on every step, then 2 all-reduces per layer (one
  round trip each on the slowest link) and rank 0's header.

A group is the infer plan of those hosts at n rows: the same placement search (a pp cut, a
tp ring order), each rank's own KV cache (a tp rank holds its heads' share), and the same
messages (traffic.py, at the wire dtype) timed the same way (a pp trip: cpu_quota.decode_chain).

Replicas add up; the router keeps their open requests equal, so each of R groups serves
C/R. Per-request latency is the round of its group. Time to first token is for C requests
that arrive together: prompts are prefilled one after another (compute-bound), before
the next decode step, so on average a request waits for (C/R + 1) / 2 prefills. Figures
come from measured compute and links where they exist (`calibrate`, `smolnet matrix`), as
in every other plan.
"""

from __future__ import annotations

import math

from smoltrain.planner import capacity, cpu_quota, rank_time, timing
from smoltrain.planner.placement import PlacementError
from smoltrain.planner.traffic import traffic

SCHEMA = "smoltrain.serveplan/1"
PAD_ROWS = 4  # a decode step computes at least 4 rows (smoltrain/models/stage.py MIN_ROWS)


def split_evenly(n: int, r: int) -> list[list[int]]:
    """n hosts in r groups, in order, the first groups one longer (5 over 2: 3, 2)."""
    base, extra = divmod(n, r)
    out, at = [], 0
    for g in range(r):
        k = base + (1 if g < extra else 0)
        out.append(list(range(at, at + k)))
        at += k
    return out


def split_by_speed(speeds: list[float], r: int) -> list[list[int]]:
    """Groups of the sizes split_evenly gives, each as near the same total speed as it can:
    the fastest host first to the slowest group with room; each group keeps host order."""
    sizes = [len(g) for g in split_evenly(len(speeds), r)]
    groups: list[list[int]] = [[] for _ in range(r)]
    total = [0.0] * r
    for i in sorted(range(len(speeds)), key=lambda i: -speeds[i]):
        g = min((g for g in range(r) if len(groups[g]) < sizes[g]), key=lambda g: (total[g], g))
        groups[g].append(i)
        total[g] += speeds[i]
    groups = [sorted(g) for g in groups]
    return sorted(groups, key=lambda g: g[0])  # the group holding host 0 (the coordinator) first


def _rank_seconds(w, model, rk, strategy: str, dtype: str, n: int, seq: int, pad: int) -> tuple[float, str]:
    """One decode step of n rows (padded to `pad` in the matrix products) on one rank, as the
    infer plan times it (rank_time.decode): (seconds, bound)."""
    t, _ = rank_time.decode(rk, w, rank_time.Shape(strategy, "infer", model, dtype, 1, seq), n, pad)
    return t.compute_s, t.bound


def group_placement(model, ranks: list, lm, strategy: str, dtype: str, seq: int, lanes: int, mode: str, wire=None):
    """The placement a group of `serve` runs (a pp layer cut, a tp ring order and heads):
    the infer plan's search (infer.report.decode_request asks the same). With several lanes in
    flight a pp group's stages are balanced."""
    from smoltrain.planner.placement_plan import Ask, place_dict, search

    widths = {"wire_dtype": wire} if wire else None
    ask = Ask(strategy, mode, model, list(ranks), lm, "infer", dtype, 1, seq, widths=widths, lanes=lanes)
    return place_dict(search(ask))


def group_step(
    model,
    ranks: list,
    names: list[str],
    lm,
    strategy: str,
    dtype: str,
    rows: int,
    seq: int,
    pad: int = PAD_ROWS,
    placement: str = "even",
    wire: str | None = None,
) -> dict:
    """A group serving `rows` requests at once: round seconds (each request's time per token),
    tokens/s, prefill seconds per prompt token, what bounds it, and whether it fits. The group
    is the infer plan at these rows: its placement (`group_placement`; `placement`: even or
    auto), each rank's KV cache per sequence, and its messages (traffic, `wire` dtype) timed as
    `plan --mode infer` times them: tp's on the CPU-adjusted links (compute.cpu_links), a pp
    token's trip down the chain by cpu_quota.decode_chain."""
    from smoltrain.planner.compute import cpu_links

    k = len(ranks)
    s = strategy if k > 1 else "pp"
    lanes = min(k, rows) if s == "pp" else 1
    cut = None
    if k > 1:
        try:
            cut = group_placement(model, ranks, lm, s, dtype, seq, lanes, placement, wire)
        except PlacementError:  # no placement fits: the even one below says so (fits: false)
            pass
        else:
            by = {rk.name: rk for rk in ranks}
            ranks, names = [by[n] for n in cut["order"]], list(cut["order"])
    sh = rank_time.Shape(s, "infer", model, dtype, 1, seq)
    works = capacity.layout(s, "infer", model, k, 1, seq, placement=cut)
    mem = [rank_time.memory(w, sh) for w in works]
    mem_ok = all(m.total + (rows - 1) * m.kv_cache <= rank_time.available(rk) for m, rk in zip(mem, ranks))
    prefill = [2 * w.matmul_params / rk.device.flops(dtype) for w, rk in zip(works, ranks)]
    per_msg = math.ceil(rows / lanes)  # the rows one step's messages carry: a lane's (pp), all (tp)
    t = [_rank_seconds(w, model, rk, s, dtype, per_msg, seq, pad) for w, rk in zip(works, ranks)]
    comm = 0.0
    if k > 1:
        tr = traffic(s, "infer", model, k, dtype, 1, seq, wire=wire, rows=per_msg)
        comm = timing.comm_cost(tr, names, cpu_links(lm, ranks)).total_s
    if s == "tp" and k > 1:
        compute = max(x for x, _ in t)
        step = compute + comm
        bound = "link" if comm > compute else max(t)[1]
        pre = max(prefill) + comm
    else:  # a request's token crosses the chain as the infer plan's does (cpu_quota.decode_chain)
        stages = [x for x, _ in t]
        trip = cpu_quota.decode_chain(stages, ranks, tr, names, lm) if k > 1 else stages[0]
        busy = lanes * max(stages)
        step = max(trip, busy)
        bound = "link" if trip - sum(stages) > sum(stages) else max(t)[1]
        pre = sum(prefill) + comm
    return {
        "step_s": step,
        "tokens_per_s": rows / step if step > 0 and math.isfinite(step) else 0.0,
        "prefill_s_per_token": pre,
        "lanes": lanes,
        "bottleneck": bound,
        "fits": mem_ok,
        "kv_cache_bytes": [rows * x.kv_cache for x in mem],  # each rank's, in `order`
        "layers": cut.get("layers") if cut else None,  # None: one rank, tp, or no cut that fits
        "order": names,
    }


def candidates(n: int, speeds: list[float]) -> list[tuple[str, list[list[int]]]]:
    """(name, host groups): one group over all hosts, R replicas for each R that divides the
    hosts into groups of at least one, and the single best host."""
    out = [("split", [list(range(n))])]
    for r in range(2, n + 1):
        out.append((f"{r} replicas", split_by_speed(speeds, r)))
    best = max(range(n), key=lambda i: (speeds[i], -i))
    if n > 1:
        out.append(("best host", [[best]]))
    return out


def plan(
    model,
    ranks: list,
    lm,
    *,
    strategy: str = "pp",
    dtype: str = "fp32",
    concurrency: int = 8,
    max_batch: int = 8,
    seq: int = 256,
    prompt: int = 32,
    placement: str = "even",
    wire: str | None = None,
) -> dict:
    """Every candidate split of these ranks (hosts) for `concurrency` requests; the best named.
    `placement`: how a group is placed (even, or auto by measured speed), as serve runs it;
    `wire`: the dtype hidden states cross the links at (default `dtype`)."""
    names = [r.name for r in ranks]
    # decode reads weights: the rate a served step (max_batch rows) reads them at is speed
    speeds = [r.device.weight_rate(dtype, max(max_batch, PAD_ROWS))[0] for r in ranks]
    rows_out = []
    for name, groups in candidates(len(ranks), speeds):
        share = split_counts(concurrency, len(groups))
        per, ok = [], True
        for g, c in zip(groups, share):
            rows = max(1, min(c, max_batch))
            hosts = ([ranks[i] for i in g], [names[i] for i in g])
            pad = PAD_ROWS if max_batch > 1 else 1
            st = group_step(model, *hosts, lm, strategy, dtype, rows, seq, pad, placement, wire)
            st["queued"] = max(0, c - max_batch)
            per.append(st)
            ok = ok and st["fits"]
        tps = sum(st["tokens_per_s"] for st, c in zip(per, share) if c > 0)
        latency = max(st["step_s"] for st, c in zip(per, share) if c > 0)
        # C requests arriving together: the k-th waits for the k prefills up to its own (prefill first)
        ttft = max(st["prefill_s_per_token"] * prompt * (c + 1) / 2 for st, c in zip(per, share) if c > 0)
        rows_out.append(
            {
                "name": name,
                "replicas": len(groups),
                "groups": [[names[i] for i in g] for g in groups],
                "layers": [st["layers"] for st in per],  # each pp group's cut, in its rank order
                "group_index": groups,
                "strategy": strategy,
                "requests_per_replica": share,
                "tokens_per_s": tps if ok else 0.0,
                "latency_s_per_token": latency,
                "ttft_s": ttft,
                "bottleneck": per[0]["bottleneck"] if ok else "capacity",
                "lanes": [st["lanes"] for st in per],
                "fits": ok,
            }
        )
    fitting = [r for r in rows_out if r["fits"]] or rows_out
    best = max(fitting, key=lambda r: (r["tokens_per_s"], -r["latency_s_per_token"]))
    return {
        "schema": SCHEMA,
        "model": model.name,
        "dtype": dtype,
        "concurrency": concurrency,
        "max_batch": max_batch,
        "seq": seq,
        "prompt": prompt,
        "strategy": strategy,
        "wire_dtype": wire or dtype,
        "hosts": names,
        "decode_source": rank_time.decode_source(ranks, rank_time.Shape(strategy, "infer", model, dtype, 1, seq)),
        "candidates": rows_out,
        "best": best["name"],
    }


def split_counts(c: int, r: int) -> list[int]:
    """C requests over R replicas as the router keeps them: as equal as they can be."""
    return [c // r + (1 if g < c % r else 0) for g in range(r)]


def render(con, doc: dict) -> None:
    from rich.table import Table

    t = Table(
        title=f"serving {doc['model']} to {doc['concurrency']} concurrent requests "
        f"({doc['strategy']} inside a group, batch <= {doc['max_batch']})"
    )
    for c in ("candidate", "groups", "tokens/s (all)", "s/token (each)", "TTFT s", "bottleneck"):
        t.add_column(c)
    for r in doc["candidates"]:
        mark = " (best)" if r["name"] == doc["best"] else ""
        t.add_row(
            r["name"] + mark,
            " | ".join(",".join(g) for g in r["groups"]),
            f"{r['tokens_per_s']:,.1f}" if r["fits"] else "does not fit",
            f"{r['latency_s_per_token']:.3f}",
            f"{r['ttft_s']:.3f}",
            r["bottleneck"],
        )
    con.print(t)
