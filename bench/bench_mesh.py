"""The plan's best mesh against the best 1-D strategy on the fastpair sim, measured (issue 38).

Brings up sim `mbench` (scenario fastpair: fast1-fast2 on 10 Gbit, gbe on 1 GbE, slowup with a
300 Mbit uplink, CPUs capped alike; 10.213.77.0/24), measures the links (`smolnet matrix`) and
every host's compute on the bench's model (`smoltrain calibrate -i`), then asks the plan twice:
`plan --mesh auto` (every layout, ranked) and `plan --strategy all` (the 1-D strategies). It
trains, each for `--steps` steps with `smoltrain run -i INV --links --compute`:

  the plan's top three meshes, physically distinct (`pp=2,tp=2` and `tp=2,pp=2` on the same
  groups are one layout): the first with `run --mesh auto` (the plan's pick: its host order and
  cuts), the others each on the plan's host order (an inventory listing the hosts in that order,
  the first as coordinator) with `--placement even`, planned as run (`plan --mesh LAYOUT` on that
  inventory); each run's mesh and hosts checked against its plan;
  the best 1-D strategy and its runner-up, under the placement `run` picks from the compute.

Measured tokens/s is the median step after the warm-up, as `plan --compare` counts it
(smoltrain/planner/compare.py); a 1-D run's plan is `plan --strategy S` on the same files (what `plan
--compare` predicts; --compare itself does not resolve a .json shape's name), a mesh's the
`plan --mesh auto` entry it ran (a mesh run's report has no plan).

The 1-D strategies it compares against are those whose step is the whole batch's exact gradient,
as every searched mesh's is (`--versus exact`, the default): diloco trains H local steps between
syncs, so its tokens/s buys a different optimisation; its planned figure is kept beside the result
(`--versus all` puts it in the race).

The shape (`--shape`, default two layers of width 192, batch 8 x 64, 4 microbatches): on four
ranks a two-layer model cannot be a four-stage pipeline, so the 1-D choices are data axes and tp
over every link, and a mesh can keep tp on the fast pair with pp across. On a model of four layers
or more, 1-D pp is compute-bound on these capped CPUs and the plan expects no mesh to beat it
(checked before choosing: tiny and tiny8, batch 4-32).

Bars (issue 38): the plan's best mesh measured >= 1.3x the best measured 1-D run; it within 25% of
its plan; the measured top three of all runs in the plan's order. Keeps bench/results/mesh-fastpair.json;
exits 1 when a bar is missed, 2 on an error.

    flock /tmp/smol-sim.lock .venv/bin/python bench/bench_mesh.py
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import common
import yaml
from common import PY, exit_code, write_result
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from smolnet.sim import cluster as sim
from smoltrain.mesh import parse
from smoltrain.planner.compare import after_warmup, tokens_per_s_after_warmup, warmup_steps

BAR = (
    "fastpair sim: the plan's best mesh >= 1.3x the best exact 1-D strategy in measured tokens/s, "
    "within 25% of its plan; the plan ranks the measured top three in order"
)
EXACT = ("dp", "fsdp", "syncps", "edp", "mp", "pp", "tp", "sp")
SHAPE = {"name": "l2h192", "vocab": 256, "layers": 2, "hidden": 192, "heads": 4, "kv_heads": 4, "ffn": 768,
         "ctx": 128, "tied_embeddings": False}  # fmt: skip
console = Console(stderr=True)


def sh(argv, ok=(0,)) -> str:
    return common.sh(argv, ok=ok, timeout=600).stdout


def layout_key(entry: dict) -> tuple:
    """What a mesh entry is on the hosts: each axis's groups of hosts (a pp group in stage order,
    the others as sets), so `pp=2,tp=2` and `tp=2,pp=2` over the same groups are one layout."""
    mesh, order = parse(entry["layout"], len(entry["order"])), entry["order"]
    key = []
    for ax in mesh.names:
        groups = [[order[r] for r in g] for g in mesh.groups(ax)]
        groups = [tuple(g) if ax == "pp" else tuple(sorted(g)) for g in groups]
        key.append((ax, tuple(sorted(groups))))
    return tuple(sorted(key))


def distinct(meshes: list[dict], k: int) -> list[dict]:
    """The plan's first k layouts that differ on the hosts, each the best of its name (what
    `run --mesh NAME --placement auto` runs)."""
    out, seen = [], set()
    for e in meshes:
        if e["fits"] and e["step_s"] and not {layout_key(e), e["layout"]} & seen:
            seen |= {layout_key(e), e["layout"]}
            out.append(e)
    return out[:k]


def ordered_inventory(inv: Path, order: list[str], out: Path) -> Path:
    """The inventory with its hosts in `order`, the first the coordinator (rank 0)."""
    doc = yaml.safe_load(inv.read_text())
    hosts = doc["all"]["children"]["cluster"]["hosts"]
    doc["all"]["children"]["cluster"]["hosts"] = {n: hosts[n] for n in order}
    doc["all"]["children"]["coordinator"] = {"hosts": {order[0]: None}}
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


def measured(rep: Path) -> dict:
    run = json.loads(rep.read_text())
    steps = run.get("steps") or []
    used = after_warmup(steps)
    ranks = {}
    for s in used:
        for r in s.get("ranks") or []:
            ranks.setdefault(r["rank"], []).append((r["compute_s"], r["own_comm_s"]))
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {
        "hosts": run["hosts"],
        "steps": len(steps),
        "warmup_steps": warmup_steps(len(steps)),
        "tokens_per_s": tokens_per_s_after_warmup(run),
        "step_s": med([s["step_s"] for s in used]),
        "ranks": [
            {"rank": k, "compute_s": med([c for c, _ in v]), "comm_s": med([m for _, m in v])}
            for k, v in sorted(ranks.items())
        ],  # fmt: skip
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", default="mbench", help="sim name")
    ap.add_argument("--subnet", default="10.213.77.0/24")
    ap.add_argument("--shape", default=None, help="a model .json shape (default: the two-layer shape above)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12, help="per run; the first max(2, steps // 4) are warm-up")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--versus", choices=("exact", "all"), default="exact", help="which 1-D strategies race")
    ap.add_argument("--no-runner-up", action="store_true", help="run only the best 1-D strategy")
    a = ap.parse_args()
    if a.steps < 4:
        raise SystemExit("--steps must be 4 or more (2 of them are warm-up)")
    work = Path(tempfile.mkdtemp(prefix="bench-mesh-"))
    shape = Path(a.shape) if a.shape else work / "shape.json"
    if not a.shape:
        shape.write_text(json.dumps(SHAPE))
    console.print(f"files: {work}")
    inv = work / "inv.yml"
    files = ["--links", work / "links.json", "--compute", work / "compute.json"]
    train = ["--model", shape, "--batch", a.batch, "--seq", a.seq, "--microbatches", a.microbatches]
    runs: list[dict] = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as prog:  # fmt: skip
        task = prog.add_task("sim up", total=5 + 3 + (1 if a.no_runner_up else 2))
        try:
            st = sim.up(name=a.name, scenario="fastpair", subnet=a.subnet, inventory=str(inv))
            prog.update(task, advance=1, description="links (smolnet matrix)")
            sh(
                [PY, "-m", "smolnet", "matrix", "-i", inv, "--duration", "3", "--out", work], ok=(0, 4)
            )  # 4: warnings (the slow uplink)
            prog.update(task, advance=1, description="compute (smoltrain calibrate)")
            sh([PY, "-m", "smoltrain", "calibrate", "-i", inv, "--model", shape, "--batch", a.batch,
                "--seq", a.seq, "--out", work / "compute.json"])  # fmt: skip
            prog.update(task, advance=1, description="plan --mesh auto, --strategy all")
            plan = ["plan", "-i", inv, *files, *train, "--no-what-if"]
            sh([PY, "-m", "smoltrain", *plan, "--mesh", "auto", "--json", work / "meshes.json"])
            sh([PY, "-m", "smoltrain", *plan, "--strategy", "all", "--json", work / "all.json"])
            meshes = json.loads((work / "meshes.json").read_text())["meshes"]
            plans = json.loads((work / "all.json").read_text())["plans"]
            race = EXACT if a.versus == "exact" else (*EXACT, "diloco")
            one_d = sorted((p for p in plans if p["strategy"] in race and p.get("tokens_per_s")),
                           key=lambda p: -p["tokens_per_s"])[: 1 if a.no_runner_up else 2]  # fmt: skip
            prog.update(task, advance=1)
            for i, e in enumerate(distinct(meshes, 3)):
                prog.update(task, description=f"run mesh {e['layout']} on {','.join(e['order'])}")
                rep, k = work / f"run-mesh{i}.json", work / f"inv-mesh{i}.yml"
                if i == 0:  # the plan's pick, as `run --mesh auto` resolves it (order and cuts)
                    how = ["-i", inv, "--mesh", "auto"]
                else:  # this layout on the plan's host order, rank r on its r-th host
                    how = ["-i", ordered_inventory(inv, e["order"], k), "--mesh", e["layout"], "--placement", "even"]
                    q = work / f"plan-mesh{i}.json"
                    sh([PY, "-m", "smoltrain", "plan", *plan[3:], *how, "--json", q])
                    e = {**json.loads(q.read_text())["meshes"][0], "auto_entry_tokens_per_s": e["tokens_per_s"]}
                sh([PY, "-m", "smoltrain", "run", *how, *files, *train, "--steps", a.steps, "--seed", a.seed,
                    "--json", rep, "--out", work])  # fmt: skip
                m = measured(rep)
                ran = json.loads(rep.read_text())["mesh"]
                if m["hosts"] != e["order"] or ran != e["mesh"]:
                    raise SystemExit(
                        f"mesh {e['layout']} ran as {ran} on {m['hosts']}, planned as {e['mesh']} on {e['order']}"
                    )
                runs.append({"kind": "mesh", "layout": e["layout"], "hosts": e["order"], "planned_step_s": e["step_s"],
                             "planned_tokens_per_s": e["tokens_per_s"], "planned_bottleneck": e["bottleneck"],
                             "planned_seconds": e["seconds"], "planned_ranks": e["ranks"], "measured": m,
                             "auto_entry_tokens_per_s": e.get("auto_entry_tokens_per_s", e["tokens_per_s"])})  # fmt: skip
                prog.update(task, advance=1)
            for p in one_d:
                s = p["strategy"]
                prog.update(task, description=f"run {s} (1-D)")
                rep, own = work / f"run-{s}.json", work / f"plan-{s}.json"
                sh([PY, "-m", "smoltrain", "run", "-i", inv, *files, *train, "--strategy", s, "--steps", a.steps,
                    "--seed", a.seed, "--json", rep, "--out", work])  # fmt: skip
                sh([PY, "-m", "smoltrain", *plan, "--strategy", s, "--json", own])
                q, m = json.loads(own.read_text()), measured(rep)
                runs.append({"kind": "1-D", "layout": s, "hosts": m["hosts"], "planned_step_s": q["step_s"],
                             "planned_tokens_per_s": q["tokens_per_s"], "planned_bottleneck": q["bottleneck"],
                             "planned_compute_s": q["compute_s_per_step"], "planned_comm_s": q["comm_s_per_step"],
                             "plan_all_tokens_per_s": p["tokens_per_s"], "measured": m})  # fmt: skip
                prog.update(task, advance=1)
        finally:
            prog.update(task, description="sim down")
            sim.down(name=a.name)
    diloco = next((p["tokens_per_s"] for p in plans if p["strategy"] == "diloco"), None)
    return report(a, st, shape, runs, meshes, diloco)


def report(a, st: dict, shape: Path, runs: list[dict], meshes: list[dict], diloco: float | None) -> int:
    for r in runs:
        r["measured_tokens_per_s"] = r["measured"]["tokens_per_s"]
        r["measured_step_s"] = r["measured"]["step_s"]
        r["ratio"] = r["measured_tokens_per_s"] / r["planned_tokens_per_s"]
        r["label"] = f"{r['layout']} on {','.join(r['hosts'])}" if r["kind"] == "mesh" else r["layout"]
    planned = [r["label"] for r in sorted(runs, key=lambda r: -r["planned_tokens_per_s"])]
    got = [r["label"] for r in sorted(runs, key=lambda r: -r["measured_tokens_per_s"])]
    top3 = got[:3]
    best_mesh = next(r for r in runs if r["kind"] == "mesh")
    best_1d = max((r for r in runs if r["kind"] == "1-D"), key=lambda r: r["measured_tokens_per_s"])
    speedup = best_mesh["measured_tokens_per_s"] / best_1d["measured_tokens_per_s"]
    planned_speedup = best_mesh["planned_tokens_per_s"] / max(
        r["planned_tokens_per_s"] for r in runs if r["kind"] == "1-D"
    )
    bars = {
        "speedup_1_3x": speedup >= 1.3,
        "best_mesh_within_25pct": 0.75 <= best_mesh["ratio"] <= 1.25,
        "top3_in_plan_order": [x for x in planned if x in top3] == top3,
    }
    t = Table(title=f"fastpair, {json.loads(shape.read_text())['name']} batch {a.batch} x {a.seq}, {a.steps} steps")
    for col in ("layout", "hosts", "planned step", "measured step", "planned tok/s", "measured tok/s", "meas/plan"):
        t.add_column(col)
    for r in runs:
        t.add_row(r["layout"], ",".join(r["hosts"]), f"{r['planned_step_s'] * 1e3:.0f} ms",
                  f"{r['measured_step_s'] * 1e3:.0f} ms", f"{r['planned_tokens_per_s']:,.0f}",
                  f"{r['measured_tokens_per_s']:,.0f}", f"{r['ratio']:.2f}")  # fmt: skip
    Console().print(t)
    load = [round(x, 2) for x in os.getloadavg()]
    data = {
        "scenario": "fastpair", "sim": a.name, "subnet": a.subnet, "sim_seed": st.get("seed"), "seed": a.seed,
        "shape": json.loads(shape.read_text()), "batch": a.batch, "seq": a.seq, "microbatches": a.microbatches,
        "steps": a.steps, "versus": a.versus, "runs": runs, "rank_planned": planned, "rank_measured": got,
        "speedup_best_mesh_over_best_1d": speedup, "speedup_planned": planned_speedup,
        "diloco_planned_tokens_per_s": diloco, "meshes_planned": [
            {k: e[k] for k in ("layout", "order", "step_s", "tokens_per_s", "bottleneck")} for e in meshes],
        "bars": bars, "load_at_end": load,
    }  # fmt: skip
    met = all(bars.values())
    headline = (
        f"{best_mesh['layout']} {speedup:.2f}x {best_1d['layout']} (plan {planned_speedup:.2f}x), "
        f"plan off {best_mesh['ratio']:.2f}, top three {'in' if bars['top3_in_plan_order'] else 'out of'} order"
    )
    kept = write_result("mesh-fastpair", BAR, met, headline, data)
    print(f"{headline}: {'met' if met else 'MISSED'} ({kept}; load {load})")
    return exit_code(met)


if __name__ == "__main__":
    raise SystemExit(main())
