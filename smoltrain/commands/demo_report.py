"""The demo's report: one self-contained REPORT.md beside its PNGs.

It tells the course's story in order: the links as measured (and what is wrong
with them), what the plan predicts per strategy, and whether the runs agree.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _fmt_bytes(n) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def _fmt_s(s) -> str:
    if s is None:
        return "-"
    s = float(s)
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"


def _plans(doc) -> list[dict]:
    if isinstance(doc, dict):
        return doc.get("plans", [doc])
    return doc or []


def loss_chart(runs: dict[str, dict], path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not runs:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=110)
    for (name, run), color in zip(runs.items(), ("#0072B2", "#E69F00", "#009E73", "#CC79A7")):
        steps = [s["step"] for s in run.get("steps", [])]
        loss = [s["loss"] for s in run.get("steps", [])]
        ax.plot(steps, loss, marker="o", ms=3, color=color, label=f"{name} ({run.get('backend')})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over global batch)")
    ax.set_title("Training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
    return True


def _compare_rows(strategy: str, run: dict, plan: dict | None) -> list[str]:
    rows = []
    measured = {(b["src"], b["dst"]): b["bytes"] for b in run.get("bytes", [])}
    nsteps = max(1, len(run.get("steps", [])))
    predicted = {(link["src"], link["dst"]): link["bytes_per_step"] for link in (plan or {}).get("links", [])}
    for key in sorted(set(measured) | set(predicted)):
        m = measured.get(key)
        m_step = m / nsteps if m is not None else None
        p = predicted.get(key)
        ratio = f"{m_step / p:.3f}" if (m_step and p) else "-"
        rows.append(f"| {strategy} | {key[0]} -> {key[1]} | {_fmt_bytes(p)} | {_fmt_bytes(m_step)} | {ratio} |")
    return rows


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


def write_report(out: Path, strategies: list[str], stages: list[dict]) -> Path:
    out = Path(out)
    lines = ["# smolcluster demo report", ""]
    lines += [
        "The whole flow on the built-in cluster: measured links, the plan for every strategy, "
        "and training runs that check the plan.",
        "",
    ]
    before = out / "before"
    if (before / "links.md").exists():
        lines += ["## 1. Links as found", "", "Measured before provisioning: the faults a new cluster really has.", ""]
        lines += _links_section(before, "before/")
        lines += [
            "## 1b. Links after provisioning",
            "",
            "Measured again after `make provision` set and verified the MTU.",
            "",
        ]
    else:
        lines += ["## 1. Links", ""]
    lines += _links_section(out, "")
    lines += ["## 2. Plan", ""]
    if (out / "plan.png").exists():
        lines += ["![plan chart](plan.png)", ""]
    plans = _plans(_load(out / "plans.json"))
    if plans:
        lines += ["| strategy | bytes/token | step | tokens/s | bottleneck | where |", "|---|---|---|---|---|---|"]
        for p in sorted(plans, key=lambda p: p.get("step_s") or float("inf")):
            lines.append(
                f"| {p.get('strategy')} | {_fmt_bytes(p.get('bytes_per_token'))} | {_fmt_s(p.get('step_s'))} "
                f"| {p.get('tokens_per_s', 0):.0f} | {p.get('bottleneck')} | {p.get('bottleneck_where', '')} |"
            )
        lines.append("")
    lines += ["## 3. Training runs", ""]
    runs = {s: r for s in strategies if (r := _load(out / f"run-{s}.json"))}
    if loss_chart(runs, out / "loss.png"):
        lines += ["![loss curves](loss.png)", ""]
    if runs:
        lines += ["| strategy | backend | world | steps | final loss | tokens/s |", "|---|---|---|---|---|---|"]
        for s, r in runs.items():
            lines.append(
                f"| {s} | {r.get('backend')} | {r.get('world_size')} | {len(r.get('steps', []))} "
                f"| {r.get('final_loss', float('nan')):.4f} | {r.get('tokens_per_s', 0):.0f} |"
            )
        lines.append("")
    lines += ["## 4. Predicted vs measured", ""]
    rows = []
    step_rows = []
    for s, r in runs.items():
        plan = r.get("plan") or next((p for p in plans if p.get("strategy") == s), None)
        rows += _compare_rows(s, r, plan)
        measured_step = sorted(x["step_s"] for x in r.get("steps", [])[1:] or r.get("steps", []))
        med = measured_step[len(measured_step) // 2] if measured_step else None
        step_rows.append(f"| {s} | {_fmt_s((plan or {}).get('step_s'))} | {_fmt_s(med)} |")
    if rows:
        lines += [
            "Bytes per step on each link (tensor payload):",
            "",
            "| strategy | link | predicted | measured | measured/predicted |",
            "|---|---|---|---|---|",
        ]
        lines += rows + [""]
        lines += ["Step time:", "", "| strategy | predicted | measured (median) |", "|---|---|---|"]
        lines += step_rows + [""]
    lines += ["## Stages", "", "| stage | exit | seconds |", "|---|---|---|"]
    lines += [f"| {st['stage'].strip()} | {st['rc']} | {st['seconds']} |" for st in stages] + [""]
    path = out / "REPORT.md"
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path
