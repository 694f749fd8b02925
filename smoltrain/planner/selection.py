"""Plan selection for `smoltrain plan`: which plans a request asks for and the documents they
make, all through the one resolver (request.resolve and build_plan).

`commands/plan.py` parses its arguments into a PlanRequest and calls these; nothing here reads
argv or prints, so a bench or a test gets the very plan the command shows.
"""

from __future__ import annotations

from dataclasses import replace

from smolnet.errors import UsageError


class ReportHost:
    """A rank known only from a links report: its name and device profile."""

    def __init__(self, name: str, device: str | None):
        self.name, self.device, self.local, self.link_rate_mbit, self.vars = name, device or "generic", False, None, {}


def hosts(inventory: str | None, links_doc: dict | None) -> list | None:
    """Hosts in rank order: the inventory's (coordinator first), else the links report's."""
    if inventory:
        from smolnet.inventory import load_inventory

        inv = load_inventory(inventory)
        return [inv.coordinator] + [h for h in inv.hosts if h.name != inv.coordinator.name]
    if links_doc is not None:
        from smoltrain.planner.devices import DEVICES

        out = [
            ReportHost(h["name"], h.get("device") if h.get("device") in DEVICES else "generic")
            for h in links_doc.get("hosts") or []
        ]
        if not out:
            from smoltrain.planner.links import report_hosts

            out = [ReportHost(n, None) for n in report_hosts(links_doc)]
        return out
    return None


def from_run(run_doc: dict, strategy: str | None) -> dict:
    """What a run report fixes of its plan (`plan --compare`): strategy, model, world, widths,
    batch, sequence, microbatches, train mode, and an outer-step strategy's inner steps and sync
    dtype. A --strategy that differs from the run's is refused."""
    from smoltrain import registry
    from smoltrain.planner.compare import run_request
    from smoltrain.planner.traffic import STRATEGIES

    req = run_request(run_doc)
    if strategy and strategy != req["strategy"]:
        raise UsageError(f"--strategy {strategy} differs from the run's {req['strategy']}")
    out = {k: req[k] for k in ("strategy", "model", "world", "dtype", "batch", "seq", "microbatches")}
    out["mode"] = "train"
    if req["strategy"] in STRATEGIES and registry.get(req["strategy"]).outer_steps:
        out["inner_steps"] = req["inner_steps"]
        if req["sync_dtype"]:
            out["sync_dtype"] = req["sync_dtype"]
    lora = run_doc.get("lora")  # a LoRA run: its adapters are what it synchronised (planner.tuning)
    if lora:
        t = lora.get("targets")
        out.update(lora_rank=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"])
        out["lora_targets"] = ",".join(t) if t else None
    return out


def strategy_for(strategy: str | None, mode: str) -> str:
    """The strategy a plan request names, checked: serve splits a group with pp (default) or tp."""
    from smoltrain import registry
    from smoltrain.planner.traffic import STRATEGIES

    if mode == "serve":
        strategy = strategy or "pp"
        if strategy not in registry.with_trait("serves"):
            splits = " or ".join(registry.with_trait("serves"))
            raise UsageError(f"--mode serve splits a group of hosts with {splits}, not {strategy}")
    if not strategy:
        raise UsageError(f"--strategy is required ({', '.join(registry.names())} or all)")
    known = (*STRATEGIES, "all")
    if strategy not in known:
        raise UsageError(f"unknown strategy {strategy!r} (one of {', '.join(STRATEGIES)}, or all)")
    return strategy


def serve(req, concurrency: int, max_batch: int, wire: str | None) -> dict:
    """`--mode serve`: the candidate splits for `concurrency` requests (planner/serve.py) on the
    request's ranks and links; a pp group cuts its layers as `serve` would."""
    from smoltrain.planner import placement_plan
    from smoltrain.planner import serve as serve_plan
    from smoltrain.planner.request import resolve

    st = resolve(replace(req, mode="infer"))
    how = placement_plan.default_mode(req.placement, st.compute_source == "measured")
    return serve_plan.plan(
        st.model,
        st.ranks,
        st.lm,
        strategy=req.strategy,
        dtype=req.dtype,
        concurrency=concurrency,
        max_batch=max_batch,
        seq=req.seq,
        placement=how,
        wire=wire,
    )


def ranking(req, setting, target_comm) -> dict:
    """`--strategy all`: every strategy's plan under its own placement, ranked (smoltrain.plans/1),
    what could not run and why, and in train mode the low-communication verdict."""
    from smoltrain.planner import diloco_verdict, render
    from smoltrain.planner.request import build_plan
    from smoltrain.planner.traffic import STRATEGIES

    plans, skipped = [], []
    for s in STRATEGIES:
        try:
            plans.append(build_plan(replace(req, strategy=s), setting))
        except UsageError as e:
            skipped.append({"strategy": s, "reason": str(e)})
    if not plans:
        raise UsageError(f"no strategy can run this: {skipped[0]['reason']}")
    order = [p["strategy"] for p in render.rank_plans(plans)]
    by_name = {p["strategy"]: p for p in plans}

    def replan_outer(strategy, opts):  # the same request, an outer-step setting, the chosen split
        placement = diloco_verdict.chosen_placement(by_name[strategy]) or "even"
        return build_plan(replace(req, strategy=strategy, outer=opts, placement=placement), setting)

    low = diloco_verdict.low_comm_verdict(plans, replan_outer, target_comm) if req.mode == "train" else None
    doc = {"schema": "smoltrain.plans/1", "ranking": order, "ranking_placed": order, "plans": plans}
    doc["skipped"] = skipped  # every plan is already made under its placement: ranking_placed = ranking
    if low:
        doc["low_communication"] = low
    return doc


def one(req, setting, what_if: bool) -> dict:
    """One strategy's plan; with `what_if`, the same plan over the link classes (plan['what_if'])."""
    from smoltrain.planner import placement_plan
    from smoltrain.planner.plan import what_if as over_classes
    from smoltrain.planner.request import build_plan

    plan = build_plan(req, setting)
    if what_if:
        sec = plan.get("placement")
        kw = dict(dtype=req.dtype, batch=req.batch, seq=req.seq, microbatches=req.microbatches, mode=req.mode)
        kw["tuning"] = req.tuning  # LoRA: the adapters' bytes over every link class too
        if sec is not None and "order" in sec:
            kw["placement"] = placement_plan.place_dict(sec)
        plan["what_if"] = over_classes(req.strategy, setting.model, len(setting.ranks), setting.ranks, **kw)
    return plan
