"""`smoltrain plan`: bytes per token, step time and the bottleneck, before anything runs."""

from __future__ import annotations

from smolnet.errors import UsageError
from smolnet.files import write_json_atomic
from smoltrain import registry, validate

MODELS_HELP = "tiny, gpt2-124m, llama-3.2-1b, llama-3.1-8b, mixtral-8x7b, or a .json shape"


def add_arguments(p) -> None:
    p.add_argument("--strategy", help=", ".join(registry.names()) + ", or all (rank them)")
    p.add_argument(
        "--mesh",
        metavar="AXIS=N,...|auto",
        help="a mesh's bytes and step time, e.g. pp=2,tp=2; auto ranks every layout",
    )
    p.add_argument("--mode", default="train", choices=("train", "infer", "serve"))
    p.add_argument("--model", default="tiny", help=MODELS_HELP)
    p.add_argument("--world", type=validate.RANKS, help="ranks (default: inventory hosts, links-report hosts, else 2)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument(
        "--quantize",
        choices=("int8", "q4"),
        help="--mode infer: weights at this width (contract §9); train: the frozen LoRA base's (QLoRA, plan only)",
    )
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
    from smoltrain.finetune.tuning import add_arguments as tuning_arguments

    tuning_arguments(p)
    from smoltrain.planner.diloco import add_arguments as outer_arguments

    outer_arguments(p, run=False)
    p.add_argument(
        "--placement",
        choices=("even", "auto"),
        help="split work evenly or by measured speed (default auto when a compute report is available)",
    )


_write_json = write_json_atomic


def request(o: dict, run_doc=None):
    """The PlanRequest the parsed options `o` describe (a run's own, with --compare); here, not in
    the planner, because a LoRA request reads its model with torch (finetune.tuning)."""
    from smoltrain.planner import selection
    from smoltrain.planner.links import read_report
    from smoltrain.planner.request import PlanRequest

    if o["link_class"]:
        from smoltrain.planner.devices import get_link_class

        get_link_class(o["link_class"])
    if o["local"] is not None and (o["inventory"] or o["world"]):
        raise UsageError("give --local N, or -i INVENTORY / --world N, not both")
    links_doc = read_report(o["links"]) if o["links"] else None
    named = selection.hosts(o["inventory"], links_doc)
    local = o["local"] is not None
    placement = o["placement"]
    if run_doc is not None:
        from smoltrain.planner.compare import is_local_names, run_hosts

        names = run_hosts(run_doc)
        local = is_local_names(names)
        if named is None and not local:
            named = [selection.ReportHost(n, None) for n in names]
        placement = (run_doc.get("config") or {}).get("placement") or run_doc.get("placement") or placement
    infer = o["mode"] == "infer"
    from smoltrain.finetune.tuning import from_options
    from smoltrain.planner.request import model_of

    model = model_of(o["model"])
    return PlanRequest(
        o["strategy"],
        model,
        mode=o["mode"],
        world=o["local"] if local and o["local"] else o["world"],
        dtype=o["dtype"],
        batch=o["batch"],
        seq=o["seq"],
        microbatches=o["microbatches"],
        placement=placement,
        hosts=named,
        links=links_doc,
        link_class=o["link_class"],
        compute=o.get("compute"),
        calibration=o["calibration"] or None,
        local=local,
        quantize=o.get("quantize") if infer else None,
        wire_dtype=o.get("wire_dtype") if infer else None,
        outer={"inner_steps": o["inner_steps"], "sync_dtype": o["sync_dtype"], "target_comm": o["target_comm"]},
        tuning=from_options(model, o) if o["mode"] == "train" else None,
    )


def run(args) -> int:
    """Parse, choose through planner/selection.py, print and write; `args` is left as parsed."""
    from argparse import Namespace

    from rich.console import Console

    from smoltrain.planner import diloco, render, selection
    from smoltrain.planner.request import resolve

    con = Console()
    o, run_doc = dict(vars(args)), None
    if o.get("mesh"):
        return _mesh(con, o)
    if args.compare:
        from smoltrain.planner.compare import read_run

        run_doc = read_run(args.compare)
        o.update(selection.from_run(run_doc, args.strategy))
        if compare_mesh_run(con, o, run_doc):
            return 0
    elif args.warmup is not None:
        raise UsageError("--warmup applies to --compare RUN.json")
    o["strategy"] = selection.strategy_for(o["strategy"], o["mode"])
    if o["mode"] == "serve":  # planner/serve.py places its own candidates on these ranks and links
        doc = selection.serve(request(o, run_doc), o["concurrency"], o["max_batch"], o.get("wire_dtype"))
        from smoltrain.planner import serve

        serve.render(con, doc)
        best = next(c for c in doc["candidates"] if c["name"] == doc["best"])
        con.print(f"  best here: [bold]{best['name']}[/], {best['tokens_per_s']:,.1f} tokens/s for all requests")
        if o["json"]:
            _write_json(o["json"], doc)
        return 0
    from smoltrain import registry

    ns = Namespace(**o)  # the outer-step flags checked and their defaults filled on a copy
    diloco.check_args(ns, o["strategy"] == "all" or registry.get(o["strategy"]).outer_steps)
    o = vars(ns)
    req = request(o, run_doc)
    setting = resolve(req)
    from smoltrain.planner import setups

    if o["strategy"] == "all":
        doc = selection.ranking(req, setting, o["target_comm"])
        from smoltrain.planner.mesh_search import beside_strategies

        beside_strategies(doc, req)  # the best meshes under `meshes`, where the world allows one
        words = setups.review(doc, req, setting) if setups.applies(req) and run_doc is None else None
        _all(con, o, doc)
        if words:
            con.print(f"  [bold]fine-tuning:[/] {words}")
        return 0
    plan = selection.one(req, setting, what_if=not o["no_what_if"])
    words = setups.review(plan, req, setting) if setups.applies(req) and run_doc is None else None
    _show(con, plan, compare=run_doc is not None)
    if words:
        con.print(f"  [bold]fine-tuning:[/] {words}")
    out = plan
    if run_doc is not None:
        from smoltrain.planner.compare import compare
        from smoltrain.planner.compare import render as render_cmp

        out = compare(plan, run_doc, o["warmup"])
        render_cmp(con, out)
    if o["json"]:
        _write_json(o["json"], out)
    if o["chart"]:
        render.chart([plan], o["chart"])
    return 0


def compare_mesh_run(con, o: dict, run_doc: dict) -> bool:
    """plan --compare on a mesh run (two axes or more): its layout on its hosts, as `plan --mesh`
    times it, against the run (planner.compare.compare_mesh); False for a 1-D run."""
    from smoltrain.planner import compare, mesh_render, mesh_search
    from smoltrain.planner.request import resolve

    if compare.run_mesh(run_doc) is None:
        return False
    req = compare.mesh_request(mesh_search.mesh_request(request(dict(o, strategy="tp"), run_doc)), run_doc)
    out = compare.compare_mesh(req, resolve(req), run_doc, o["warmup"])
    mesh_render.layout(con, out["plan"], out["plan"]["meshes"][0])
    compare.render(con, out)
    if o["json"]:
        _write_json(o["json"], out)
    return True


def _mesh(con, o: dict) -> int:
    """plan --mesh AXIS=N,...|auto: each layout's bytes per link, step time and bottleneck on
    these hosts and links, ranked (planner.mesh_search; docs/mesh.md)."""
    from smoltrain.planner import mesh_render, mesh_search
    from smoltrain.planner.request import resolve

    if o["strategy"] or o["mode"] != "train" or o["compare"]:
        raise UsageError("plan --mesh: a training step's layouts (no --strategy, --mode or --compare)")
    req = mesh_search.mesh_request(request(dict(o, strategy="tp", world=mesh_search.world_of(o))))
    setting = resolve(req)
    how = o["placement"] or "auto"
    if o["mesh"] == "auto":
        doc = mesh_search.search(req, setting, how)
        mesh_render.ranking(con, doc)
    else:
        doc = mesh_search.explicit(req, setting, o["mesh"], how)
        mesh_render.layout(con, doc, doc["meshes"][0])
    if o["json"]:
        _write_json(o["json"], doc)
    return 0


def _show(con, plan: dict, compare: bool) -> None:
    """One plan as the command prints it."""
    from smoltrain.planner import render
    from smoltrain.planner.plan import what_if_sentence

    sec = plan.get("placement")
    render.summary(con, plan)
    con.print(f"  compute: {plan['compute_source']}; [bold]verdict:[/] {plan['verdict']}")
    render.links_table(con, plan)
    render.memory_table(con, plan)
    if sec is not None and "error" in sec:
        con.print(f"  [bold yellow]placement: {sec['error']}[/]")
    elif sec is not None and not compare:
        render.placement(con, sec)
    for n in plan["notes"]:
        con.print(f"  [dim]note: {n}[/]")
    if "what_if" in plan:
        render.what_if_table(con, plan["what_if"], what_if_sentence(plan, plan["what_if"]))


def _all(con, o: dict, doc: dict) -> int:
    """`--strategy all` as the command prints and writes it."""
    from smoltrain.planner import render

    plans = doc["plans"]
    render.ranking_table(con, plans, doc["skipped"])
    for p in plans:
        if (p.get("placement") or {}).get("error"):
            con.print(f"  [yellow]{p['strategy']}: placement: {p['placement']['error']}[/]")
    best = render.rank_plans(plans)[0]
    con.print(
        f"  best here: [bold]{best['strategy']}[/], {best['tokens_per_s']:,.1f} tokens/s, "
        f"bottleneck {best['bottleneck']} (each under its {best.get('placement_mode', 'even')} placement)"
    )
    if doc.get("meshes"):
        from smoltrain.planner import mesh_render

        con.print(f"  [bold]verdict:[/] {mesh_render.beside(con, doc, best)}")
    if doc.get("low_communication"):
        con.print(f"  [bold]low communication:[/] {doc['low_communication']['sentence']}")
    if o["json"]:
        _write_json(o["json"], doc)
    if o["chart"]:
        render.chart(plans, o["chart"])
    return 0
