"""The plan a run shows before it starts and records beside what it measured, and the
placement it executes: both from one planner.request.build_plan, so the run does exactly
what its plan describes.

Placement is not advice: a model that fits nowhere, or a ring that can only cross a down
link, is refused before anything starts (PlacementError, exit 2), as are inputs the plan
cannot read. Anything else going wrong in the planner does not stop the run, but it is not
hidden either: the run says so and its report carries `plan_error`.
"""

from __future__ import annotations

from dataclasses import dataclass

from smolnet.errors import UsageError
from smoltrain import registry
from smoltrain.planner.placement import MODES

KEEP = ("mode", "strategy", "order", "shares", "layers", "heads", "ffn", "excluded", "why")


@dataclass
class RunPlan:
    placement: dict | None  # what the run executes (None: the even split, or --shares)
    plan: dict | None
    error: str | None = None  # why there is no plan


def request(args, spec, names: list[str], hosts):
    """The PlanRequest of this run (`plan` builds the same from the same arguments)."""
    from smoltrain.finetune.tuning import from_options
    from smoltrain.planner.placement import read_placement_file
    from smoltrain.planner.request import PlanRequest

    placement = args.placement
    if placement and placement not in MODES:
        placement = read_placement_file(placement)
        missing = [n for n in placement["order"] if n not in names]
        if missing:
            raise UsageError(
                f"--placement {args.placement}: hosts {', '.join(missing)} are not ranks of this run "
                f"({', '.join(names)})"
            )
    if args.shares:
        if args.placement:
            raise UsageError("give --placement or --shares, not both")
        shares = [float(x) for x in args.shares.split(",")]
        placement = {"mode": "even", "strategy": args.strategy, "order": list(names), "shares": shares}
    links = None
    if args.links:
        from smoltrain.run.preflight import load_links

        links = load_links(args.links)
    return PlanRequest(
        args.strategy,
        spec,
        world=len(names),
        batch=args.batch,
        seq=args.seq,
        microbatches=args.microbatches,
        placement=placement,
        hosts=hosts,
        links=links,
        compute=getattr(args, "compute", None),
        local=hosts is None,
        strict=True,
        compute_dtype=getattr(args, "dtype", None),  # bf16 matmuls; weights, gradients and the wire stay fp32
        outer={k: getattr(args, k, None) for k in ("inner_steps", "sync_dtype", "target_comm")},
        tuning=from_options(spec, vars(args)),  # LoRA: the adapters' bytes and memory
    )


def plan_run(args, spec, names: list[str], hosts, console) -> RunPlan:
    from smoltrain.planner.placement import PlacementError

    req = request(args, spec, names, hosts)
    fallback = req.placement if isinstance(req.placement, dict) and not args.shares else None
    try:
        from smoltrain.planner.request import build_plan

        plan = build_plan(req)
    except (PlacementError, UsageError):
        raise
    except Exception as e:  # a planner bug must not stop training, nor pass in silence
        error = f"{type(e).__name__}: {e}"
        console.print(f"[bold red]plan failed: {error}; the run goes on without a prediction (report: plan_error)")
        return RunPlan(fallback, None, error)
    sec = plan.get("placement")
    placed = {k: sec[k] for k in KEEP if k in sec} if sec and "order" in sec and not args.shares else None
    paced = plan.get("paced") if placed is not None and registry.get(args.strategy).outer_steps else None
    if paced:  # diloco paces its first outer step by it (planner.pacing), as the plan predicts
        placed["compute_s"] = list(paced["placed_compute_s"])
    if placed is not None:
        for line in placed.get("why") or []:
            console.print(f"placement {placed['mode']}: {line}")
        for e in placed.get("excluded") or []:
            console.print(f"[bold yellow]placement: {e['name']} gets nothing: {e['why']}")
    if plan["step_s"] is None:  # a down link no order avoids (a placement file's order, say)
        raise UsageError(f"{args.strategy} cannot run here: {plan.get('bottleneck_where')}")
    console.print(
        f"plan: {plan['step_s'] * 1e3:.1f} ms/step predicted, bottleneck "
        f"{plan['bottleneck']} ({plan.get('bottleneck_where')}), "
        f"{plan['bytes_per_step'] / 1e6:.2f} MB/step on the busiest rank"
    )
    if plan["bottleneck"] == "capacity":
        console.print(f"[bold yellow]warning: the model does not fit: {plan.get('bottleneck_where')}")
    elif plan["bottleneck"] in ("link", "latency"):
        console.print(f"[bold yellow]warning: communication will dominate: {plan.get('bottleneck_where')}")
    return RunPlan(placed, plan)
