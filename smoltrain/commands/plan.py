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
        "--wire-dtype", choices=("fp32", "bf16", "fp16", "int8"), help="--mode infer, serve: hidden states on the wire"
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
    p.add_argument(
        "--warmup",
        type=validate.count(10**6, lo=0),
        metavar="N",
        help="--compare: leave out the first N steps (default max(2, a quarter of the steps), for every strategy)",
    )
    p.add_argument(
        "--local",
        type=validate.RANKS,
        metavar="N",
        help="N ranks on this machine, sharing its cores (what `run --local N` plans)",
    )
    p.add_argument("--no-what-if", action="store_true", help="skip the table over link classes")
    from smoltrain.planner.diloco import add_arguments as outer_arguments

    outer_arguments(p, run=False)
    p.add_argument(
        "--placement",
        choices=("even", "auto"),
        help="split work evenly or by measured speed (default auto when a compute report is available)",
    )


_write_json = write_json_atomic


def _serve(args, con, model, ranks, lm, placement: str) -> int:
    """`--mode serve`: the candidate splits for --concurrency requests (planner/serve.py);
    `placement`: how a pp group cuts its layers, as `serve` would."""
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
        placement=placement,
        wire=getattr(args, "wire_dtype", None),
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


def request(args, run_doc=None):
    """The PlanRequest these arguments describe (a run's own, with --compare)."""
    from smoltrain.planner.links import read_report
    from smoltrain.planner.request import PlanRequest

    if args.link_class:
        from smoltrain.planner.devices import get_link_class

        get_link_class(args.link_class)
    if args.local is not None and (args.inventory or args.world):
        raise UsageError("give --local N, or -i INVENTORY / --world N, not both")
    links_doc = read_report(args.links) if args.links else None
    hosts = _hosts(args, links_doc)
    local = args.local is not None
    placement = args.placement
    if run_doc is not None:
        from smoltrain.planner.compare import is_local_names, run_hosts

        names = run_hosts(run_doc)
        local = is_local_names(names)
        if hosts is None and not local:
            hosts = [_ReportHost(n, None) for n in names]
        placement = (run_doc.get("config") or {}).get("placement") or run_doc.get("placement") or placement
    world = args.local if local and args.local else args.world
    return PlanRequest(
        args.strategy,
        args.model,
        mode=args.mode,
        world=world,
        dtype=args.dtype,
        batch=args.batch,
        seq=args.seq,
        microbatches=args.microbatches,
        placement=placement,
        hosts=hosts,
        links=links_doc,
        link_class=args.link_class,
        compute=getattr(args, "compute", None),
        calibration=args.calibration or None,
        local=local,
        quantize=getattr(args, "quantize", None) if args.mode == "infer" else None,
        wire_dtype=getattr(args, "wire_dtype", None) if args.mode == "infer" else None,
        outer={"inner_steps": args.inner_steps, "sync_dtype": args.sync_dtype, "target_comm": args.target_comm},
    )


def run(args) -> int:
    from dataclasses import replace

    from rich.console import Console

    from smoltrain.planner import STRATEGIES, placement_plan, render
    from smoltrain.planner.plan import what_if, what_if_sentence
    from smoltrain.planner.request import build_plan, resolve

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
    elif args.warmup is not None:
        raise UsageError("--warmup applies to --compare RUN.json")
    if args.mode == "serve":
        args.strategy = args.strategy or "pp"
        if args.strategy not in ("pp", "tp"):
            raise UsageError(f"--mode serve splits a group of hosts with pp or tp, not {args.strategy}")
    if not args.strategy:
        raise UsageError(f"--strategy is required ({', '.join(registry.names())} or all)")
    if args.strategy != "all" and args.strategy not in STRATEGIES:
        raise UsageError(f"unknown strategy {args.strategy!r} (one of {', '.join(STRATEGIES)}, or all)")
    if args.mode == "serve":  # planner/serve.py places its own candidates on these ranks and links
        serve_req = replace(request(args, run_doc), strategy=args.strategy, mode="infer")
        st = resolve(serve_req)
        how = placement_plan.default_mode(args.placement, st.compute_source == "measured")
        return _serve(args, con, st.model, st.ranks, st.lm, how)
    from smoltrain.planner import diloco, diloco_verdict

    diloco.check_args(args, args.strategy == "all" or registry.get(args.strategy).outer_steps)
    req = request(args, run_doc)
    setting = resolve(req)

    if args.strategy == "all":
        plans, skipped = [], []
        for s in STRATEGIES:
            try:
                plans.append(build_plan(replace(req, strategy=s), setting))
            except UsageError as e:
                skipped.append({"strategy": s, "reason": str(e)})
        if not plans:
            raise UsageError(f"no strategy can run this: {skipped[0]['reason']}")
        render.ranking_table(con, plans, skipped)
        for p in plans:
            if (p.get("placement") or {}).get("error"):
                con.print(f"  [yellow]{p['strategy']}: placement: {p['placement']['error']}[/]")
        best = render.rank_plans(plans)[0]
        con.print(
            f"  best here: [bold]{best['strategy']}[/], {best['tokens_per_s']:,.1f} tokens/s, "
            f"bottleneck {best['bottleneck']} (each under its {best.get('placement_mode', 'even')} placement)"
        )
        ranking = [p["strategy"] for p in render.rank_plans(plans)]
        by_name = {p["strategy"]: p for p in plans}

        def replan_outer(strategy, opts):  # the same request, an outer-step setting, the chosen split
            placement = diloco_verdict.chosen_placement(by_name[strategy]) or "even"
            return build_plan(replace(req, strategy=strategy, outer=opts, placement=placement), setting)

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
                    "ranking": ranking,
                    "ranking_placed": ranking,  # every plan is already made under its placement
                    "plans": plans,
                    "skipped": skipped,
                    **({"low_communication": low_comm} if low_comm else {}),
                },
            )
        if args.chart:
            render.chart(plans, args.chart)
        return 0

    plan = build_plan(req, setting)
    sec = plan.get("placement")
    render.summary(con, plan)
    con.print(f"  compute: {plan['compute_source']}; [bold]verdict:[/] {plan['verdict']}")
    render.links_table(con, plan)
    render.memory_table(con, plan)
    if sec is not None and "error" in sec:
        con.print(f"  [bold yellow]placement: {sec['error']}[/]")
    elif sec is not None and run_doc is None:
        render.placement(con, sec)
    for n in plan["notes"]:
        con.print(f"  [dim]note: {n}[/]")
    if not args.no_what_if:
        kw = dict(dtype=req.dtype, batch=req.batch, seq=req.seq, microbatches=req.microbatches, mode=req.mode)
        if sec is not None and "order" in sec:
            kw["placement"] = placement_plan.place_dict(sec)
        rows = what_if(args.strategy, setting.model, len(setting.ranks), setting.ranks, **kw)
        plan["what_if"] = rows
        render.what_if_table(con, rows, what_if_sentence(plan, rows))
    out = plan
    if run_doc is not None:
        from smoltrain.planner.compare import compare
        from smoltrain.planner.compare import render as render_cmp

        out = compare(plan, run_doc, args.warmup)
        render_cmp(con, out)
    if args.json:
        _write_json(args.json, out)
    if args.chart:
        render.chart([plan], args.chart)
    return 0
