"""The demo report's pictures: the loss curves, and who got what under even and auto placement."""

from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def loss_chart(runs: dict[str, dict], path: Path) -> bool:
    if not runs:
        return False
    from smolnet.files import save_figure_atomic

    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=110)
    for i, (name, run) in enumerate(runs.items()):
        steps = [s["step"] for s in run.get("steps", [])]
        loss = [s["loss"] for s in run.get("steps", [])]
        ax.plot(steps, loss, marker="o", ms=3, color=plt.cm.tab10(i % 10), label=f"{name} ({run.get('backend')})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over global batch)")
    ax.set_title("Training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure_atomic(fig, str(path))
    return True


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


def placement_picture(rows: list[dict], path: Path) -> bool:
    """Stacked bars: each strategy's even and auto placement, one colour per host."""
    rows = [r for r in rows if all(r.get(m) for m in ("even", "auto"))]
    if not rows:
        return False
    from smolnet.files import save_figure_atomic

    plt = _plt()
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
            labels.append(f"{r['strategy']} {m}: {r[m]['measured'] or 0:,.0f} tok/s")
            y += 1
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("share of the work (batch, layers or heads)")
    ax.set_title("who got what: even vs auto (by measured speed)")
    fig.tight_layout()
    save_figure_atomic(fig, str(path))
    return True
