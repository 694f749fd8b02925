"""Build one smoltrain.plan/1 document: traffic per link, time per step, memory per rank and
the bottleneck. This module is the one plan builder: every plan (train, infer, an outer-step
strategy's) is made here, and everything else in the planner (CLI, tables, chart, compare)
reads its documents.

make_plan is the arithmetic in phases: each rank's compute and memory for its work
(rank_time.py), the inner step of the strategy's kind of split (steps.py), any amortised
phase that runs once every H steps (phases.py; diloco's outer step), then the document and
its bottleneck record (bottleneck.py, turned into words here). request.build_plan is the one
way commands get there.
"""

from __future__ import annotations

import math
from dataclasses import replace

from smoltrain import registry
from smoltrain.models.spec import ModelSpec
from smoltrain.planner import capacity, rank_time, steps, timing
from smoltrain.planner.bottleneck import Parts, find, human_bytes, words
from smoltrain.planner.devices import LINK_CLASSES
from smoltrain.planner.links import LinkModel, from_class
from smoltrain.planner.ranks import Rank, placed_ranks, resolve_ranks
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
    setting = steps.Setting(
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
    st = steps.of(setting)
    if st.rank_compute_s is not None:
        for p, t in zip(per_rank, st.rank_compute_s):
            p["compute_s"] = t
    busy = [rk.name for rk in ranks if not rk.comm_core]
    if train and st.cc.overlappable_s > 0 and busy:
        tr.notes.append(
            f"{', '.join(busy)}: torch threads take every core, so gradient sends share them and do not "
            "overlap the backward pass (smol_threads one below the host's cores leaves the transport one)"
        )
    outer_ph = None
    if train and info.outer_steps:  # the all-reduce every H steps (planner.diloco)
        from smoltrain.planner import diloco
        from smoltrain.planner.pace_plan import Paced

        # under auto placement the run paces each outer step's sequences (planner.pacing): so does the plan
        paced = Paced.of(placement, names, ranks, works, sh, [t.compute_s for _, t in rows])
        pick_s = steps.of(replace(setting, compute_s=paced.tending_s())).compute_s if paced else st.compute_s
        outer_ph = diloco.outer_phase(model, ranks, names[: tr.world], lm, outer, pick_s, tuning)
        if paced is not None:
            rows = paced.rows(outer_ph.every)
            per_rank = [p for p, _ in rows]
            st = steps.of(replace(setting, compute_s=[t.compute_s for _, t in rows]))
        keep(per_rank, outer_ph)
    doc = document(tr, info, model, names, ranks, per_rank, st, lm, dtype, batch, seq, microbatches, outer_ph)
    doc.update(
        compute_dtype=compute_dtype or dtype,  # the dtype whose FLOP/s the plan assumed
        quantize=quantize,
        wire_dtype=(wire_dtype or dtype) if not train else None,
        placement_mode=(placement or {}).get("mode", "even"),
        decode_source=None if train else rank_time.decode_source(ranks[: len(works)], sh),
    )
    if tuning is not None:
        doc["tuning"] = tuning.to_dict(model)
    if outer_ph is not None:  # the outer step's settings (CONTRACT: inner_steps, sync_dtype) and figures
        doc["inner_steps"] = outer_ph.every
        doc["inner_steps_source"] = outer_ph.every_source
        doc["sync_dtype"] = outer_ph.dtype
        doc["target_comm"] = outer_ph.target_comm
        doc["outer"] = outer_section(outer_ph, doc)
        if paced is not None:
            doc["paced"] = paced.section(outer_ph.every)
    if single:
        from smoltrain.planner import verdict

        kw = dict(dtype=dtype, batch=batch, seq=seq, mode=mode, compute_dtype=compute_dtype, quantize=quantize)
        kw["tuning"] = tuning
        doc["single_host"] = verdict.single_host(model, ranks, **kw)
        doc["verdict"] = verdict.sentence(doc)
    return doc


def keep(per_rank: list[dict], ph) -> None:
    """Each rank's memory with the state an amortised phase keeps between runs (diloco's anchor and
    momentum, counted as optimizer state)."""
    for p in per_rank:
        mem = p["memory"]
        mem["optimizer"] += ph.state_bytes
        mem["total"] += ph.state_bytes
        p["fits"] = mem["fits"] = mem["total"] <= p["memory_available"]


def outer_section(ph, doc: dict) -> dict:
    """The doc's `outer`: one run of the amortised phase, and its share of the step."""
    comm, step = doc["comm_s_per_step"], doc["step_s"]
    per = ph.rank_bytes
    return {
        "bytes_per_outer_step": int(round(ph.busiest)),
        "total_bytes_per_outer_step": int(round(sum(per))),
        "allreduce_s": ph.cc.total_s if math.isfinite(ph.cc.total_s) else None,
        "update_s": ph.update_s,
        "sync_s": ph.sync_s if math.isfinite(ph.sync_s) else None,
        "comm_fraction": comm / step if step is not None and step > 0 else None,
    }


def _per_step(tr: Traffic, names: list[str], lm: LinkModel, ph) -> tuple[dict, dict, dict]:
    """Bytes, messages and busy seconds per step on each directed link: the inner step's, plus an
    amortised phase's runs divided by its `every`."""
    link_b, link_m, link_s = tr.link_bytes(), tr.link_msgs(), timing.link_seconds(tr, names, lm)
    if ph is not None:
        h = ph.every
        ob, om, os_ = ph.tr.link_bytes(), ph.tr.link_msgs(), timing.link_seconds(ph.tr, names, lm)
        for k in ob:
            link_b[k] = link_b.get(k, 0) + ob[k] / h
            link_m[k] = link_m.get(k, 0) + om[k] / h
            link_s[k] = link_s.get(k, 0) + os_[k] / h
    return link_b, link_m, link_s


def document(tr, info, model, names, ranks, per_rank, st, lm, dtype, batch, seq, microbatches, ph=None) -> dict:
    """The smoltrain.plan/1 document of one plan: traffic per link, time, memory, bottleneck;
    `ph`: an amortised phase (planner.phases), its bytes and seconds charged 1/every per step."""
    train = tr.mode == "train"
    h = ph.every if ph is not None else 1
    comm_s = st.comm_s + ph.sync_s / h if ph is not None else st.comm_s
    step_s = st.compute_s + comm_s
    finite = math.isfinite(step_s)
    tokens_step = batch * seq if train else 1
    if not train and info.replicated_infer:  # replicas serve their own streams
        tps = sum(1 / p["compute_s"] for p in per_rank if p["compute_s"] > 0)
    else:
        tps = tokens_step / step_s if finite and step_s > 0 else 0.0
    link_b, link_m, link_s = _per_step(tr, names, lm, ph)
    down = [(s, d) for (s, d) in link_b if not lm.get(names[s], names[d]).up]
    bn = find(Parts(tr, per_rank, names, lm, link_b, link_s, link_m, st.compute_s, comm_s, st.cc, down, st.bubble, ph))
    sent = tr.rank_bytes()  # per step; with an amortised phase, per `h` steps then divided
    if ph is not None:
        sent = [h * a + b for a, b in zip(sent, ph.rank_bytes)]
    busiest = max(sent) if sent else 0.0
    total = sum(tr.link_bytes().values()) * h + (sum(ph.rank_bytes) if ph is not None else 0)
    outer_b = ph.tr.link_bytes() if ph is not None else {}
    links_out = []
    for (s, d), b in sorted(link_b.items()):
        ln = lm.get(names[s], names[d])
        row = {"src": names[s], "dst": names[d], "bytes_per_step": int(round(b))}
        if ph is not None:
            row["bytes_per_outer_step"] = int(round(outer_b.get((s, d), 0)))
        row.update(
            messages_per_step=link_m.get((s, d), 0),
            seconds_per_step=link_s[(s, d)] if math.isfinite(link_s[(s, d)]) else None,
            rate_mbit=ln.rate_mbit or 0.0,
            rtt_us=ln.rtt_us,
        )
        links_out.append(row)
    phases = [
        {"what": p.what, "rounds": p.repeat, "bytes_per_round": int(round(sum(t.nbytes for t in p.transfers)))}
        for p in tr.phases
    ]
    if ph is not None:
        phases += [
            {"what": p.what, "rounds": p.repeat, "bytes_per_round": int(round(sum(t.nbytes for t in p.transfers)))}
            | {"every_steps": h}
            for p in ph.tr.phases
        ]
    notes = tr.notes + (
        [] if train else [f"infer: one generated token per step, batch-1 decode, KV cache over {seq} positions"]
    )
    if ph is not None:
        notes.append(f"{tr.strategy}: {ph.note}")
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
        "bytes_per_token": busiest / (h * batch * seq) if train else bytes_per_token(tr, batch, seq),
        "bytes_per_step": int(round(busiest / h)),
        "total_bytes_per_step": int(round(total / h)),
        "links": links_out,
        "compute_s_per_step": st.compute_s,
        "compute_source": "measured" if ranks and all(rk.measured for rk in ranks) else "nominal",
        "compute_s_per_rank": [p["compute_s"] for p in per_rank],
        "comm_s_per_step": comm_s if finite else None,
        "step_s": step_s if finite else None,
        "tokens_per_s": tps,
        "bubble_fraction": st.bubble,
        "bottleneck": bn.kind,
        "bottleneck_where": words(bn),
        "bottleneck_detail": bn.to_dict(),
        "ranks": per_rank,
        "phases": phases,
        "link_source": lm.source,
        "notes": notes,
    }


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
