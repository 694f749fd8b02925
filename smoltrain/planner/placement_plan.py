"""Glue between placement and the commands: which speeds, which links, which mode, and the
plan's `placement` section (the chosen split, its predicted step next to `even`, the gain).

`plan` and `run` both call `choose`, so the run executes the placement the plan showed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from smolnet.errors import UsageError
from smoltrain import registry
from smoltrain.planner import compute
from smoltrain.planner.placement import MODES, Placement, PlacementError, place
from smoltrain.planner.speeds import host_speeds, source_of


def load_compute(path: str | None) -> dict | None:
    """The compute report: the given file (required), else reports/compute.json when present."""
    p = compute.default_path(path)
    return compute.read_compute(p) if p else None


def default_mode(mode: str | None, compute_doc: dict | None) -> str:
    return mode or ("auto" if compute_doc is not None else "even")


def link_fn(lm):
    """`link_s(src, dst, nbytes)` from a planner LinkModel (None: free links)."""
    if lm is None:
        return None

    def link_s(a, b, n):
        ln = lm.get(a, b)
        return ln.alpha_s + n / ln.bytes_per_s if ln.up else math.inf

    return link_s


def applies(strategy: str) -> bool:
    return registry.get(strategy).splits in ("batch", "layers", "heads")


def read_placement_file(path: str) -> dict:
    """A placement document, or a plan / run report that carries one."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"--placement {path}: not a readable placement JSON ({e})") from None
    if isinstance(doc, dict) and isinstance(doc.get("placement"), dict):
        doc = doc["placement"]
    Placement.from_dict(doc)
    return doc


def choose(
    strategy: str,
    mode: str,
    model,
    hosts,
    names: list[str],
    compute_doc,
    batch: int,
    seq: int,
    microbatches: int = 1,
    lm=None,
) -> tuple[Placement, dict]:
    """(placement, speeds by host name) for these hosts (inventory hosts or plain names)."""
    speeds = host_speeds(compute_doc, hosts if hosts else names, model)
    return place(strategy, mode, model, names, speeds, batch, seq, microbatches, link_fn(lm)), speeds


def predicted_of(plan: dict) -> dict:
    """What the placement section shows of a plan made under one placement."""
    return {
        "step_s": plan["step_s"],
        "tokens_per_s": plan["tokens_per_s"],
        "compute_s_per_rank": plan["compute_s_per_rank"],
        "comm_s": plan["comm_s_per_step"],
    }


def section(strategy: str, mode: str, model, hosts, names, compute_doc, batch, seq, microbatches, lm, replan) -> dict:
    """The plan's `placement`: the chosen split, why, and its predicted step next to the other
    mode's. `replan(placement) -> plan` is the planner under that placement (plan.make_plan),
    so the figures here are the plan's own."""
    mb = microbatches if registry.get(strategy).microbatched else 1
    chosen, speeds = choose(strategy, mode, model, hosts, names, compute_doc, batch, seq, mb, lm)
    ls = link_fn(lm)

    def figures(p: Placement) -> dict:
        return predicted_of(replan(p.to_dict()))

    out = chosen.to_dict()
    out["speed_source"] = source_of(speeds)
    out["speeds"] = [speeds[n].to_dict() for n in names]
    pred = {chosen.mode: figures(chosen)}
    other = "even" if chosen.mode == "auto" else "auto"
    try:
        pred[other] = figures(place(strategy, other, model, names, speeds, batch, seq, mb, ls))
    except PlacementError as e:
        pred[other] = {"error": str(e)}
    out["predicted"] = pred
    ev, au = pred.get("even", {}).get("step_s"), pred.get("auto", {}).get("step_s")
    out["speedup"] = ev / au if ev and au and math.isfinite(ev) and math.isfinite(au) else None
    return out


def render(con, sec: dict) -> None:
    """Who gets what and why, then the predicted step under even and auto."""
    con.print(f"  [bold]placement {sec['mode']}[/] ({sec['strategy']}, speeds {sec['speed_source']}):")
    for line in sec["why"]:
        con.print(f"    {line}")
    for e in sec.get("excluded") or []:
        con.print(f"    [yellow]{e['name']} gets nothing: {e['why']}[/]")
    for m in MODES:
        p = sec["predicted"].get(m) or {}
        if "error" in p:
            con.print(f"    {m:5s}: cannot place ({p['error']})")
        elif p and p.get("step_s") is None:
            con.print(f"    {m:5s}: no step time (a link is down)")
        elif p:
            con.print(f"    {m:5s}: {p['step_s'] * 1e3:8.2f} ms/step predicted, {p['tokens_per_s']:,.0f} tokens/s")
    if sec.get("speedup"):
        con.print(f"    auto vs even: {sec['speedup']:.2f}x")


def for_run(
    strategy: str,
    mode_arg: str | None,
    compute_path: str | None,
    model,
    names: list[str],
    hosts,
    batch: int,
    seq: int,
    microbatches: int,
    legacy_shares=None,
) -> dict | None:
    """The placement `smoltrain run` executes (a dict for RunConfig), or None to keep --shares."""
    if mode_arg and mode_arg not in MODES:
        doc = read_placement_file(mode_arg)
        missing = [n for n in doc["order"] if n not in names]
        if missing:
            raise UsageError(
                f"--placement {mode_arg}: hosts {', '.join(missing)} are not ranks of this run ({', '.join(names)})"
            )
        return doc
    if not applies(strategy):
        return None
    if legacy_shares:
        if mode_arg:
            raise UsageError("give --placement or --shares, not both")
        return None
    compute = load_compute(compute_path)
    lm = None
    if hosts is not None:
        from smoltrain.planner.links import find_report
        from smoltrain.planner.plan import link_model

        lm = link_model(names, hosts, find_report(names))
    mb = microbatches if registry.get(strategy).microbatched else 1
    placement, _ = choose(strategy, default_mode(mode_arg, compute), model, hosts, names, compute, batch, seq, mb, lm)
    return placement.to_dict()


def attach(plan: dict, mode_arg: str | None, compute_doc, model, hosts, lm, replan) -> dict | None:
    """Add the `placement` section to a train plan of a strategy that splits work (else leave
    it); a placement that cannot fit is recorded as an error, not raised: the plan says why."""
    strategy = plan["strategy"]
    if plan["mode"] != "train" or strategy not in registry.REGISTRY or not applies(strategy):
        return None
    world = plan["world_size"]
    names = [r["name"] for r in plan["ranks"]]
    try:
        sec = section(
            strategy,
            default_mode(mode_arg, compute_doc),
            model,
            hosts[:world] if hosts else None,
            names,
            compute_doc,
            plan["batch"],
            plan["seq"],
            plan["microbatches"],
            lm,
            replan,
        )
    except PlacementError as e:
        sec = {"mode": default_mode(mode_arg, compute_doc), "strategy": strategy, "error": str(e)}
    plan["placement"] = sec
    return sec


def placed(plan: dict, mode_arg: str | None, compute_doc, model, hosts, lm, replan) -> dict:
    """The plan remade under the placement it shows (`replan(placement) -> plan`), with that
    `placement` section: so `plan --placement auto` predicts the run that `run --placement
    auto` executes, not the even split."""
    sec = attach(plan, mode_arg, compute_doc, model, hosts, lm, replan)
    if sec is None or "error" in sec:
        return plan
    keep = ("mode", "strategy", "order", "shares", "layers", "heads", "ffn")
    out = replan({k: sec[k] for k in keep if k in sec})
    out["placement"] = sec
    return out


def from_run(plan: dict, run_placement: dict, replan) -> dict:
    """The plan remade under a finished run's placement (plan --compare): its exact split."""
    out = replan(run_placement)
    out["placement"] = dict(run_placement, predicted={run_placement.get("mode", "even"): predicted_of(out)})
    return out


def placed_tokens_per_s(plan: dict) -> float:
    """The plan's tokens/s under its best placement (the placement's gain over even applied)."""
    sec = plan.get("placement") or {}
    pred = sec.get("predicted") or {}
    steps = [p.get("step_s") for p in pred.values() if p.get("step_s")]
    even = (pred.get("even") or {}).get("step_s")
    if not steps or not even:
        return plan.get("tokens_per_s") or 0.0
    return (plan.get("tokens_per_s") or 0.0) * even / min(steps)


def ranking(con, plans: list[dict]) -> list[str]:
    """Strategies ranked by tokens/s under their best placement, printed as a short table."""
    rows = sorted(plans, key=lambda p: -placed_tokens_per_s(p))
    con.print("  [bold]under the best placement[/] (even vs auto, by measured speed where known):")
    for p in rows:
        sec = p.get("placement") or {}
        gain = sec.get("speedup")
        best = "auto" if gain and gain > 1.0 else "even"
        extra = f", auto {gain:.2f}x even" if gain else (f" ({sec['error']})" if sec.get("error") else "")
        con.print(f"    {p['strategy']:7s} {placed_tokens_per_s(p):>12,.1f} tokens/s  ({best}{extra})")
    return [p["strategy"] for p in rows]
