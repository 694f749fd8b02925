"""Demo stage: placement by measured speed, even vs auto, predicted beside measured.

Reads the compute report the compute stage wrote (`smoltrain calibrate -i`, the same
hosts a few minutes earlier). Then, for dp and pp: `plan --placement auto` (the placement and its predicted gain), and
`run --placement even` and `run --placement auto` (the measured gain). REPORT.md gets a
table of predicted and measured tokens/s and a picture of who got what.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from smoltrain.planner.compare import tokens_per_s_after_warmup

STRATEGIES = ("dp", "pp")
BATCH = "32"  # sequences per step: enough that compute, which placement balances, outweighs the all-reduce


def work_of(placement: dict) -> list[tuple[str, float, str]]:
    """(host, share of the work, label) per rank, for the picture and the table."""
    order = placement.get("order") or []
    if placement.get("shares"):
        return [(n, s, f"{s:.0%} of the batch") for n, s in zip(order, placement["shares"])]
    for key, what in (("layers", "layers"), ("heads", "heads")):
        cuts = placement.get(key)
        if cuts:
            total = cuts[-1][1]
            return [(n, (hi - lo) / total, f"{what} {lo}..{hi - 1}") for n, (lo, hi) in zip(order, cuts)]
    return [(n, 1 / max(1, len(order)), "") for n in order]


def picture(rows: list[dict], path: Path) -> bool:
    """Stacked bars: each strategy's even and auto placement, one colour per host."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    hosts = sorted({h for r in rows for m in ("even", "auto") for h, _, _ in work_of(r[m]["placement"])})
    colours = {h: plt.cm.tab10(i % 10) for i, h in enumerate(hosts)}
    fig, ax = plt.subplots(figsize=(7, 0.9 + 0.6 * 2 * len(rows)))
    y, labels = 0, []
    for r in rows:
        for m in ("even", "auto"):
            left = 0.0
            for h, share, _label in work_of(r[m]["placement"]):
                ax.barh(y, share, left=left, color=colours[h], edgecolor="white")
                ax.text(left + share / 2, y, h, ha="center", va="center", fontsize=7)
                left += share
            labels.append(f"{r['strategy']} {m}: {r[m]['tokens_per_s']:,.0f} tok/s")
            y += 1
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("share of the work (batch, layers or heads)")
    ax.set_title("who got what: even vs auto (by measured speed)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def markdown(rows: list[dict], png: str | None) -> list[str]:
    out = [
        "",
        "## Placement by measured speed",
        "",
        "| strategy | even tok/s (plan) | even tok/s (measured) | auto tok/s (plan) | auto tok/s (measured) "
        "| gain plan | gain measured |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pe, pa = r["plan"]["predicted"]["even"], r["plan"]["predicted"]["auto"]
        gm = r["auto"]["tokens_per_s"] / r["even"]["tokens_per_s"] if r["even"]["tokens_per_s"] else 0
        out.append(
            f"| {r['strategy']} | {pe['tokens_per_s']:,.0f} | {r['even']['tokens_per_s']:,.0f} | "
            f"{pa['tokens_per_s']:,.0f} | {r['auto']['tokens_per_s']:,.0f} | {r['plan']['speedup'] or 0:.2f}x | "
            f"{gm:.2f}x |"
        )
    for r in rows:
        out += ["", f"{r['strategy']} auto: " + "; ".join(r["auto"]["placement"].get("why") or [])]
    if png:
        out += ["", f"![who got what]({png})"]
    return out


def placement_stage(
    stage, console, py: str, inv: Path, links: Path, out: Path, steps: str, report: Path, quick: bool = False
) -> None:
    """Run the stage and append its section to the demo's REPORT.md (--quick: dp only)."""
    compute = out / "compute.json"  # the compute stage's calibration of these hosts
    rows = []
    for strat in STRATEGIES[:1] if quick else STRATEGIES:
        row = {"strategy": strat}
        plan = out / f"plan-placement-{strat}.json"
        stage.run(
            f"8. plan: {strat} placed by measured speed",
            [
                py,
                "-m",
                "smoltrain",
                "plan",
                "--strategy",
                strat,
                "-i",
                str(inv),
                "--links",
                str(links),
                "--compute",
                str(compute),
                "--placement",
                "auto",
                "--microbatches",
                "4",
                "--batch",
                BATCH,
                "--no-what-if",
                "--json",
                str(plan),
            ],
        )
        row["plan"] = json.loads(plan.read_text())["placement"]
        for mode in ("even", "auto"):
            rj = out / f"placement-{strat}-{mode}.json"  # not run-*.json: those are the demo's main runs
            stage.run(
                f"9. train: {strat} --placement {mode}",
                [
                    py,
                    "-m",
                    "smoltrain",
                    "run",
                    "--strategy",
                    strat,
                    "-i",
                    str(inv),
                    "--steps",
                    steps,
                    "--microbatches",
                    "4",
                    "--batch",
                    BATCH,
                    "--compute",
                    str(compute),
                    "--placement",
                    mode,
                    "--json",
                    str(rj),
                    "--out",
                    str(out),
                ],
                timeout=900,
            )
            doc = json.loads(rj.read_text())
            row[mode] = {"tokens_per_s": tokens_per_s_after_warmup(doc) or 0.0, "placement": doc.get("placement") or {}}
        rows.append(row)
        console.print(
            f"  {strat}: even {row['even']['tokens_per_s']:,.0f} tok/s, auto "
            f"{row['auto']['tokens_per_s']:,.0f} tok/s (plan: {row['plan'].get('speedup') or 0:.2f}x)"
        )
    png = out / "placement.png"
    lines = markdown(rows, png.name if picture(rows, png) else None)
    with open(report, "a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":  # python -m smoltrain.commands.demo_placement ROWS.json: redraw from saved rows
    rows = json.loads(Path(sys.argv[1]).read_text())
    print("\n".join(markdown(rows, "placement.png" if picture(rows, Path("placement.png")) else None)))
