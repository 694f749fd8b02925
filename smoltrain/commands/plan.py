"""`smoltrain plan`: bytes per token, step time and the bottleneck, before anything runs."""

from __future__ import annotations

from smolnet.errors import UsageError
from smolnet.files import write_json_atomic
from smoltrain import registry, validate

MODELS_HELP = "tiny, gpt2-124m, llama-3.2-1b, llama-3.1-8b, mixtral-8x7b, or a .json shape"


def add_arguments(p) -> None:
    p.add_argument("--strategy", help=", ".join(registry.names()) + ", or all (rank them)")
    p.add_argument("--mode", default="train", choices=("train", "infer", "serve"))
    p.add_argument("--model", default="tiny", help=MODELS_HELP)
    p.add_argument("--world", type=validate.RANKS, help="ranks (default: inventory hosts, links-report hosts, else 2)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--quantize", choices=("int8", "q4"), help="--mode infer: weights at this width (contract §9)")
    p.add_argument(
        "--wire-dtype", choices=("fp32", "bf16", "fp16", "int8"), help="--mode infer: hidden states on the wire"
    )
    p.add_argument("--batch", type=validate.BATCH, default=8, help="global batch in sequences (train)")
    p.add_argument("--seq", type=validate.SEQ, default=64, help="sequence length (train) or context length (infer)")
    p.add_argument("--microbatches", type=validate.MICROBATCHES, default=1)
    p.add_argument("--concurrency", type=validate.COUNT, default=8, help="serve: requests at once (default 8)")
    p.add_argument("--max-batch", type=validate.count(62), default=8, help="serve: requests a replica decodes at once")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--links", metavar="REPORT.json", help="a smolnet.links/1 report (smolnet matrix)")
    src.add_argument("--link-class", help="1gbe, 2.5gbe, 10gbe, 25gbe, 100gbe, 200gbe, tb4, tb5 (or loopback)")
    p.add_argument("-i", "--inventory", help="inventory: host names, device profiles, rank order")
    p.add_argument(
        "--calibration",
        metavar="FILE",
        help="profile from `smoltrain calibrate` for generic hosts "
        "(default ~/.config/smolcluster/calibration.json when present)",
    )
    p.add_argument(
        "--compute",
        metavar="COMPUTE.json",
        help="measured compute (smoltrain calibrate; default reports/compute.json when present)",
    )
    p.add_argument(
        "--json",
        metavar="FILE",
        help="write the plan (smoltrain.plan/1; --strategy all: smoltrain.plans/1 with a list under 'plans')",
    )
    p.add_argument("--chart", metavar="PNG", help="bytes per token and step time split, per strategy")
    p.add_argument("--compare", metavar="RUN.json", help="predicted vs measured for a smoltrain run report")
    p.add_argument("--no-what-if", action="store_true", help="skip the table over link classes")
    from smoltrain.planner.diloco import add_arguments as outer_arguments

    outer_arguments(p, run=False)
    p.add_argument(
        "--placement",
        choices=("even", "auto"),
        help="split work evenly or by measured speed (default auto when a compute report is available)",
    )


_write_json = write_json_atomic


def _serve(args, con, model, ranks, lm) -> int:
    """`--mode serve`: the candidate splits for --concurrency requests (planner/serve.py)."""
    from smoltrain.planner import serve

    doc = serve.plan(
        model,
        ranks,
        lm,
        strategy=args.strategy,
        dtype=args.dtype,
        concurrency=args.concurrency,
        max_batch=args.max_batch,
        seq=args.seq,
    )
    serve.render(con, doc)
    best = next(c for c in doc["candidates"] if c["name"] == doc["best"])
    con.print(f"  best here: [bold]{best['name']}[/], {best['tokens_per_s']:,.1f} tokens/s for all requests")
    if args.json:
        _write_json(args.json, doc)
    return 0


class _ReportHost:
    """A rank known only from a links report: its name and device profile."""

    def __init__(self, name: str, device: str | None):
        self.name, self.device, self.local, self.link_rate_mbit, self.vars = name, device or "generic", False, None, {}


def _hosts(args, links_doc):
    """Hosts in rank order: the inventory's (coordinator first), else the links report's."""
    if args.inventory:
        from smolnet.inventory import load_inventory

        inv = load_inventory(args.inventory)
        return [inv.coordinator] + [h for h in inv.hosts if h.name != inv.coordinator.name]
    if links_doc is not None:
        from smoltrain.planner.devices import DEVICES

        out = []
        for h in links_doc.get("hosts") or []:
            dev = h.get("device") if h.get("device") in DEVICES else "generic"
            out.append(_ReportHost(h["name"], dev))
        if not out:
            from smoltrain.planner.links import report_hosts

            out = [_ReportHost(n, None) for n in report_hosts(links_doc)]
        return out
    return None


def run(args) -> int:
    from rich.console import Console

    from smoltrain.models.spec import ModelSpecError, get_model
    from smoltrain.planner import STRATEGIES, render
    from smoltrain.planner.devices import get_link_class, load_calibration
    from smoltrain.planner.links import read_report
    from smoltrain.planner.plan import (
        busy_ranks,
        link_model,
        make_plan,
        resolve_ranks,
        share_machine,
        what_if,
        what_if_sentence,
    )

    con = Console()
    run_doc = None
    if args.compare:
        from smoltrain.planner.compare import read_run, run_request

        run_doc = read_run(args.compare)
        req = run_request(run_doc)
        args.strategy = args.strategy or req["strategy"]
        if args.strategy != req["strategy"]:
            raise UsageError(f"--strategy {args.strategy} differs from the run's {req['strategy']}")
        args.model, args.world, args.dtype = req["model"], req["world"], req["dtype"]
        args.batch, args.seq, args.microbatches, args.mode = req["batch"], req["seq"], req["microbatches"], "train"
        if req["strategy"] in STRATEGIES and registry.get(req["strategy"]).outer_steps:
            args.inner_steps, args.sync_dtype = req["inner_steps"], req["sync_dtype"] or args.sync_dtype
    if args.mode == "serve":
        args.strategy = args.strategy or "pp"
        if args.strategy not in ("pp", "tp"):
            raise UsageError(f"--mode serve splits a group of hosts with pp or tp, not {args.strategy}")
    if not args.strategy:
        raise UsageError(f"--strategy is required ({', '.join(registry.names())} or all)")
    if args.strategy != "all" and args.strategy not in STRATEGIES:
        raise UsageError(f"unknown strategy {args.strategy!r} (one of {', '.join(STRATEGIES)}, or all)")
    try:
        model = get_model(args.model)
    except ModelSpecError as e:
        raise UsageError(str(e)) from None
    if args.link_class:
        get_link_class(args.link_class)
    links_doc = read_report(args.links) if args.links else None
    hosts = _hosts(args, links_doc)
    if run_doc is not None and hosts is None:
        from smoltrain.planner.compare import is_local_names, run_hosts

        names = run_hosts(run_doc)
        if not is_local_names(names):
            hosts = [_ReportHost(n, None) for n in names]
    run_placement = ((run_doc or {}).get("config") or {}).get("placement") or (run_doc or {}).get("placement")
    if run_placement and hosts is not None:  # the run's ranks, in its order
        from smoltrain.planner.plan import in_placement_order

        hosts = in_placement_order(hosts, run_placement)
    world = args.world or (len(hosts) if hosts else 2)
    if world < 1:
        raise UsageError(f"--world must be positive, got {world}")
    if hosts is not None and world > len(hosts):
        raise UsageError(f"--world {world} is larger than the {len(hosts)} hosts available")
    calibration = load_calibration(args.calibration, required=bool(args.calibration))
    ranks = resolve_ranks(world, hosts, calibration)
    from smoltrain.planner import compute as measured

    ranks, compute_source = measured.apply(
        ranks, hosts[:world] if hosts else None, getattr(args, "compute", None), model
    )
    if run_doc is not None and hosts is None and world > 1:  # a --local run: ranks share this machine
        ranks = share_machine(ranks, busy=busy_ranks(args.strategy, world, args.microbatches, args.mode))
    lm = link_model([r.name for r in ranks], hosts[:world] if hosts else None, links_doc, args.link_class)
    if args.mode == "serve":
        return _serve(args, con, model, ranks, lm)
    from smoltrain.planner import diloco, diloco_verdict

    outer_steps = args.strategy == "all" or registry.get(args.strategy).outer_steps
    diloco.check_args(args, outer_steps)
    outer = {"inner_steps": args.inner_steps, "sync_dtype": args.sync_dtype, "target_comm": args.target_comm}
    kw = dict(dtype=args.dtype, batch=args.batch, seq=args.seq, microbatches=args.microbatches, mode=args.mode)
    kw["outer"] = outer
    if args.mode == "infer":
        kw.update(quantize=getattr(args, "quantize", None), wire_dtype=getattr(args, "wire_dtype", None))
    from smoltrain.planner import placement_plan

    compute_doc = placement_plan.load_compute(getattr(args, "compute", None))
    placement_mode = getattr(args, "placement", None)

    def replan_for(strategy):
        return lambda placement: make_plan(strategy, model, world, ranks=ranks, lm=lm, placement=placement, **kw)

    if args.strategy == "all":
        plans, skipped = [], []
        for s in STRATEGIES:
            try:
                plans.append(make_plan(s, model, world, ranks=ranks, lm=lm, **kw))
            except UsageError as e:
                skipped.append({"strategy": s, "reason": str(e)})
        if not plans:
            raise UsageError(f"no strategy can run this: {skipped[0]['reason']}")
        render.ranking_table(con, plans, skipped)
        for p in plans:
            placement_plan.attach(p, placement_mode, compute_doc, model, hosts, lm, replan_for(p["strategy"]))
        placed_ranking = placement_plan.ranking(con, plans)
        best = render.rank_plans(plans)[0]
        con.print(
            f"  best here: [bold]{best['strategy']}[/], {best['tokens_per_s']:,.1f} tokens/s, "
            f"bottleneck {best['bottleneck']}"
        )
        by_name = {p["strategy"]: p for p in plans}

        def replan_outer(strategy, opts):
            placement = diloco_verdict.chosen_placement(by_name[strategy])
            return make_plan(strategy, model, world, ranks=ranks, lm=lm, placement=placement, **dict(kw, outer=opts))

        low_comm = (
            diloco_verdict.low_comm_verdict(plans, replan_outer, args.target_comm) if args.mode == "train" else None
        )
        if low_comm:
            con.print(f"  [bold]low communication:[/] {low_comm['sentence']}")
        if args.json:
            _write_json(
                args.json,
                {
                    "schema": "smoltrain.plans/1",
                    "ranking": [p["strategy"] for p in render.rank_plans(plans)],
                    "ranking_placed": placed_ranking,
                    "plans": plans,
                    "skipped": skipped,
                    **({"low_communication": low_comm} if low_comm else {}),
                },
            )
        if args.chart:
            render.chart(plans, args.chart)
        return 0

    plan = make_plan(args.strategy, model, world, ranks=ranks, lm=lm, **kw)
    if run_placement:  # --compare: the run's exact split, not what a fresh choice would be
        plan = placement_plan.from_run(plan, run_placement, replan_for(args.strategy))
    else:
        plan = placement_plan.placed(plan, placement_mode, compute_doc, model, hosts, lm, replan_for(args.strategy))
    sec = plan.get("placement")
    render.summary(con, plan)
    con.print(f"  compute: {compute_source}; [bold]verdict:[/] {plan['verdict']}")
    render.links_table(con, plan)
    render.memory_table(con, plan)
    if sec is not None and "error" in sec:
        con.print(f"  [bold yellow]placement: {sec['error']}[/]")
    elif sec is not None and not run_placement:
        placement_plan.render(con, sec)
    for n in plan["notes"]:
        con.print(f"  [dim]note: {n}[/]")
    if not args.no_what_if:
        rows = what_if(args.strategy, model, world, ranks, **kw)
        plan["what_if"] = rows
        render.what_if_table(con, rows, what_if_sentence(plan, rows))
    out = plan
    if run_doc is not None:
        from smoltrain.planner.compare import compare
        from smoltrain.planner.compare import render as render_cmp

        out = compare(plan, run_doc)
        render_cmp(con, out)
    if args.json:
        _write_json(args.json, out)
    if args.chart:
        render.chart([plan], args.chart)
    return 0
