"""Demo stage: the 2-D layouts beside the 1-D strategies (issue 38, CONTRACT.md section 12).

`plan --mesh auto` ranks every layout the 4 hosts allow (dp x tp, pp x tp, dp x pp, in each
axis order) on the demo's measured links and compute, for the plan section's model and batch;
`plan --strategy all` (stage 6) already carries the best of them (`meshes`, `best_mesh`), so
the report checks the two agree and sets the best layouts beside the best single strategies,
with the hosts that carry each axis. Outside --quick the plan's best mesh also trains
(`run --mesh auto`) and `plan --compare` checks the run against its layout planned on its
hosts: bytes per link per step (exact), step time and tokens per second after the fixed warm-up.
"""

from __future__ import annotations

import json
from pathlib import Path

from smoltrain.planner.bottleneck import human_bytes, human_s

TOP = 5  # layouts shown
PLAN, RUN, STAGE = "mesh-plan.json", "mesh-run.json", "mesh-stage.json"  # not run-*.json: the main runs
COMPARE = "mesh-compare.json"  # not compare-*.json: the main runs' compares


def _load(path: Path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def axis_groups(mesh: dict, order: list[str]) -> dict[str, list[list[str]]]:
    """Each axis's groups as host names: the ranks that differ only along that axis."""
    coords, out = mesh["hosts"], {}
    for i, ax in enumerate(mesh["axes"]):
        groups: dict[tuple, list[str]] = {}
        for rank, c in enumerate(coords):
            groups.setdefault(tuple(c[:i]) + tuple(c[i + 1 :]), []).append(order[rank])
        out[ax["name"]] = list(groups.values())
    return out


def carriers(mesh: dict, order: list[str]) -> str:
    """`tp: {a, b}, {c, d}; dp: {a, c}, {b, d}`, innermost axis first (it carries the most bytes)."""
    groups = axis_groups(mesh, order)
    return "; ".join(
        f"{name}: " + ", ".join("{" + ", ".join(g) + "}" for g in groups[name]) for name in reversed(list(groups))
    )


def run_check(best: dict, cmp: dict, run: dict) -> dict:
    """The mesh run's `plan --compare` (its layout planned on its hosts) beside the plan's pick:
    same layout and hosts, the same predicted figures, bytes per link per step, tokens/s."""
    tps = cmp["tokens_per_s"]
    return {
        "same_layout": cmp.get("mesh") == best["mesh"] and list(cmp.get("order") or []) == list(best["order"]),
        "same_prediction": abs(tps["predicted"] - best["tokens_per_s"]) <= 1e-9 * best["tokens_per_s"],
        "bytes_exact": bool(cmp.get("bytes_exact")),
        "links": [
            {
                "src": r["src"],
                "dst": r["dst"],
                "predicted": r["predicted_bytes_per_step"],
                "measured": r["measured_bytes_per_step"],
            }
            for r in cmp["links"]
        ],
        "tokens_per_s": tps,
        "final_loss": run.get("final_loss"),
        "steps": len(run.get("steps") or []),
    }


def stages(demo) -> bool:
    """`plan --mesh auto` (and, outside --quick, `run --mesh auto`); leaves mesh-stage.json."""
    from smoltrain.demo.stages import smol

    out, common = demo.out, [*demo.common(), *demo.shape()]
    if len(json.loads(demo.links.read_text()).get("hosts", [])) < 4:
        return True  # no 2-D layout of fewer than 4 hosts: no section
    got = demo.stages.run(
        "15. plan: every 2-D layout of the hosts (plan --mesh auto)",
        smol(demo.py, "smoltrain", "plan", "--mesh", "auto", *common) + ["--json", out / PLAN],
        required=False,
    )
    if got is None:
        return False
    doc = {"quick": bool(demo.args.quick), "check": None}
    (out / STAGE).write_text(json.dumps(doc, indent=1))
    if not demo.args.quick:
        rj = out / RUN
        got = demo.stages.run(
            "16. train: the plan's best mesh across the cluster (run --mesh auto)",
            smol(demo.py, "smoltrain", "run", "--mesh", "auto", *common)
            + ["--steps", demo.steps, "--json", rj, "--out", out],
            required=False,
        )
        if got is None or not rj.exists():
            return False
        got = demo.stages.run(
            "16. check: the mesh run against its layout's plan (plan --compare)",
            smol(demo.py, "smoltrain", "plan", "--compare", rj, *demo.common()) + ["--json", out / COMPARE],
            required=False,
        )
        if got is None:
            return False
        best = json.loads((out / PLAN).read_text())["meshes"][0]
        doc["check"] = run_check(best, json.loads((out / COMPARE).read_text()), json.loads(rj.read_text()))
    (out / STAGE).write_text(json.dumps(doc, indent=1))
    return True


def _layout_rows(meshes: list[dict]) -> list[str]:
    rows = []
    for i, m in enumerate(meshes[:TOP], 1):
        rows.append(
            f"| {i} | {m['layout']} | {', '.join(m['order'])} | {human_s(m['step_s'])} | {m['tokens_per_s']:,.0f} "
            f"| {m['bottleneck']} | {carriers(m['mesh'], m['order'])} |"
        )
    return rows


def section(out: Path, model: str, batch: int, seq: int, micro: int) -> list[str]:
    """The report's section, from mesh-plan.json, plans.json and mesh-stage.json (nothing when
    the stage did not run)."""
    plan, plans = _load(out / PLAN), _load(out / "plans.json") or {}
    if not plan or not plan.get("meshes"):
        return []
    best = plan["meshes"][0]
    single = {p["strategy"]: p for p in plans.get("plans", [])}
    ranked = [single[s] for s in plans.get("ranking", []) if s in single and single[s].get("tokens_per_s")]
    lines = [
        "## 8. Strategies that compose: the 2-D layouts beside the 1-D ones "
        f"({model}, batch {batch} x {seq}, {micro} microbatches, as the plan section)",
        "",
        "`plan --mesh auto`: every layout of the hosts, ranked on the measured links and compute; the innermost "
        "axis (the most bytes per step) goes to the closest hosts.",
        "",
        "| # | layout | hosts (rank order) | step | tokens/s | bottleneck | hosts carrying each axis |",
        "|---|---|---|---|---|---|---|",
        *_layout_rows(plan["meshes"]),
        "",
        "The best single strategies (section 2):",
        "",
        "| strategy | step | tokens/s | bottleneck |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {p['strategy']} | {human_s(p['step_s'])} | {p['tokens_per_s']:,.0f} | {p['bottleneck']} |"
        for p in ranked[:3]
    ]
    lines.append("")
    if ranked:
        top = ranked[0]
        ratio = best["tokens_per_s"] / top["tokens_per_s"]
        lines.append(
            f"Planned: the best layout, {best['layout']}, runs {ratio:.2f}x the best single strategy "
            f"({top['strategy']}): "
            + (
                "the mesh wins on these hosts."
                if ratio > 1
                else f"{top['strategy']} alone stays the better choice here."
            )
        )
    same = plans.get("best_mesh") == plan.get("best") and any(
        m["layout"] == best["layout"] and abs(m["tokens_per_s"] - best["tokens_per_s"]) <= 1e-9 * best["tokens_per_s"]
        for m in plans.get("meshes") or []
    )
    lines += [
        "",
        "`plan --strategy all` names the same best layout with the same figures."
        if same
        else f"**`plan --strategy all` names another best layout ({plans.get('best_mesh')}) or other figures.**",
    ]
    stage = _load(out / STAGE) or {}
    c = stage.get("check")
    if c:
        tps = c["tokens_per_s"]
        lines += [
            "",
            f"Trained ({c['steps']} steps, `run --mesh auto`): "
            + (
                "the plan's layout on the plan's hosts"
                if c["same_layout"]
                else "**another layout or host order than the plan's**"
            )
            + f"; final loss {c['final_loss']:.4f}; tokens/s {tps['measured'] or 0:,.0f} measured after the warm-up, "
            f"{tps['predicted']:,.0f} planned (x{(tps['measured'] or 0) / tps['predicted']:.2f}); bytes per link "
            + ("exactly as planned." if c["bytes_exact"] else "NOT as planned:"),
        ]
        if not c["bytes_exact"]:
            lines += ["", "| link | planned bytes/step | measured |", "|---|---|---|"]
            lines += [
                f"| {ln['src']} -> {ln['dst']} | {human_bytes(ln['predicted'])} | {human_bytes(ln['measured'])} |"
                for ln in c["links"]
            ]
        if not c.get("same_prediction", True):
            lines += ["", "**`plan --compare` predicts other figures for the run than `plan --mesh auto`.**"]
        lines += ["", "(`plan --compare` of the run: its layout planned on its hosts, docs/mesh.md.)"]
    elif stage.get("quick"):
        lines += ["", "--quick: planned only (the full demo also trains the best layout)."]
    else:
        lines += ["", "**The best layout did not train (see the stages below).**"]
    return lines + [""]
