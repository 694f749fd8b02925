"""Demo stage: low-communication training (diloco) next to dp and the best single host alone.

The plan's verdict (stage 6, `plan --strategy all`) says whether every synchronous strategy
is slower than the best host alone and which diloco setting (H, sync dtype) would beat it.
This stage trains the same global batches for the same steps three ways (the plan section's
model and batch, so the verdict's setting is the one trained), each placed by measured speed
and with the held-out loss every few steps: dp across the hosts, diloco at the plan's
setting, and dp on that single host only. REPORT.md gets the measured tokens/s and bytes per
token beside the verdict's prediction, and one picture: held-out loss against tokens and
against wall-clock seconds.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from smoltrain.planner.compare import tokens_per_s_after_warmup

QUICK_INNER_STEPS = 4  # --quick: two short outer steps, whatever H the plan picked
RUNS = ("dp", "diloco", "alone")
LABELS = {"dp": "dp (every step)", "diloco": "diloco", "alone": "{host} alone"}


def wall_clock(doc: dict) -> dict[int, float]:
    """Seconds of training up to the end of each step: lockstep runs add their steps; an
    outer-step run's ranks run apart, so its clock advances by whole outer steps."""
    out, t = {}, 0.0
    if doc.get("outer_steps"):
        first = doc["steps"][0]["step"] if doc.get("steps") else 0
        for o in doc["outer_steps"]:
            t += o["seconds"]
            out.update({k: t for k in range(first, o["step"] + 1)})
            first = o["step"] + 1
        return out
    for s in doc["steps"]:
        t += s["step_s"]
        out[s["step"]] = t
    return out


def loss_at(doc: dict, seconds: float) -> tuple[float | None, int | None]:
    """(held-out loss, step) of the last evaluation within `seconds` of training, or (None, None)."""
    clock = wall_clock(doc)
    done = [e for e in doc.get("evals") or [] if clock.get(e["step"], float("inf")) <= seconds]
    return (done[-1]["loss"], done[-1]["step"]) if done else (None, None)


def busiest_bytes_per_token(doc: dict) -> float:
    sent: dict[str, int] = {}
    for b in doc.get("bytes") or []:
        sent[b["src"]] = sent.get(b["src"], 0) + b["bytes"]
    tokens = sum(s["tokens"] for s in doc["steps"])
    return max(sent.values(), default=0) / tokens if tokens else 0.0


def measured_tokens_per_s(doc: dict) -> float:
    """Lockstep runs: the settled step (plan --compare's rule); diloco: whole outer steps after the first."""
    outer = doc.get("outer_steps") or []
    if outer:
        settled = outer[1:] if len(outer) > 1 else outer
        prev = outer[0]["step"] if len(outer) > 1 else doc["steps"][0]["step"] - 1
        steps = settled[-1]["step"] - prev
        tokens = doc["steps"][0]["tokens"]
        return tokens * steps / sum(o["seconds"] for o in settled)
    return tokens_per_s_after_warmup(doc) or 0.0


def setting(plans: dict, quick: bool) -> tuple[int, str, str, dict | None]:
    """(H, sync dtype, best single host, low-communication verdict) from `plan --strategy all`."""
    low = plans.get("low_communication")
    dl = next(p for p in plans["plans"] if p.get("outer"))
    h, dtype = (low["best"]["inner_steps"], low["best"]["sync_dtype"]) if low else (dl["inner_steps"], "fp32")
    return (QUICK_INNER_STEPS if quick else h), dtype, dl["single_host"]["name"], low


def picture(runs: dict[str, dict], host: str, path: Path) -> None:
    """Held-out loss against tokens (left) and against wall-clock seconds (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_tokens, by_time) = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    styles = (("#0072B2", "-", "o"), ("#D55E00", "-", "s"), ("#009E73", "--", "^"))  # dp and alone overlap per token
    for (name, doc), (color, ls, mk) in zip(runs.items(), styles):
        clock = wall_clock(doc)
        ev = doc.get("evals") or []
        kw = dict(marker=mk, ms=4, color=color, ls=ls, label=LABELS[name].format(host=host))
        by_tokens.plot([e["tokens"] for e in ev], [e["loss"] for e in ev], **kw)
        by_time.plot([clock[e["step"]] for e in ev], [e["loss"] for e in ev], **kw)
    by_tokens.set_xlabel("tokens trained on")
    by_time.set_xlabel("seconds of training")
    by_tokens.set_ylabel("held-out loss")
    by_tokens.set_title("at equal tokens")
    by_time.set_title("at equal wall-clock")
    for ax in (by_tokens, by_time):
        ax.grid(alpha=0.3)
    by_time.legend()
    fig.tight_layout()
    tmp = path.with_name(path.stem + f".tmp{os.getpid()}.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


def summary(runs: dict[str, dict], host: str, low: dict | None) -> dict:
    """The figures the report shows, and the verdict checked against them."""
    tps = {k: measured_tokens_per_s(v) for k, v in runs.items()}
    final = {k: v["evals"][-1]["loss"] for k, v in runs.items()}
    t_end = max(wall_clock(runs["diloco"]).values())
    out = {
        "host": host,
        "tokens_per_s": tps,
        "bytes_per_token": {k: busiest_bytes_per_token(v) for k, v in runs.items()},
        "held_out": final,
        "equal_wall_clock": {"seconds": t_end, **{k: loss_at(v, t_end)[0] for k, v in runs.items()}},
        "measured_vs_alone": tps["diloco"] / tps["alone"] if tps["alone"] else None,
    }
    if low:
        out["predicted_vs_alone"] = low["best"]["vs_single_host"]
        out["verdict_holds"] = (out["measured_vs_alone"] or 0) > 1.0 if low["beats_single_host"] else None
    return out


def markdown(s: dict, h: int, dtype: str, low: dict | None, png: str) -> list[str]:
    from smoltrain.demo import flow

    host, secs = s["host"], s["equal_wall_clock"]["seconds"]
    lines = [
        "",
        "## 7. Low-communication training: diloco beside dp and the best host alone "
        f"({flow.MODEL}, batch {flow.BATCH} x {flow.SEQ}, as the plan section)",
        "",
    ]
    if low:
        lines += [f"Plan's verdict: {low['sentence']}", ""]
    lines += [
        f"Each trained the same global batches (diloco: H={h}, {dtype} pseudo-gradients, placed by measured speed).",
        "",
        f"| run | tokens/s | bytes per token (busiest rank) | held-out loss: at the end | after {secs:.0f} s |",
        "|---|---|---|---|---|",
    ]
    for k in RUNS:
        then = s["equal_wall_clock"][k]
        lines.append(
            f"| {LABELS[k].format(host=host)} | {s['tokens_per_s'][k]:,.0f} | {s['bytes_per_token'][k]:,.1f} | "
            f"{s['held_out'][k]:.4f} | {'-' if then is None else f'{then:.4f}'} |"
        )
    lines += ["", f"Measured: diloco runs {s['measured_vs_alone']:.2f}x {host} alone."]
    if low:
        lines[-1] = lines[-1][:-1]
        held = {True: "the verdict holds", False: "the verdict does NOT hold", None: "no setting was predicted to win"}
        lines[-1] += f" (the plan predicted {s['predicted_vs_alone']:.2f}x): {held[s.get('verdict_holds')]}."
    c = s.get("compare") or {}
    if c:
        step = c["step_s"]
        ratio = step["measured"] / step["predicted"] if step.get("measured") and step.get("predicted") else None
        lines += [
            "",
            f"plan --compare: bytes per outer step {'exactly as planned' if c['bytes_exact'] else 'NOT as planned'}; "
            f"step time {step['predicted'] * 1e3:.1f} ms planned, "
            + (f"{step['measured'] * 1e3:.1f} ms measured (x{ratio:.2f})." if ratio else "not measured."),
        ]
    lines += ["", f"![held-out loss against tokens and seconds]({png})"]
    return lines


def stages(demo) -> bool:
    """Run the stage (its runs and their compare) and leave diloco-stage.json and diloco.png for
    the report; False when a run it needs failed (the demo then ends non-zero)."""
    from smoltrain.demo import flow
    from smoltrain.demo.stages import smol

    out, quick = demo.out, demo.args.quick
    h, dtype, host, low = setting(json.loads((out / "plans.json").read_text()), quick)
    steps = str(2 * h if quick else max(48, 4 * h))
    alone = out / "placement-alone.json"
    alone.write_text(json.dumps({"mode": "even", "strategy": "dp", "order": [host], "shares": [1.0]}))
    common = [*demo.common(), "--model", flow.MODEL, "--batch", flow.BATCH, "--seq", flow.SEQ]
    common += ["--steps", steps, "--eval-every", str(h)]
    extra = {
        "dp": ["--strategy", "dp", "--placement", "auto"],
        "diloco": ["--strategy", "diloco", "--placement", "auto", "--inner-steps", str(h), "--sync-dtype", dtype],
        "alone": ["--strategy", "dp", "--placement", str(alone)],
    }
    runs = {}
    for name in RUNS:
        rj = out / f"diloco-stage-{name}.json"  # not run-*.json: those are the demo's main runs
        title = f"13. train: {LABELS[name].format(host=host)}, {steps} steps, held-out loss every {h}"
        got = demo.stages.run(
            title, smol(demo.py, "smoltrain", "run", *extra[name], *common, "--json", rj, "--out", out), required=False
        )
        if got is None or not rj.exists():
            return False
        runs[name] = json.loads(rj.read_text())
    cmp = out / "diloco-stage-compare.json"  # not compare-*.json: those are the main runs
    got = demo.stages.run(
        "14. check: plan vs measured for diloco (bytes per outer step exact, step time)",
        smol(demo.py, "smoltrain", "plan", "--compare", out / "diloco-stage-diloco.json", *demo.common())
        + ["--no-what-if", "--json", cmp],
        required=False,
    )
    s = summary(runs, host, low)
    if got is not None:
        c = json.loads(cmp.read_text())
        s["compare"] = {"bytes_exact": c.get("bytes_exact"), "step_s": c["step_s"]}
    s["setting"] = {"inner_steps": h, "sync_dtype": dtype}
    picture(runs, host, out / "diloco.png")
    (out / "diloco-stage.json").write_text(json.dumps({**s, "low": low}, indent=1))
    demo.console.print(
        f"  diloco {s['tokens_per_s']['diloco']:,.0f} tok/s, dp {s['tokens_per_s']['dp']:,.0f}, {host} alone "
        f"{s['tokens_per_s']['alone']:,.0f}; held-out {s['held_out']['diloco']:.3f} vs dp {s['held_out']['dp']:.3f}"
    )
    return True


def section(out: Path) -> list[str]:
    """The report's section, from what the stage left (nothing when it did not run)."""
    p = out / "diloco-stage.json"
    if not p.exists():
        return []
    s = json.loads(p.read_text())
    st = s.get("setting") or {}
    return markdown(s, st.get("inner_steps"), st.get("sync_dtype"), s.get("low"), "diloco.png") + [""]


if __name__ == "__main__":  # python -m smoltrain.demo.diloco OUT_DIR: redraw from the stage's runs
    d = Path(sys.argv[1])
    docs = {k: json.loads((d / f"diloco-stage-{k}.json").read_text()) for k in RUNS}
    picture(docs, json.loads((d / "diloco-stage.json").read_text())["host"], d / "diloco.png")
