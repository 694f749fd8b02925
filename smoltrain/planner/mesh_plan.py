"""Step time, memory and bottleneck of one mesh layout on the resolved hosts and links.

A layout is a mesh (smoltrain.mesh) and a host for each of its ranks. Its step is timed with
the 1-D planner's own pieces, axis by axis, group by group (planner.mesh_traffic.axis_traffic):
- each rank computes its share (rank_time: its stage's layers, its tp slice of the heads and
  MLP columns, its replica's batch), on its host's measured or nominal speed;
- tp groups run lockstep (steps.lockstep: the slowest member, then the all-reduces over the
  group's own links); a stage of a pp x tp mesh takes its tp group's time;
- pp groups run the GPipe schedule over the hops between their hosts (steps.layers);
- the dp (or replica) axis then sums the gradients in one all-reduce over its groups, after
  the backward pass (Context.sync_replicas: nothing hides it).
Groups along an axis run at once on disjoint links, so an axis takes its slowest group's time.
What this does not model: contention between two axes on one host's NIC (each group is timed
on its own links), tp's smaller activations inside pp stages (the memory check counts pp's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from smoltrain import registry
from smoltrain.mesh import MODEL_AXES
from smoltrain.planner import capacity, mesh_render, rank_time, steps, timing
from smoltrain.planner.bottleneck import Bottleneck, out_of_memory
from smoltrain.planner.mesh_traffic import held_params
from smoltrain.planner.placement import counts_from_shares, even_counts


@dataclass(frozen=True)
class Shape:
    """The step every layout of one request shares."""

    model: object  # ModelSpec
    batch: int
    seq: int
    microbatches: int
    dtype: str = "fp32"
    compute_dtype: str | None = None
    inner_steps: int | None = None  # a diloco axis's H (its outer all-reduce amortised over H)
    sync_dtype: str = "fp32"  # a diloco axis's pseudo-gradient on the wire
    tuning: object = None  # planner.tuning.Tuning: LoRA (its adapters train, the base frozen); None: full

    @property
    def outer(self) -> dict:
        """What axis_traffic and mesh_link_bytes take beyond the step: a diloco axis's H and sync
        dtype, and what trains."""
        return {"inner_steps": self.inner_steps, "sync_dtype": self.sync_dtype, "tuning": self.tuning}


def place(mesh, rank: int) -> dict:
    """{axis: (coordinate, size)} of a rank."""
    return {a: (c, n) for (a, n), c in zip(mesh.axes, mesh.coords(rank))}


def replica_batch(mesh, rank: int, batch: int) -> int:
    _, data, _ = mesh.roles()
    if not data:
        return batch
    return mesh.replica_rows(batch)[place(mesh, rank)[data][0]]


def tp_shares(spec, t: int, T: int) -> tuple[float, float]:
    """(share of the heads, share of the MLP columns) of tp rank t of T: whole KV groups, even,
    as strategies.tp splits them (and mesh_traffic counts them)."""
    g = spec.heads // spec.kv_heads
    kv = even_counts(spec.kv_heads, T)
    return kv[t] * g / spec.heads, counts_from_shares(spec.ffn, [n * g for n in kv])[t] / spec.ffn


def rank_work(mesh, sh: Shape, rank: int) -> capacity.RankWork:
    """What one rank holds and computes: its pp stage (the whole model without pp) on its
    replica's batch, cut to its tp slice; the parameters it holds exactly as mesh_traffic's;
    under LoRA as the tuning trains it (its adapters alone, the frozen base without gradients)."""
    spec, pl = sh.model, place(mesh, rank)
    s, P = pl.get("pp", (0, 1))
    t, T = pl.get("tp", (0, 1))
    nl = mesh.stage_layers(spec.layers)[s]
    b = replica_batch(mesh, rank, sh.batch)
    w = capacity.stage_work(spec, s, P, nl, "train", b, sh.seq, sh.microbatches, P > 1)
    if T == 1:
        return sh.tuning.work(w, spec) if sh.tuning is not None else w
    attn, mlp = tp_shares(spec, t, T)
    frac = (spec.attn_params() * attn + spec.mlp_params() * mlp) / (spec.attn_params() + spec.mlp_params())
    blocks = nl * capacity._active_layer_params(spec)
    held = held_params(spec, pl, nl)
    w = replace(
        w, params_held=held, params_owned=held, matmul_params=w.matmul_params - blocks * (1 - frac), attn_share=attn
    )
    return sh.tuning.work(w, spec) if sh.tuning is not None else w


def rank_shape(mesh, sh: Shape, rank: int) -> rank_time.Shape:
    """rank_time's view of a rank: a stage's fixed cost and passes with pp, tp's activations without."""
    strategy = "pp" if mesh.size("pp") > 1 else "tp" if mesh.size("tp") > 1 else "dp"
    passes = sh.microbatches if mesh.size("pp") > 1 else 1
    b = replica_batch(mesh, rank, sh.batch)
    return rank_time.Shape(strategy, "train", sh.model, sh.dtype, b, sh.seq, passes, sh.compute_dtype)


def rank_rows(mesh, sh: Shape, hosts: list) -> list[tuple[dict, rank_time.RankTime]]:
    """The plan's `ranks` entries of a layout (rank r on hosts[r]) and their times; under a diloco
    axis each rank also keeps its anchor and outer momentum (fp32, as 1-D diloco's plan counts) of
    what it trains (under LoRA its adapters)."""
    works = [rank_work(mesh, sh, r) for r in range(mesh.world)]
    rows = [rank_time.row(r, hosts[r], works[r], rank_shape(mesh, sh, r)) for r in range(mesh.world)]
    if mesh.size("diloco") > 1:
        for p, _ in rows:
            w = works[p["rank"]]
            mem, state = p["memory"], 2 * (_held(mesh, sh.model, p["rank"]) if w.trainable is None else w.trainable) * 4
            mem["optimizer"] += state
            mem["total"] += state
            p["fits"] = mem["fits"] = mem["total"] <= p["memory_available"]
    return rows


def _held(mesh, spec, rank: int) -> int:
    pl = place(mesh, rank)
    return held_params(spec, pl, mesh.stage_layers(spec.layers)[pl.get("pp", (0, 1))[0]])


@dataclass
class Part:
    """One component of the step: seconds on the critical path, and where."""

    what: str  # compute, tp, pp, dp
    seconds: float
    where: str  # an axis: timing's name for its limiting link or NIC; "" for compute
    latency: bool = False
    rank: int | None = None  # compute: the slowest rank
    bubble: float = 0.0  # compute under pp: the pipeline's bubble


def _group_step(mesh, axis, tr, group, hosts, lm, wire, sh: Shape, compute_s, update_s) -> steps.StepTime:
    """One group's time along its axis by the 1-D step function of its kind (steps.of)."""
    names, ranks = [hosts[r].name for r in group], [hosts[r] for r in group]
    m = sh.microbatches if axis == "pp" else 1
    b = replica_batch(mesh, group[0], sh.batch)
    st = steps.Setting(
        tr,
        registry.get(axis),
        sh.model,
        names,
        ranks,
        compute_s,
        update_s,
        lm,
        wire,
        b,
        sh.seq,
        m,
        sh.dtype,
        True,
        overlap=False,
    )
    return steps.of(st)


def time_layout(mesh, sh: Shape, hosts: list, lm, wire, groups: list) -> dict:
    """Step time and its parts for rank r on hosts[r]; `groups` is axis_traffic's list (it does
    not depend on the hosts, so a search computes it once per mesh)."""
    rows = rank_rows(mesh, sh, hosts)
    compute = [t.compute_s for _, t in rows]
    update = [t.update_s for _, t in rows]
    stage = list(compute)  # each rank's time per step before pp's schedule: its tp group's
    tp_comm = [0.0] * mesh.world
    tp_where = [""] * mesh.world
    tp_alpha = [False] * mesh.world
    slowest = list(range(mesh.world))  # the slowest rank of each rank's tp group (itself without tp)
    names = [h.name for h in hosts]
    for axis, g, tr in groups:
        if axis != "tp":
            continue
        st = _group_step(mesh, axis, tr, g, hosts, lm, wire, sh, [compute[r] for r in g], [update[r] for r in g])
        for r in g:
            stage[r], tp_comm[r], slowest[r] = st.compute_s + st.comm_s, st.comm_s, max(g, key=compute.__getitem__)
            tp_where[r], tp_alpha[r] = st.cc.limiter, st.cc.alpha_s > st.cc.total_s / 2
    model_parts: list[list[Part]] = []
    model_s: list[float] = []
    pp_groups = [(g, tr) for axis, g, tr in groups if axis == "pp"]
    for g, tr in pp_groups:
        st = _group_step(mesh, "pp", tr, g, hosts, lm, wire, sh, [stage[r] for r in g], [update[r] for r in g])
        slow = max(g, key=lambda r: stage[r])
        tp_share = tp_comm[slow] / stage[slow] if stage[slow] > 0 else 0.0
        s = slowest[slow]  # the rank whose compute sets the slowest stage's pace
        parts = [
            Part("compute", st.compute_s * (1 - tp_share), "", rank=s, bubble=st.bubble),
            Part("pp", st.comm_s, st.cc.limiter, st.cc.alpha_s > st.cc.total_s / 2),
        ]
        if mesh.size("tp") > 1:
            parts.insert(1, Part("tp", st.compute_s * tp_share, tp_where[slow], tp_alpha[slow]))
        model_parts.append(parts)
        model_s.append(st.compute_s + st.comm_s)
    if not pp_groups:  # tp alone inside each replica (or nothing but the data axis)
        for r in range(mesh.world):
            s = slowest[r]
            parts = [Part("compute", compute[s], "", rank=s)]
            if tp_comm[r]:
                parts.append(Part("tp", tp_comm[r], tp_where[r], tp_alpha[r]))
            model_parts.append(parts)
            model_s.append(stage[r])
    crit = max(range(len(model_s)), key=lambda i: model_s[i])
    parts = list(model_parts[crit])
    data = [(axis, g, tr) for axis, g, tr in groups if axis not in MODEL_AXES]
    if data:
        costs = [(timing.comm_cost(tr, [names[r] for r in g], lm), axis) for axis, g, tr in data]
        cc, axis = max(costs, key=lambda c: c[0].total_s)
        parts.append(Part(axis, cc.total_s, cc.limiter, cc.alpha_s > cc.total_s / 2))
    step_s = model_s[crit] + (parts[-1].seconds if data else 0.0)
    return {"rows": rows, "step_s": step_s, "parts": parts, "link_s": _link_seconds(groups, names, lm)}


def _link_seconds(groups, names: list[str], lm) -> dict:
    """{(world src, world dst): seconds each link is busy per step}, over every axis's groups."""
    out: dict[tuple[int, int], float] = {}
    for _, g, tr in groups:
        for (s, d), sec in timing.link_seconds(tr, [names[r] for r in g], lm).items():
            out[(g[s], g[d])] = out.get((g[s], g[d]), 0.0) + sec
    return out


def bottleneck(parts: list[Part], rows, names: list[str], down: list, mesh) -> Bottleneck:
    """The layout's limit as planner.bottleneck's record (mesh_render.words says it): a rank that
    does not fit, a down link (and its axis), else the largest part: the slowest rank's compute
    (with pp, its stage's) or an axis's communication over its limiting link."""
    unfit = out_of_memory([p for p, _ in rows], mesh.size("diloco") > 1)
    if unfit:
        return unfit
    if down:
        (s, d), axis = down[0]
        return Bottleneck("link", "down", src=names[s], dst=names[d], axis=axis)
    top = max(parts, key=lambda p: p.seconds)
    compute_s = sum(p.seconds for p in parts if p.what == "compute")
    comm_s = sum(p.seconds for p in parts if p.what != "compute")
    total = sum(p.seconds for p in parts)
    step = dict(share=top.seconds / total if total > 0 else None, compute_s=compute_s, comm_s=comm_s)
    if top.what != "compute":
        kind = "latency" if top.latency else "link"
        cause = "latency" if top.latency else "bandwidth"
        return Bottleneck(kind, cause, axis=top.what, limiter=top.where, seconds=top.seconds, **step)
    p, t = rows[top.rank]
    rec = dict(rank=top.rank, host=names[top.rank], device=p["device"], seconds=t.compute_s, per="step", **step)
    rec["work"] = "FLOPs" if t.bound == "compute" else "memory traffic"
    if mesh.size("pp") > 1:
        return Bottleneck(t.bound, "stages", stages=mesh.size("pp"), bubble=top.bubble, **rec)
    return Bottleneck(t.bound, "rank", **rec)


def entry(mesh, sh: Shape, hosts: list, lm, wire, groups: list, link_bytes: dict, placement: str) -> dict:
    """One layout as the plan documents list it under `meshes`."""
    t = time_layout(mesh, sh, hosts, lm, wire, groups)
    names = [h.name for h in hosts]
    axis_of = {(g[s], g[d]): axis for axis, g, tr in groups for (s, d) in tr.link_bytes()}
    down = [((s, d), axis_of[(s, d)]) for (s, d) in link_bytes if not lm.get(names[s], names[d]).up]
    bn = bottleneck(t["parts"], t["rows"], names, down, mesh)
    step = t["step_s"] if math.isfinite(t["step_s"]) and not down else None
    links = []
    for (s, d), b in sorted(link_bytes.items()):
        sec = t["link_s"][(s, d)]
        links.append(
            {
                "src_rank": s,
                "dst_rank": d,
                "src": names[s],
                "dst": names[d],
                "axis": axis_of[(s, d)],
                "bytes_per_step": int(round(b)),
                "seconds_per_step": sec if math.isfinite(sec) else None,
            }
        )
    ranks = [
        {k: p[k] for k in ("rank", "name", "device", "compute_s", "bound", "memory_available", "fits")}
        | {"memory_bytes": p["memory"]["total"]}
        for p, _ in t["rows"]
    ]
    return {
        "layout": mesh.text(),
        "mesh": mesh.report(),
        "order": names,
        "placement": placement,
        "fits": all(r["fits"] for r in ranks),
        "step_s": step,
        "tokens_per_s": sh.batch * sh.seq / step if step else 0.0,
        "seconds": {p.what: p.seconds for p in t["parts"] if math.isfinite(p.seconds)},
        "bottleneck": bn.kind,
        "bottleneck_axis": bn.axis,
        "bottleneck_where": mesh_render.words(bn),
        "bottleneck_detail": bn.to_dict(),
        "links": links,
        "ranks": ranks,
    }
