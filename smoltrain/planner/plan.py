"""Build one smoltrain.plan/1 document: traffic per link, time per step, memory per rank and
the bottleneck, in words. Everything else in the planner (CLI, tables, chart, compare) reads
these documents.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from smolnet.errors import UsageError
from smoltrain import registry
from smoltrain.models.spec import ModelSpec
from smoltrain.planner import capacity, timing
from smoltrain.planner.bottleneck import bottleneck, human_bytes
from smoltrain.planner.devices import LINK_CLASSES, DeviceProfile, get_device, load_calibration
from smoltrain.planner.links import LinkModel, from_class, link_model
from smoltrain.planner.traffic import Traffic, bytes_per_token, dtype_bytes, traffic

PLAN_SCHEMA = "smoltrain.plan/1"


@dataclass
class Rank:
    name: str
    device: DeviceProfile
    memory_bytes: float
    fixed_s: float = 0.0  # measured fixed cost of a whole-model training step (planner/compute.py)
    measured: bool = False  # figures from a compute report, not a device profile
    comm_cpu: dict | None = None  # measured CPU cost of communication on this host (planner/compute.py)
    shared: bool = False  # speed already shares its machine's cores with the other ranks there
    comm_core: bool = True  # a core is left for communication while the rank computes
    optimizer_s: float = 0.0  # of fixed_s: the whole model's AdamW update, once per step
    cpu_quota: tuple[float, float] | None = None  # (quota, period) seconds of a measured CFS cap


def rank_names(world: int, hosts=None) -> list[str]:
    return [h.name for h in hosts[:world]] if hosts else [f"rank{r}" for r in range(world)]


def _profile(device: str, calibration) -> DeviceProfile:
    if device == "generic" and calibration is not None:
        return calibration
    return get_device(device)


def host_memory(host, name: str, default: float) -> float:
    """The inventory's `smol_memory_gb` for this host, else the device profile's memory."""
    gb = (getattr(host, "vars", None) or {}).get("smol_memory_gb")
    if gb is None:
        return default
    try:
        return float(gb) * 1e9
    except (TypeError, ValueError):
        raise UsageError(f"host {name}: smol_memory_gb must be a number, got {gb!r}") from None


def resolve_ranks(world: int, hosts=None, calibration=None) -> list[Rank]:
    if hosts is not None and len(hosts) < world:
        raise UsageError(f"world {world} is larger than the {len(hosts)} hosts of the inventory")
    out = []
    for r, name in enumerate(rank_names(world, hosts)):
        host = hosts[r] if hosts else None
        prof = _profile(getattr(host, "device", "generic") or "generic", calibration)
        out.append(Rank(name, prof, host_memory(host, name, prof.memory_bytes)))
    return out


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
) -> dict:
    """`placement` (planner.placement's document): who runs which share, in which rank order;
    the plan then describes exactly the run that executes it (None: the even split).
    `compute_dtype`: the matmuls' dtype where it differs from `dtype`, the bytes' (run --dtype
    bf16 keeps fp32 weights and gradients); `quantize`, `wire_dtype`: inference weights and
    activations on the wire (planner.widths). `outer`: an outer-step strategy's settings
    (planner.diloco.options: inner_steps, sync_dtype, target_comm)."""
    if placement and ranks is not None:
        ranks, world = placed_ranks(ranks, placement), len(placement["order"])
    if mode == "infer":
        batch, microbatches = 1, 1  # the contract's bytes per token are for batch-1 decode
    info = registry.REGISTRY.get(strategy)  # an unknown name is refused by traffic() below
    if info is None or not info.microbatched:
        microbatches = 1  # only a pipeline cuts the batch into microbatches (as smoltrain run does)
    tr: Traffic = traffic(strategy, mode, model, world, dtype, batch, seq, microbatches, wire=wire_dtype)
    ranks = ranks or resolve_ranks(world)
    names = [r.name for r in ranks]
    lm = lm or from_class("1gbe")
    from smoltrain.planner.compute import cpu_links, quota_hop_seconds, quota_stages

    lm_wire, lm = lm, cpu_links(lm, ranks)  # a busy host's CPU slows its messages (measured compute only)
    train = mode == "train"
    a = dtype_bytes(dtype)

    # compute and memory per rank
    works = capacity.layout(strategy, mode, model, world, batch, seq, microbatches, placement if train else None)
    per_rank, update_s = [], []
    for r, (w, rk) in enumerate(zip(works, ranks)):
        fl = capacity.flops(w, model, mode, seq)
        mt = capacity.memory_traffic(w, model, mode, dtype, batch, seq, strategy, quantize)
        t_fl = fl / rk.device.flops(compute_dtype or dtype)
        t_mem = mt / rk.device.mem_bw
        mem = capacity.memory(w, model, mode, dtype, seq, strategy, quantize)
        t_c = max(t_fl, t_mem)
        if rk.measured and train:  # timed steps hold the memory traffic already, plus a fixed cost
            # every microbatch runs all of the stage's operations: a pipeline pays the per-pass
            # fixed cost m times; the AdamW update once, for the parameters the rank owns
            passes = (rk.fixed_s - rk.optimizer_s) * capacity.fixed_share(w, model, strategy)
            update = rk.optimizer_s * w.params_owned / model.params()
            t_c = t_fl + passes * (microbatches if info.microbatched else 1) + update
        else:
            update = 0.0
        update_s.append(update)
        per_rank.append(
            {
                "rank": r,
                "name": rk.name,
                "device": rk.device.name,
                "flops_per_step": fl,
                "memory_traffic_bytes": mt,
                "compute_s": t_c,
                "bound": "compute" if t_fl >= t_mem else "memory-bandwidth",
                "memory": mem.to_dict(),
                "memory_available": int(rk.memory_bytes * capacity.HEADROOM),
                "fits": mem.total <= rk.memory_bytes * capacity.HEADROOM,
            }
        )

    # communication and the step
    link_b = tr.link_bytes()
    link_m = tr.link_msgs()
    link_s = timing.link_seconds(tr, names, lm)
    down = [(s, d) for (s, d) in link_b if not lm.get(names[s], names[d]).up]
    bubble = 0.0
    if info.splits == "layers" and world > 1:
        stage = [p["compute_s"] for p in per_rank]
        if train:
            mb = batch * seq * model.hidden * a / microbatches
            idle = microbatches == 1 and any(rk.cpu_quota for rk in ranks)  # each stage idles between stretches

            def hop(s: int, d: int) -> float:
                burst = quota_hop_seconds(mb, lm_wire.get(names[s], names[d]), [ranks[s], ranks[d]]) if idle else None
                ln = lm.get(names[s], names[d])
                return burst if burst is not None else (ln.alpha_s + mb / ln.bytes_per_s if ln.up else math.inf)

            hop_f = [hop(r, r + 1) for r in range(world - 1)]
            hop_b = [hop(r + 1, r) for r in range(world - 1)]
            if idle:
                stage = quota_stages(stage, update_s, hop_f, hop_b, [rk.cpu_quota for rk in ranks])
                for p, t in zip(per_rank, stage):
                    p["compute_s"] = t
            compute_s, comm_s = timing.pipeline(stage, hop_f, hop_b, microbatches, True)
            # the boundary hops are in the schedule; add what else crosses (tied embeddings)
            hops = {i for i, ph in enumerate(tr.phases) if not ph.what.startswith("tied")}
            comm_s += timing.comm_cost(tr, names, lm, skip=hops).total_s
            bubble = (world - 1) / (microbatches + world - 1)
        else:
            compute_s = sum(stage)
            comm_s = timing.comm_cost(tr, names, lm).total_s
        cc = timing.comm_cost(tr, names, lm)
    else:
        slowest = max(per_rank, key=lambda p: p["compute_s"])
        compute_s = slowest["compute_s"]
        if train and info.parameter_server and world > 1:  # the server aggregates and updates
            compute_s += capacity.server_seconds(model, world, ranks[0].device.mem_bw)
        cc = timing.comm_cost(tr, names, lm)
        comm_s = cc.total_s
        if train:  # a server's gather starts worker by worker as each one's backward ends
            comm_s -= timing.staggered_saving(tr, names, lm, [p["compute_s"] for p in per_rank])
        # a ring moves at its slowest member's pace: dp's buckets hide behind backward only where
        # every rank has a core to spare for them; a capped host sends on the core it computes on
        if overlap and train and cc.overlappable_s > 0 and all(rk.comm_core for rk in ranks):
            # only the wire's share hides behind backward; the CPU's share competes with it
            wire = timing.comm_cost(tr, names, lm_wire) if lm is not lm_wire else cc
            comm_s = (
                comm_s
                - cc.overlappable_s
                + max(0.0, cc.overlappable_s - wire.overlappable_s)
                + timing.exposed_overlap(wire.overlappable_s, wire.last_bucket_s, 2 / 3 * compute_s)
            )
    busy = [rk.name for rk in ranks if not rk.comm_core]
    if train and cc.overlappable_s > 0 and busy:
        tr.notes.append(
            f"{', '.join(busy)}: torch threads take every core, so gradient sends share them and do not "
            "overlap the backward pass (smol_threads one below the host's cores leaves the transport one)"
        )
    step_s = compute_s + comm_s
    finite = math.isfinite(step_s)
    tokens_step = batch * seq if train else 1
    if not train and info.replicated_infer:  # replicas serve their own streams
        tps = sum(1 / p["compute_s"] for p in per_rank if p["compute_s"] > 0)
    else:
        tps = tokens_step / step_s if finite and step_s > 0 else 0.0

    # bottleneck, in words
    bn, where = bottleneck(tr, per_rank, names, lm, link_b, link_s, compute_s, comm_s, cc, down, bubble)
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
    doc = {
        "schema": PLAN_SCHEMA,
        "strategy": strategy,
        "mode": mode,
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
        "world_size": world,
        "dtype": dtype,
        "compute_dtype": compute_dtype or dtype,  # the dtype whose FLOP/s the plan assumed
        "quantize": quantize,
        "wire_dtype": (wire_dtype or dtype) if not train else None,
        "batch": batch,
        "seq": seq,
        "microbatches": microbatches,
        "tokens_per_step": tokens_step,
        "bytes_per_token": bytes_per_token(tr, batch, seq),
        "bytes_per_step": int(round(max(busiest))) if busiest else 0,
        "total_bytes_per_step": int(round(sum(link_b.values()))),
        "links": links_out,
        "compute_s_per_step": compute_s,
        "compute_source": "measured" if ranks and all(rk.measured for rk in ranks) else "nominal",
        "compute_s_per_rank": [p["compute_s"] for p in per_rank],
        "comm_s_per_step": comm_s if finite else None,
        "step_s": step_s if finite else None,
        "tokens_per_s": tps,
        "bubble_fraction": bubble,
        "bottleneck": bn,
        "bottleneck_where": where,
        "ranks": per_rank,
        "phases": [
            {"what": ph.what, "rounds": ph.repeat, "bytes_per_round": int(round(sum(t.nbytes for t in ph.transfers)))}
            for ph in tr.phases
        ],
        "link_source": lm.source,
        "placement_mode": (placement or {}).get("mode", "even"),
        "notes": tr.notes
        + ([] if train else [f"infer: one generated token per step, batch-1 decode, KV cache over {seq} positions"]),
    }
    if train and info.outer_steps:  # the all-reduce every H steps (planner.diloco)
        from smoltrain.planner import diloco

        diloco.finish(doc, model, ranks, lm, outer)
    if single:
        from smoltrain.planner import verdict

        widths = dict(compute_dtype=compute_dtype, quantize=quantize, wire_dtype=wire_dtype)
        doc["single_host"] = verdict.single_host(
            make_plan, model, ranks, dtype=dtype, batch=batch, seq=seq, mode=mode, **widths
        )
        doc["verdict"] = verdict.sentence(doc)
    return doc


def in_placement_order(items: list, placement: dict) -> list:
    """Ranks or hosts (anything with a .name) in the placement's rank order, then those it
    leaves out: the first len(order) are the placed run's ranks."""
    by = {x.name: x for x in items}
    missing = [n for n in placement["order"] if n not in by]
    if missing:
        raise UsageError(f"placement names {', '.join(missing)}, not among the hosts {', '.join(by)}")
    return [by[n] for n in placement["order"]] + [x for x in items if x.name not in placement["order"]]


def placed_ranks(ranks: list[Rank], placement: dict) -> list[Rank]:
    """The ranks in the placement's order (hosts it leaves out dropped)."""
    return in_placement_order(ranks, placement)[: len(placement["order"])]


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
    placement: dict | None = None,
    outer: dict | None = None,
    **widths,
) -> dict:
    """The plan `smoltrain run` shows before launching and writes beside what it measured,
    under the placement the run executes.

    Host names are the inventory's, or rank0..rank{N-1} when `hosts` is None (`--local N`).
    `calibration`: a DeviceProfile, a calibration file path, False to ignore, or None to use
    ~/.config/smolcluster/calibration.json for `generic` hosts when it exists.
    """
    if isinstance(calibration, (str, os.PathLike)):
        calibration = load_calibration(str(calibration), required=True)
    elif calibration is None:
        calibration = load_calibration(None)
    elif calibration is False:
        calibration = None
    ranks = resolve_ranks(world, hosts, calibration)
    if compute is not False:  # None: reports/compute.json when it exists (planner/compute.py)
        from smoltrain.planner import compute as measured

        ranks, _ = measured.apply(ranks, hosts[:world] if hosts else None, compute, model)
    if hosts is None and world > 1:
        ranks = share_machine(ranks, busy=busy_ranks(strategy, world, microbatches, mode))
    lm = link_model([r.name for r in ranks], hosts[:world] if hosts else None, links, link_class)
    doc = make_plan(
        strategy,
        model,
        world,
        dtype,
        batch,
        seq,
        microbatches,
        mode,
        ranks,
        lm,
        overlap,
        placement=placement,
        outer=outer,
        **widths,
    )
    if hosts is None and world > 1:
        doc["notes"].append(f"--local: the {world} ranks share this machine's {os.cpu_count()} cores and its memory")
    return doc


def busy_ranks(strategy: str, world: int, microbatches: int = 1, mode: str = "train") -> int:
    """How many ranks compute at the same time: a pipeline keeps at most min(m, p) busy, and
    mp (or any pipeline in decode) one."""
    info = registry.REGISTRY.get(strategy)
    if info is None or info.splits != "layers":
        return world
    if not info.microbatched or mode == "infer":
        return 1
    return min(world, microbatches)


def share_machine(ranks: list[Rank], cores: int | None = None, busy: int | None = None) -> list[Rank]:
    """Ranks on one machine (--local, or the sim) split its cores: each rank runs one torch
    thread, so a rank keeps its (one-thread) rate while there is a core for each busy rank."""
    from dataclasses import replace

    n = len(ranks)
    if all(r.shared for r in ranks):  # measured per machine_id (planner/compute.py) already
        return ranks
    f = min(1.0, (cores or os.cpu_count() or 1) / (busy or n))
    return [
        Rank(
            r.name,
            replace(
                r.device,
                flops_fp32=r.device.flops_fp32 * f,
                flops_fp16=r.device.flops_fp16 * f,
                flops_bf16=r.device.flops_bf16 * f if r.device.flops_bf16 else None,
                mem_bw=r.device.mem_bw * f,
            ),
            r.memory_bytes / n,
            r.fixed_s / f,
            r.measured,
            dict(r.comm_cpu, message_s=r.comm_cpu["message_s"] / f, bytes_s=r.comm_cpu["bytes_s"] * f)
            if r.comm_cpu
            else None,
            comm_core=r.comm_core and (cores or os.cpu_count() or 1) / n >= 2,
            optimizer_s=r.optimizer_s / f,
        )
        for r in ranks
    ]


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
