"""The demo's compute stage: calibrate the hosts, then predicted vs measured step time.

Runs after the links are measured, while the sim (CPU-capped hosts) is up: `calibrate -i`
writes the compute report, each strategy trains `tiny8` (8 layers, 4 heads: pp and tp split
evenly over 4 hosts), and `plan --compare` sets the plan on measured links and measured
compute beside what the run measured. The nominal plan (device profiles) is shown too,
because the gap between the two is what calibration is for.
"""

from __future__ import annotations

import json
from pathlib import Path

from smoltrain import registry

MODEL = "tiny8"
STRATEGIES = tuple(s.name for s in registry.REGISTRY.values() if s.trains and s.synchronous)  # lockstep trainers
QUICK = ("dp", "pp", "tp", "fsdp")


def compute_stage(stage, py: str, inv: Path, out: Path, links: Path, steps: str, quick: bool = False) -> Path:
    compute = out / "compute.json"
    stage.run(
        "4b. calibrate: every host measured on itself (matmul, memory, timed tiny8 steps)",
        # the median of three probes per host (one in quick mode): one probe on a busy machine strays
        [py, "-m", "smoltrain", "calibrate", "-i", str(inv), "--model", MODEL, "--repeat", "1" if quick else "3"]
        + ["--out", str(compute)],
        ok_codes=(0, 4),
        timeout=900,
    )
    rows = []
    for strat in QUICK if quick else STRATEGIES:
        run_json = out / f"compute-run-{strat}.json"
        p = stage.run(
            f"4c. train {MODEL} with {strat} across the hosts",
            [
                py,
                "-m",
                "smoltrain",
                "run",
                "--strategy",
                strat,
                "-i",
                str(inv),
                "--model",
                MODEL,
                "--steps",
                steps,
                "--links",
                str(links),
                "--compute",
                str(compute),
                "--json",
                str(run_json),
                "--out",
                str(out),
            ],
            ok_codes=(0, 1, 2, 4),
            timeout=900,
        )
        if p.returncode != 0 or not run_json.exists():
            rows.append({"strategy": strat, "error": f"run exited {p.returncode}"})
            continue
        cmp_json = out / f"compute-compare-{strat}.json"
        p = stage.run(
            f"4d. plan vs measured for {strat} (measured links + measured compute)",
            [
                py,
                "-m",
                "smoltrain",
                "plan",
                "--compare",
                str(run_json),
                "--links",
                str(links),
                "--compute",
                str(compute),
                "-i",
                str(inv),
                "--no-what-if",
                "--json",
                str(cmp_json),
            ],
            ok_codes=(0, 2),
        )
        if p.returncode != 0 or not cmp_json.exists():
            rows.append({"strategy": strat, "error": f"plan --compare exited {p.returncode}"})
            continue
        rows.append(_row(strat, json.loads(cmp_json.read_text()), inv, links))
    path = out / "compute-demo.md"
    path.write_text(table(rows))
    stage.console.print(table(rows))
    return path


def _nominal_step(strat: str, plan: dict, inv: Path, links: Path) -> float | None:
    """The same plan on device profiles: what the demo predicted before calibration existed."""
    from smolnet.inventory import load_inventory
    from smoltrain.models.spec import get_model
    from smoltrain.planner.plan import plan_for_run

    i = load_inventory(str(inv))
    hosts = [i.coordinator] + [h for h in i.hosts if h.name != i.coordinator.name]
    placement = plan.get("placement")  # the run's own split and rank order
    if placement:
        from smoltrain.planner.plan import in_placement_order

        hosts = in_placement_order(hosts, placement)
    d = plan_for_run(
        strat,
        get_model(plan["model"]["name"]),
        plan["world_size"],
        batch=plan["batch"],
        seq=plan["seq"],
        microbatches=plan["microbatches"],
        hosts=hosts,
        links=json.loads(links.read_text()),
        calibration=False,
        compute=False,
        placement=placement,
    )
    return d["step_s"]


def _row(strat: str, cmp: dict, inv: Path, links: Path) -> dict:
    plan = cmp["plan"]
    return {
        "strategy": strat,
        "predicted_s": cmp["step_s"]["predicted"],
        "measured_s": cmp["step_s"]["measured"],
        "nominal_s": _nominal_step(strat, plan, inv, links),
        "bottleneck": plan["bottleneck"],
        "missed": cmp.get("missed") or [],
        "bytes_ok": cmp["bytes_within_2pct"],
        "verdict": plan.get("verdict", ""),
    }


def table(rows: list[dict]) -> str:
    def ms(x):
        return f"{x * 1e3:.1f}" if x else "-"

    lines = [
        f"# Predicted vs measured step time, {MODEL} on the CPU-capped sim",
        "",
        "| strategy | predicted ms (measured compute) | measured ms | measured/predicted | "
        "predicted ms (device profiles) | bottleneck | bytes within 2% | missed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['strategy']} | - | - | - | - | - | - | {r['error']} |")
            continue
        ratio = r["measured_s"] / r["predicted_s"] if r["measured_s"] and r["predicted_s"] else None
        lines.append(
            f"| {r['strategy']} | {ms(r['predicted_s'])} | {ms(r['measured_s'])} | "
            f"{ratio:.2f} | {ms(r['nominal_s'])} | {r['bottleneck']} | "
            f"{'yes' if r['bytes_ok'] else 'no'} | {'; '.join(r['missed']) or '-'} |"
            if ratio
            else f"| {r['strategy']} | - | - | - | - | - | - | - |"
        )
    verdicts = [f"- {r['strategy']}: {r['verdict']}" for r in rows if r.get("verdict")]
    return "\n".join(lines + ["", "Verdicts:", ""] + verdicts) + "\n"
