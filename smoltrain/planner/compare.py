"""Predicted against measured: the plan for a finished `smoltrain run`, link by link.

Measured bytes are the transport's payload counters summed over the run, divided by the
number of steps. Step time, communication time and tokens/s are medians over the steps after
a warm-up fixed before looking at the times (CONTRACT.md section 6): the first `--warmup N`
steps, by default max(2, a quarter of the steps), the same rule for every strategy, and never
all of them (at least the last step is used). No step is dropped for being slow: a slow step
after the warm-up is part of what the run measured. The compare says what it left out
(`warmup_steps`, `steps_used`).

A run with a mesh of two axes or more (`run --mesh`) is planned as that mesh on its hosts in
its rank order, with its cuts (planner.mesh_plan, as `plan --mesh` times a layout), never as
its model axis's 1-D strategy over all the ranks (compare_mesh).
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from smolnet.errors import UsageError
from smolnet.files import read_json

RUN_SCHEMA = "smoltrain.run/1"
COMPARE_SCHEMA = "smoltrain.compare/1"
TOLERANCE = 0.02
MIN_WARMUP = 2  # steps: allocator, thread pools, first connections


def read_run(path: str) -> dict:
    p = Path(path)
    return read_json(p, "run report", schema=RUN_SCHEMA)


def run_request(run: dict) -> dict:
    """The plan arguments that describe a run: strategy, model, world, batch, seq, ..."""
    cfg = run["config"]
    req = {
        "strategy": cfg.get("strategy") or run.get("strategy"),
        "model": run_model(cfg),
        "world": int(cfg.get("world_size") or run.get("world_size") or 0),
        "dtype": cfg.get("dtype", "fp32"),
        "batch": int(cfg.get("batch", 8)),
        "seq": int(cfg.get("seq", 64)),
        "microbatches": int(cfg.get("microbatches") or 1),
        "inner_steps": int(cfg.get("inner_steps") or 0) or None,  # diloco
        "sync_dtype": cfg.get("sync_dtype"),
    }
    if not req["strategy"] or req["world"] < 1:
        raise UsageError("run report lacks config.strategy or world_size")
    return req


def run_model(cfg: dict):
    """The model a run trained: a checkpoint's folder, a built-in name, or (a JSON shape, whose
    file the report does not name) the shape the report records."""
    from smoltrain.models.spec import BUILTIN, ModelSpec

    spec, name = cfg.get("model_spec") or {}, cfg.get("model", "tiny")
    if spec.get("source") or name in BUILTIN or not spec:
        return spec.get("source") or name
    return ModelSpec(**{k: v for k, v in spec.items() if k in ModelSpec.__dataclass_fields__})


def run_hosts(run: dict) -> list[str]:
    """Host names in rank order: config.hosts when present, else rank0..rankN-1."""
    cfg = run["config"]
    names = cfg.get("hosts") or run.get("hosts")
    if names:
        return [h["name"] if isinstance(h, dict) else str(h) for h in names]
    world = int(cfg.get("world_size") or run.get("world_size") or 0)
    return [f"rank{r}" for r in range(world)]


def is_local_names(names: list[str]) -> bool:
    return all(re.fullmatch(r"rank\d+", n) for n in names)


def measured_steps(run: dict) -> int:
    steps = run.get("steps") or []
    return len(steps) or int(run.get("config", {}).get("steps") or 1)


def warmup_steps(steps: int, warmup: int | None = None) -> int:
    """How many leading steps the compare leaves out: `warmup` when given, else max(2, a
    quarter of the steps); always fewer than the run has."""
    if warmup is not None and warmup < 0:
        raise UsageError(f"--warmup must be 0 or more, got {warmup}")
    w = max(MIN_WARMUP, steps // 4) if warmup is None else warmup
    return max(0, min(w, steps - 1))


def after_warmup(steps: list, warmup: int | None = None) -> list:
    """The steps a prediction describes: all but the warm-up (warmup_steps)."""
    return list(steps)[warmup_steps(len(steps), warmup) :]


def amortised(plan: dict) -> bool:
    """Whether the plan spreads a phase over several steps (diloco's outer step every H): its
    per-step figures are means, so the measured steps are averaged too (a median of mostly
    inner steps would read the outer step's communication as nothing)."""
    return (plan.get("inner_steps") or 1) > 1


def typical(vals, mean: bool = False) -> float:
    return statistics.fmean(vals) if mean else statistics.median(vals)


def _median_after_warmup(run: dict, key: str, warmup: int | None = None, mean: bool = False) -> float | None:
    vals = [s.get(key) for s in after_warmup(run.get("steps") or [], warmup)]
    vals = [v for v in vals if isinstance(v, (int, float))]
    return typical(vals, mean) if vals else None


def tokens_per_s_after_warmup(run: dict, warmup: int | None = None, mean: bool = False) -> float | None:
    """Tokens per step over the typical step after the warm-up, as step_s is compared."""
    steps = [s for s in after_warmup(run.get("steps") or [], warmup) if s.get("step_s") and s.get("tokens")]
    if not steps:
        return run.get("tokens_per_s")
    return typical([s["tokens"] for s in steps], mean) / typical([s["step_s"] for s in steps], mean)


def compare(plan: dict, run: dict, warmup: int | None = None) -> dict:
    steps = measured_steps(run)
    recorded = len(run.get("steps") or [])
    left_out = warmup_steps(recorded, warmup)
    measured: dict[tuple[str, str], float] = {}
    for b in run.get("bytes") or []:
        key = (b["src"], b["dst"])
        measured[key] = measured.get(key, 0.0) + float(b["bytes"]) / steps
    predicted = {(ln["src"], ln["dst"]): float(ln["bytes_per_step"]) for ln in plan["links"]}
    rows = []
    for key in sorted(set(measured) | set(predicted)):
        p, m = predicted.get(key, 0.0), measured.get(key, 0.0)
        ratio = (m / p) if p else (1.0 if m == 0 else None)
        rows.append(
            {
                "src": key[0],
                "dst": key[1],
                "predicted_bytes_per_step": p,
                "measured_bytes_per_step": m,
                "ratio": ratio,
                "within_2pct": ratio is not None and abs(ratio - 1) <= TOLERANCE,
            }
        )
    mean = amortised(plan)
    step_m = _median_after_warmup(run, "step_s", warmup, mean)
    comm_m = _median_after_warmup(run, "comm_s", warmup, mean)
    out = {
        "schema": COMPARE_SCHEMA,
        "strategy": plan["strategy"],
        "world_size": plan["world_size"],
        "steps": steps,
        "warmup_steps": left_out,
        "steps_used": recorded - left_out,
        "warmup_rule": "the first --warmup steps" if warmup is not None else f"max({MIN_WARMUP}, steps // 4)",
        "links": rows,
        "bytes_within_2pct": all(r["within_2pct"] for r in rows),
        "step_s": {"predicted": plan["step_s"], "measured": step_m},
        "comm_s": {"predicted": planned_comm(plan), "measured": comm_m},
        "tokens_per_s": {"predicted": plan["tokens_per_s"], "measured": tokens_per_s_after_warmup(run, warmup, mean)},
        **per_rank(plan, run, warmup),
        "plan": plan,
    }
    if plan.get("inner_steps"):  # an outer-step strategy: bytes per outer step, pace of whole outer steps
        from smoltrain.planner.diloco_verdict import compare_outer

        compare_outer(out, plan, run)
    return out


def run_mesh(run: dict):
    """The run's mesh (smoltrain.mesh.Mesh, with its uneven cuts) where two axes or more are
    wider than one, else None: a 1-D run is planned by its strategy."""
    from smoltrain.mesh import Mesh, with_cuts

    m = run.get("mesh") or {}
    try:
        mesh = with_cuts(Mesh(tuple((a["name"], int(a["size"])) for a in m.get("axes") or [])), m)
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(f"run report: its mesh is not {{axes: [{{name, size}}], hosts: [[coords]]}} ({e})") from None
    if sum(n > 1 for _, n in mesh.axes) < 2:
        return None
    if m.get("hosts") is not None and [list(c) for c in m["hosts"]] != mesh.report()["hosts"]:
        raise UsageError(f"run report: its mesh's rank coordinates are not those of {mesh.text()}")
    return mesh


def mesh_request(req, run: dict):
    """The mesh plan's request for a mesh run: what the run planned for itself
    (mesh_search._run_setting): fp32 parameters and wire, the run's --dtype as compute dtype,
    and a diloco axis's H and sync dtype from the run's config."""
    from dataclasses import replace

    cfg = run["config"]
    outer = {"inner_steps": int(cfg.get("inner_steps") or 0) or None, "sync_dtype": cfg.get("sync_dtype")}
    return replace(req, dtype="fp32", compute_dtype=cfg.get("dtype"), outer=outer)


def compare_mesh(req, setting, run: dict, warmup: int | None = None) -> dict:
    """A mesh run against its layout's plan: the run's mesh and cuts on the run's hosts in its
    rank order (`mesh` and `hosts` of the report), timed and counted as `plan --mesh` does; then
    compare() on it. The mesh plan has no per-rank communication term, so each rank's
    communication is judged against the step's (predicted_for "step")."""
    from smoltrain.planner import mesh_search

    mesh, names = run_mesh(run), run_hosts(run)
    by_name = {r.name: r for r in setting.ranks}
    missing = [n for n in names if n not in by_name]
    if missing or len(names) != mesh.world:
        raise UsageError(
            f"run report: its {mesh.world} ranks' hosts ({', '.join(names)}) are not all among the plan's "
            f"({', '.join(by_name)})"
        )
    sh = mesh_search.shape_of(req, setting.model)
    mesh_search.check(mesh, setting.model, req.batch, req.microbatches, sh.inner_steps)
    e = mesh_search.lay_out(mesh, sh, [by_name[n] for n in names], setting.lm, "even")  # even: this order only
    e["placement"] = "auto" if (run["config"].get("placement") or {}).get("mode") == "auto" else "even"
    doc = mesh_search._doc(req, setting, [e], [])
    view = {
        "strategy": run.get("strategy") or run["config"].get("strategy"),
        "world_size": mesh.world,
        "links": e["links"],
        "step_s": e["step_s"],
        "seconds": e["seconds"],
        "tokens_per_s": e["tokens_per_s"],
        "ranks": e["ranks"],
    }
    out = compare(view, run, warmup)
    off = [abs(r["measured_bytes_per_step"] - r["predicted_bytes_per_step"]) for r in out["links"]]
    out["bytes_exact"] = all(x <= 0.5 for x in off)  # to the byte: counted, not estimated
    out |= {"layout": e["layout"], "mesh": e["mesh"], "order": e["order"], "plan": doc}
    return out


def planned_comm(plan: dict) -> float | None:
    """A step's planned communication: the plan's own figure, or a mesh layout's axes summed
    (its `seconds` per part, compute aside)."""
    if "comm_s_per_step" in plan:
        return plan["comm_s_per_step"]
    return sum(v for k, v in plan["seconds"].items() if k != "compute")


MISS = 0.25  # a per-rank figure further than this from its prediction "missed"
SMALL = 0.05  # of the step: a term this small on both sides is not judged (timer noise)


def term_verdict(pred: float | None, measured: float, step_s: float | None) -> tuple[float | None, str]:
    """(measured/predicted, 'within' | 'outside' | 'small' | 'unplanned') for one per-rank term."""
    ratio = measured / pred if pred else None
    if max(measured, pred or 0.0) <= SMALL * (step_s or 0):
        return ratio, "small"
    if ratio is None:
        return None, "unplanned"
    return ratio, "within" if abs(ratio - 1) <= MISS else "outside"


def per_rank(plan: dict, run: dict, warmup: int | None = None) -> dict:
    """Compute and communication per rank, predicted vs measured (median after warm-up), each
    term marked within or outside MISS of its prediction, so a right step time cannot hide
    wrong terms and a wrong one has a named cause. The measured terms are each rank's own (run
    report, smoltrain/run/timings.py); the predicted communication is the rank's own where the
    plan gives one, else the step's, which the plan charges every rank."""
    steps = [s for s in after_warmup(run.get("steps") or [], warmup) if s.get("ranks")]
    if not steps:
        return {"ranks": [], "missed": [], "outside": []}
    names = [r.get("name", f"rank{i}") for i, r in enumerate(plan.get("ranks") or [])]
    rows, missed = [], []
    for i, pr in enumerate(plan.get("ranks") or []):
        got = [next((x for x in s["ranks"] if x["rank"] == i), None) for s in steps]
        got = [g for g in got if g]
        if not got:
            continue
        row = {"rank": i, "name": names[i]}
        comm_p = pr["comm_s"] if pr.get("comm_s") is not None else planned_comm(plan)
        for what, pred in (("compute_s", pr["compute_s"]), ("comm_s", comm_p)):
            m = typical([g[what] for g in got], amortised(plan))
            ratio, verdict = term_verdict(pred, m, plan.get("step_s"))
            row[what] = {"predicted": pred, "measured": m, "ratio": ratio, "verdict": verdict}
            if verdict == "outside":
                missed.append((abs(ratio - 1), what, f"{what[:-2]} on rank {i} ({names[i]}) x{ratio:.2f}"))
        row["comm_s"]["predicted_for"] = "rank" if pr.get("comm_s") is not None else "step"
        row["wait_s"] = statistics.median(g["wait_s"] for g in got)
        row["verdict"] = "outside" if "outside" in (row["compute_s"]["verdict"], row["comm_s"]["verdict"]) else "within"
        rows.append(row)
    # name the worst miss of each kind: the one that explains the step time
    worst = {}
    for off, what, text in missed:
        if off > worst.get(what, (0, ""))[0]:
            worst[what] = (off, text)
    return {
        "ranks": rows,
        "missed": [worst[w][1] for w in ("compute_s", "comm_s") if w in worst],
        "outside": [text for _, _, text in missed],  # every term outside MISS, rank by rank
    }


def render(con, cmp: dict) -> None:
    from rich.table import Table

    from smoltrain.planner.bottleneck import human_bytes, human_s

    used = cmp.get("steps_used", cmp["steps"])
    what = f"mesh {cmp['layout']}" if cmp.get("layout") else cmp["strategy"]
    t = Table(
        title=f"{what}: predicted vs measured per step (bytes over {cmp['steps']} steps; times: median of "
        f"{used} after a warm-up of {cmp.get('warmup_steps', 0)})",
        title_justify="left",
    )
    for c in ("src", "dst", "predicted", "measured", "measured/predicted"):
        t.add_column(c)
    for r in cmp["links"]:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.4f}"
        color = "green" if r["within_2pct"] else "red"
        t.add_row(
            r["src"],
            r["dst"],
            human_bytes(r["predicted_bytes_per_step"]),
            human_bytes(r["measured_bytes_per_step"]),
            f"[{color}]{ratio}[/]",
        )
    for what in ("step_s", "comm_s"):
        p, m = cmp[what]["predicted"], cmp[what]["measured"]
        ratio = f"{m / p:.2f}" if p and m else "-"
        t.add_row(
            f"[bold]{what.replace('_s', ' time')}[/]",
            "",
            human_s(p) if p is not None else "-",
            human_s(m) if m is not None else "-",
            ratio,
        )
    con.print(t)
    if cmp.get("ranks"):
        from smoltrain.planner.bottleneck import human_s as hs

        rt = Table(title="per rank: predicted vs measured (median after warm-up)", title_justify="left")
        for c in ("rank", "host", "compute", "comm", "wait"):
            rt.add_column(c)
        for r in cmp["ranks"]:

            def cell(x):
                col = {"within": "green", "outside": "red"}.get(x.get("verdict"), "dim")
                ratio = f"x{x['ratio']:.2f} " if x["ratio"] is not None else ""
                pred = hs(x["predicted"]) if x["predicted"] is not None else "-"
                return f"{pred} / {hs(x['measured'])} [{col}]{ratio}{x.get('verdict', '')}[/]"

            rt.add_row(str(r["rank"]), r["name"], cell(r["compute_s"]), cell(r["comm_s"]), hs(r["wait_s"]))
        con.print(rt)
        out = cmp.get("outside", cmp["missed"])
        con.print(
            f"  outside {MISS:.0%}: "
            + ("; ".join(out) if out else f"nothing (compute and comm within {MISS:.0%} on every rank)")
        )
    verdict = "all links within 2%" if cmp["bytes_within_2pct"] else "[red]some links differ by more than 2%[/]"
    if "bytes_exact" in cmp:
        per = "per outer step " if (cmp.get("plan") or {}).get("inner_steps") else "per step "
        verdict += "; " + per + ("exactly as planned" if cmp["bytes_exact"] else "[red]not as planned[/]")
    con.print(f"  bytes: {verdict}")
