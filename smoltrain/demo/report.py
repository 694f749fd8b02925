"""The demo's REPORT.md: one self-contained page beside its pictures, written from the
documents the stages left (plans.json, each run's `plan --compare`, the generate reports).

Every predicted number comes from those documents, so from the one plan builder
(planner/request.py); each section states the model and batch its plans and runs share,
and the report checks that its tables agree (the compare's prediction for a run is the
plan table's for the same request) and says so.
"""

from __future__ import annotations

import json
from pathlib import Path

from smolnet.errors import UsageError
from smoltrain.demo import flow, pictures
from smoltrain.planner.bottleneck import human_bytes, human_s


def _load(path: Path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _ms(s) -> str:
    return human_s(s) if isinstance(s, (int, float)) else "-"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "-"


def _links_section(folder: Path, prefix: str) -> list[str]:
    lines = []
    if (folder / "links.png").exists():
        lines += [f"![link heatmap]({prefix}links.png)", ""]
    if (folder / "links.md").exists():
        body = (folder / "links.md").read_text().splitlines()
        if body and body[0].startswith("# "):
            body = body[1:]
        lines += ["#" + ln if ln.startswith("#") else ln for ln in body] + [""]
    return lines


QUICK_LINKS = "--quick: measured once, after provisioning (the full demo also measures the links as found)."


def links(out: Path, quick: bool = False) -> list[str]:
    before = out / "before"
    if not (before / "links.md").exists():
        return ["## 1. Links", ""] + ([QUICK_LINKS, ""] if quick else []) + _links_section(out, "")
    return (
        ["## 1. Links as found", "", "Measured before provisioning: the faults a new cluster really has.", ""]
        + _links_section(before, "before/")
        + ["## 1b. Links after provisioning", "", "Measured again after `make provision` set and verified the MTU.", ""]
        + _links_section(out, "")
    )


def plan_table(out: Path) -> tuple[list[str], dict]:
    doc = _load(out / "plans.json") or {}
    plans = {p["strategy"]: p for p in doc.get("plans", [])}
    lines = [
        f"## 2. Plan: every strategy ({flow.MODEL}, batch {flow.BATCH} x {flow.SEQ}, {flow.MICRO} microbatches "
        "where pipelined; measured links and compute; each under its placement)",
        "",
    ]
    if (out / "plan.png").exists():
        lines += ["![plan chart](plan.png)", ""]
    lines += [
        "| strategy | placement | bytes/token | step | tokens/s | bottleneck | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in doc.get("ranking", []):
        p = plans[s]
        lines.append(
            f"| {s} | {p.get('placement_mode', 'even')} | {human_bytes(p['bytes_per_token'])} | {_ms(p['step_s'])} | "
            f"{p['tokens_per_s'] or 0:,.0f} | {p['bottleneck']} | {p.get('verdict', '')} |"
        )
    return lines + [""], plans


def nominal_step(strategy: str, plan: dict, inv, links) -> float | None:
    """The same run planned on device profiles (no compute report): what calibration buys."""
    from smolnet.inventory import load_inventory
    from smoltrain.planner.request import PlanRequest, build_plan

    i = load_inventory(str(inv))
    hosts = [i.coordinator] + [h for h in i.hosts if h.name != i.coordinator.name]
    req = PlanRequest(
        strategy,
        plan["model"]["name"],
        batch=plan["batch"],
        seq=plan["seq"],
        microbatches=plan["microbatches"],
        placement=plan.get("placement") or "even",
        hosts=hosts,
        links=_load(links),
        compute=False,
        calibration=False,
        single=False,
    )
    return build_plan(req)["step_s"]


def runs(demo, trained: list[str], plans: dict) -> list[str]:
    out = demo.out
    docs = {s: r for s in trained if (r := _load(out / f"run-{s}.json"))}
    cmps = {s: c for s in trained if (c := _load(out / f"compare-{s}.json"))}
    lines = [
        f"## 3. Training runs ({flow.MODEL}, batch {flow.BATCH} x {flow.SEQ}, {demo.steps} steps, "
        "placed by measured speed)",
        "",
    ]
    if pictures.loss_chart(docs, out / "loss.png"):
        lines += ["![loss curves](loss.png)", ""]
    lines += [
        "| strategy | backend | world | steps | final loss | tokens/s (after warm-up) |",
        "|---|---|---|---|---|---|",
    ]
    for s, r in docs.items():
        tps = (cmps.get(s) or {}).get("tokens_per_s", {}).get("measured")
        lines.append(
            f"| {s} | {r.get('backend')} | {r.get('world_size')} | {len(r.get('steps', []))} "
            f"| {r.get('final_loss') or float('nan'):.4f} | {tps or 0:,.0f} |"
        )
    warm = next(iter(cmps.values()), {})
    lines += [
        "",
        "## 4. Predicted vs measured (the runs above, `plan --compare`: times are the median after the first "
        f"{warm.get('warmup_steps', '?')} of {warm.get('steps', '?')} steps, a warm-up fixed in advance)",
        "",
        "| strategy | predicted (plan table) | predicted (compare) | measured | measured/predicted | "
        "device profiles | bottleneck | missed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    disagree = []
    for s, c in cmps.items():
        pred, table = c["step_s"]["predicted"], (plans.get(s) or {}).get("step_s")
        if table is None or pred is None or abs(pred - table) > 1e-9 * max(pred, table):
            disagree.append(s)
        try:
            nominal = nominal_step(s, c["plan"], demo.inv, demo.links)
        except UsageError:  # the inventory is gone (a demo that failed early): the column stays empty
            nominal = None
        lines.append(
            f"| {s} | {_ms(table)} | {_ms(pred)} | {_ms(c['step_s']['measured'])} | "
            f"{_ratio(c['step_s']['measured'], pred)} | {_ms(nominal)} | {c['plan']['bottleneck']} | "
            f"{'; '.join(c.get('missed') or []) or '-'} |"
        )
    lines += [
        "",
        "The plan table and the compares agree for every strategy."
        if not disagree
        else f"**The plan table and the compare disagree for {', '.join(disagree)}.**",
        "",
        "Bytes per step on each link (tensor payload):",
        "",
        "| strategy | link | predicted | measured | measured/predicted |",
        "|---|---|---|---|---|",
    ]
    for s, c in cmps.items():
        for ln in c["links"]:
            lines.append(
                f"| {s} | {ln['src']} -> {ln['dst']} | {human_bytes(ln['predicted_bytes_per_step'])} | "
                f"{human_bytes(ln['measured_bytes_per_step'])} | {_ratio(ln['measured_bytes_per_step'], ln['predicted_bytes_per_step'])} |"  # noqa: E501
            )
    return lines + [""]


def placement_rows(out: Path, strategies: list[str]) -> list[dict]:
    rows = []
    for s in strategies:
        sec = (_load(out / f"plan-placement-{s}.json") or {}).get("placement") or {}
        row = {"strategy": s, "plan": sec}
        for mode in ("even", "auto"):
            c, r = _load(out / f"compare-placement-{s}-{mode}.json"), _load(out / f"run-placement-{s}-{mode}.json")
            if c and r:
                row[mode] = {
                    "predicted": c["tokens_per_s"]["predicted"],
                    "measured": c["tokens_per_s"]["measured"],
                    "placement": r.get("placement") or {},
                    "section": (sec.get("predicted") or {}).get(mode, {}).get("tokens_per_s"),
                }
        rows.append(row)
    return rows


def placement(out: Path, strategies: list[str]) -> list[str]:
    rows = placement_rows(out, strategies)
    lines = [
        f"## 5. Placement by measured speed ({flow.MODEL}, batch {flow.PLACE_BATCH} x {flow.SEQ}, "
        f"{flow.MICRO} microbatches: a larger batch than above, so compute outweighs the all-reduce)",
        "",
        "| strategy | even tok/s (plan) | even tok/s (measured) | auto tok/s (plan) | auto tok/s (measured) "
        "| gain plan | gain measured |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        e, a = r.get("even") or {}, r.get("auto") or {}

        def f(x):
            return f"{x:,.0f}" if isinstance(x, (int, float)) else "-"

        lines.append(
            f"| {r['strategy']} | {f(e.get('predicted'))} | {f(e.get('measured'))} | {f(a.get('predicted'))} | "
            f"{f(a.get('measured'))} | {_ratio(a.get('predicted'), e.get('predicted'))}x | "
            f"{_ratio(a.get('measured'), e.get('measured'))}x |"
        )
    for r in rows:
        if r.get("auto"):
            lines += ["", f"{r['strategy']} auto: " + "; ".join(r["auto"]["placement"].get("why") or [])]
    agree = all(
        abs((r[m]["section"] or 0) - r[m]["predicted"]) <= 1e-9 * r[m]["predicted"]
        for r in rows
        for m in ("even", "auto")
        if r.get(m) and r[m]["predicted"]
    )
    lines += [
        "",
        "The placement plan (`plan --placement auto`) and the compares agree."
        if agree
        else "**The placement plan and the compares disagree.**",
    ]
    if pictures.placement_picture(rows, out / "placement.png"):
        lines += ["", "![who got what](placement.png)"]
    return lines + [""]


def _spread(decode: dict) -> str:
    """A run over several rounds: the slowest and fastest round's rate beside the whole's."""
    each = [r for r in decode.get("tokens_per_s_rounds") or [] if r]
    return f" ({min(each):,.1f}-{max(each):,.1f} over {len(each)} rounds)" if len(each) > 1 else ""


def generation(demo) -> list[str]:
    from smoltrain.demo import generate

    out = demo.out
    rows = [d for s in ("pp", "tp") if (d := _load(out / "generate" / f"generate-{s}.json"))]
    if not rows:
        return []
    lines = [
        f"## 6. Generation across the cluster ({generate.describe(demo.args.quick)})",
        "",
        "| strategy | hosts | placement | decode tok/s | plan tok/s | measured/plan | B/token (plan) | ttft | text |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for d in rows:
        p = d.get("plan") or {}
        text = (d.get("text") or "").replace("|", " ").replace("\n", " ")[:60]
        lines.append(
            f"| {d['strategy']} | {d['world_size']} | {d['placement'].get('mode')} {d['placement']['layers']} | "
            f"{d['decode']['tokens_per_s'] or 0:,.1f}{_spread(d['decode'])} | {p.get('tokens_per_s') or 0:,.1f} | "
            f"{_ratio(d['decode']['tokens_per_s'], p.get('tokens_per_s'))} | "
            f"{d['decode']['bytes_per_token'] or 0:,.0f} ({p.get('bytes_per_token') or 0:,.0f}) | "
            f"{_ms(d['ttft_s'])} | `{text}` |"
        )
    from smoltrain.infer.report import vs_plan_line

    terms = [f"- {d['strategy']}: {vs_plan_line(v)}" for d in rows if (v := d["decode"].get("vs_plan"))]
    if terms:  # a rate on plan can hide a stage off it: each term beside its plan
        lines += ["", "Where each token's time went:", "", *terms]
    return lines + [""]


def write(demo, trained: list[str], placed: list[str]) -> Path:
    out = demo.out
    lines = [
        "# smolcluster demo report",
        "",
        "The whole flow on the built-in cluster: measured links, the plan for every strategy, training runs "
        "that check the plan, placement by measured speed, generation from the trained model, low-communication "
        "training, the 2-D layouts, and fine-tuning a Hugging Face checkpoint.",
        "",
    ]
    lines += links(out, demo.args.quick)
    table, plans = plan_table(out)
    lines += table
    lines += runs(demo, trained, plans)
    lines += placement(out, placed)
    lines += generation(demo)
    from smoltrain.demo import diloco

    lines += diloco.section(out)
    from smoltrain.demo import finetune, mesh

    lines += mesh.section(out, flow.MODEL, flow.BATCH, flow.SEQ, flow.MICRO)
    lines += finetune.section(out, demo.args.quick)
    lines += ["## Stages", "", "| stage | exit | seconds | ok |", "|---|---|---|---|"]
    lines += [
        f"| {st['stage'].strip()} | {st['rc']} | {st['seconds']} | {'yes' if st['ok'] else '**FAILED**: ' + (st['why'] or '')} |"  # noqa: E501
        for st in demo.stages.results
    ]
    path = out / "REPORT.md"
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    return path
