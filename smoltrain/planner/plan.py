"""Build one smoltrain.plan/1 document: traffic per link, time per step, memory per rank and
the bottleneck, in words. Everything else in the planner (CLI, tables, chart, compare) reads
these documents.

make_plan is the arithmetic in three parts: each rank's compute and memory for its work
(rank_time.py), the step time of the strategy's kind of split (steps.py), and the
document. request.build_plan is the one way commands get there.
"""

from __future__ import annotations

import math

from smoltrain import registry
from smoltrain.models.spec import ModelSpec
from smoltrain.planner import capacity, rank_time, steps, timing
from smoltrain.planner.bottleneck import bottleneck, human_bytes
from smoltrain.planner.devices import LINK_CLASSES
from smoltrain.planner.links import LinkModel, from_class, link_model  # noqa: F401
from smoltrain.planner.ranks import (  # noqa: F401  (public names others import from here)
    Rank,
    busy_ranks,
    host_memory,
    in_placement_order,
    placed_ranks,
    rank_names,
    resolve_ranks,
    share_machine,
)
from smoltrain.planner.traffic import Traffic, bytes_per_token, traffic

PLAN_SCHEMA = "smoltrain.plan/1"


def make_plan(
    strategy: str,
    model: ModelSpec,
    world: int,
    dtype: str = "fp32",
    batch: int = 8,
    seq: int = 64,
    microbatches: int = 1,
    mode: str = "train",
    ranks: list[Rank] | None = None,
    lm: LinkModel | None = None,
    overlap: bool = True,
    single: bool = True,
    placement: dict | None = None,
    *,
    compute_dtype: str | None = None,
    quantize: str | None = None,
    wire_dtype: str | None = None,
    outer: dict | None = None,
    tuning=None,
) -> dict:
    """The plan of these ranks over these links (the arithmetic; request.build_plan resolves
    ranks, links and placement from what a command was given, then calls this).

    `placement` (planner.placement's document): who runs which share, in which rank order;
    the plan then describes exactly the run that executes it (None: the even split).
    `compute_dtype`: the matmuls' dtype where it differs from `dtype`, the bytes' (run --dtype
    bf16 keeps fp32 weights and gradients); `quantize`, `wire_dtype`: inference weights and
    activations on the wire (planner.widths). `outer`: an outer-step strategy's settings
    (planner.diloco.options: inner_steps, sync_dtype, target_comm). `tuning` (train): what
    trains and how (planner.tuning: LoRA adapters, a quantised base, checkpointing)."""
    if placement and ranks is not None:
        ranks, world = placed_ranks(ranks, placement), len(placement["order"])
    if mode == "infer":
        batch, microbatches = 1, 1  # the contract's bytes per token are for batch-1 decode
    info = registry.REGISTRY.get(strategy)  # an unknown name is refused by traffic() below
    if info is None or not info.microbatched:
        microbatches = 1  # only a pipeline cuts the batch into microbatches (as smoltrain run does)
    tuning = tuning if mode == "train" else None
    tr: Traffic = traffic(strategy, mode, model, world, dtype, batch, seq, microbatches, wire=wire_dtype, tuning=tuning)
    ranks = ranks or resolve_ranks(world)
    names = [r.name for r in ranks]
    wire = lm or from_class("1gbe")
    from smoltrain.planner.compute import cpu_links

    train = mode == "train"
    passes = microbatches if info.microbatched else 1
    sh = rank_time.Shape(strategy, mode, model, dtype, batch, seq, passes, compute_dtype, quantize, tuning)
    works = capacity.layout(strategy, mode, model, world, batch, seq, microbatches, placement)
    rows = [rank_time.row(r, rk, w, sh) for r, (w, rk) in enumerate(zip(works, ranks))]
    per_rank = [p for p, _ in rows]
    lm = cpu_links(wire, ranks)  # a busy host's CPU slows its messages (measured compute only)
    st = steps.of(
        steps.Setting(
            tr,
            info,
            model,
            names,
            ranks,
            [t.compute_s for _, t in rows],
            [t.update_s for _, t in rows],
            lm,
            wire,
            batch,
            seq,
            microbatches,
            dtype,
            train,
            overlap,
        )
    )
    if st.rank_compute_s is not None:
        for p, t in zip(per_rank, st.rank_compute_s):
            p["compute_s"] = t
    busy = [rk.name for rk in ranks if not rk.comm_core]
    if train and st.cc.overlappable_s > 0 and busy:
        tr.notes.append(
            f"{', '.join(busy)}: torch threads take every core, so gradient sends share them and do not "
            "overlap the backward pass (smol_threads one below the host's cores leaves the transport one)"
        )
    doc = document(tr, info, model, names, ranks, per_rank, st, lm, dtype, batch, seq, microbatches)
    doc.update(
        compute_dtype=compute_dtype or dtype,  # the dtype whose FLOP/s the plan assumed
        quantize=quantize,
        wire_dtype=(wire_dtype or dtype) if not train else None,
        placement_mode=(placement or {}).get("mode", "even"),
        decode_source=None if train else rank_time.decode_source(ranks[: len(works)], sh),
    )
    if tuning is not None:
        doc["tuning"] = tuning.to_dict(model)
    if train and info.outer_steps:  # the all-reduce every H steps (planner.diloco)
        from smoltrain.planner import diloco

        diloco.finish(doc, model, ranks, lm, outer, tuning)
    if single:
        from smoltrain.planner import verdict

        kw = dict(dtype=dtype, batch=batch, seq=seq, mode=mode, compute_dtype=compute_dtype, quantize=quantize)
        kw["tuning"] = tuning
        doc["single_host"] = verdict.single_host(model, ranks, **kw)
        doc["verdict"] = verdict.sentence(doc)
    return doc


def document(tr, info, model, names, ranks, per_rank, st, lm, dtype, batch, seq, microbatches) -> dict:
    """The smoltrain.plan/1 document of one plan: traffic per link, time, memory, bottleneck."""
    train = tr.mode == "train"
    step_s = st.compute_s + st.comm_s
    finite = math.isfinite(step_s)
    tokens_step = batch * seq if train else 1
    if not train and info.replicated_infer:  # replicas serve their own streams
        tps = sum(1 / p["compute_s"] for p in per_rank if p["compute_s"] > 0)
    else:
        tps = tokens_step / step_s if finite and step_s > 0 else 0.0
    link_b = tr.link_bytes()
    link_m = tr.link_msgs()
    link_s = timing.link_seconds(tr, names, lm)
    down = [(s, d) for (s, d) in link_b if not lm.get(names[s], names[d]).up]
    bn, where = bottleneck(tr, per_rank, names, lm, link_b, link_s, st.compute_s, st.comm_s, st.cc, down, st.bubble)
    busiest = tr.rank_bytes()
    links_out = []
    for (s, d), b in sorted(link_b.items()):
        ln = lm.get(names[s], names[d])
        links_out.append(
            {
                "src": names[s],
                "dst": names[d],
                "bytes_per_step": int(round(b)),
                "messages_per_step": link_m.get((s, d), 0),
                "seconds_per_step": link_s[(s, d)] if math.isfinite(link_s[(s, d)]) else None,
                "rate_mbit": ln.rate_mbit or 0.0,
                "rtt_us": ln.rtt_us,
            }
        )
    return {
        "schema": PLAN_SCHEMA,
        "strategy": tr.strategy,
        "mode": tr.mode,
        "model": {
            "name": model.name,
            "params": model.params(),
            "layers": model.layers,
            "hidden": model.hidden,
            "heads": model.heads,
            "kv_heads": model.kv_heads,
            "ffn": model.ffn,
            "vocab": model.vocab,
            "experts": model.experts,
            "top_k": model.top_k,
            "tied_embeddings": model.tied_embeddings,
        },
        "world_size": tr.world,
        "dtype": dtype,
        "batch": batch,
        "seq": seq,
        "microbatches": microbatches,
        "tokens_per_step": tokens_step,
        "bytes_per_token": bytes_per_token(tr, batch, seq),
        "bytes_per_step": int(round(max(busiest))) if busiest else 0,
        "total_bytes_per_step": int(round(sum(link_b.values()))),
        "links": links_out,
        "compute_s_per_step": st.compute_s,
        "compute_source": "measured" if ranks and all(rk.measured for rk in ranks) else "nominal",
        "compute_s_per_rank": [p["compute_s"] for p in per_rank],
        "comm_s_per_step": st.comm_s if finite else None,
        "step_s": step_s if finite else None,
        "tokens_per_s": tps,
        "bubble_fraction": st.bubble,
        "bottleneck": bn,
        "bottleneck_where": where,
        "ranks": per_rank,
        "phases": [
            {"what": ph.what, "rounds": ph.repeat, "bytes_per_round": int(round(sum(t.nbytes for t in ph.transfers)))}
            for ph in tr.phases
        ],
        "link_source": lm.source,
        "notes": tr.notes
        + ([] if train else [f"infer: one generated token per step, batch-1 decode, KV cache over {seq} positions"]),
    }


def plan_for_run(
    strategy,
    model: ModelSpec,
    world: int,
    dtype: str = "fp32",
    batch: int = 8,
    seq: int = 64,
    microbatches: int = 1,
    mode: str = "train",
    hosts=None,
    links: dict | None = None,
    link_class: str | None = None,
    *,
    calibration=None,
    overlap: bool = True,
    compute: str | None | bool = None,
    placement: dict | str | None = None,
    **widths,
) -> dict:
    """The plan of a run (request.build_plan): host names are the inventory's, or
    rank0..rank{N-1} on this machine when `hosts` is None (`--local N`).
    `calibration`: a DeviceProfile, a calibration file path, False to ignore, or None to use
    ~/.config/smolcluster/calibration.json for `generic` hosts when it exists."""
    from smoltrain.planner.request import PlanRequest, build_plan

    return build_plan(
        PlanRequest(
            strategy,
            model,
            mode=mode,
            world=world,
            dtype=dtype,
            batch=batch,
            seq=seq,
            microbatches=microbatches,
            placement=placement if placement is not None else "even",
            hosts=hosts,
            links=links,
            link_class=link_class,
            compute=compute,
            calibration=calibration,
            local=hosts is None,
            overlap=overlap,
            **widths,
        )
    )


WHAT_IF_CLASSES = ("1gbe", "2.5gbe", "10gbe", "tb4", "25gbe", "tb5", "100gbe", "200gbe")  # by goodput
COMM_BOUND = ("link", "latency")


def what_if(strategy: str, model: ModelSpec, world: int, ranks: list[Rank], **kw) -> list[dict]:
    """The same plan over every link class: where the links stop being the bottleneck."""
    rows = []
    for name in WHAT_IF_CLASSES:
        d = make_plan(strategy, model, world, ranks=ranks, lm=from_class(name), single=False, **kw)
        rows.append(
            {
                "link_class": name,
                "goodput_mbit": LINK_CLASSES[name].goodput_mbit,
                "rtt_us": LINK_CLASSES[name].rtt_us,
                "step_s": d["step_s"],
                "comm_s_per_step": d["comm_s_per_step"],
                "tokens_per_s": d["tokens_per_s"],
                "bottleneck": d["bottleneck"],
            }
        )
    return rows


def describe_links(source: dict) -> str:
    kind = source.get("kind")
    if kind == "link-class":
        return f"your {source['link_class']} links"
    if kind == "links-report":
        return "your measured links"
    if kind == "inventory":
        return f"your {source['rated_mbit']:.0f} Mbit/s links (rated, from the inventory)"
    return "your links"


def what_if_sentence(plan: dict, rows: list[dict]) -> str:
    """One line: which link class this strategy needs, or that the link is not the bottleneck."""
    s, per_tok = plan["strategy"], human_bytes(plan["bytes_per_token"])
    yours = describe_links(plan["link_source"])
    if plan["bottleneck"] not in COMM_BOUND:
        return f"{s} over {yours} sends {per_tok} per token; the link is not the bottleneck ({plan['bottleneck']} is)"
    ok = next((r for r in rows if r["bottleneck"] not in COMM_BOUND), None)
    if ok is None:
        last = rows[-1]
        return (
            f"{s} sends {per_tok} per token and stays {last['bottleneck']}-bound even on "
            f"{last['link_class']}; pick a strategy that sends less"
        )
    return f"{s} needs {ok['link_class']} here (over {yours} it is {plan['bottleneck']}-bound, {per_tok} per token)"
