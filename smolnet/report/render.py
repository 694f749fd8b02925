"""Rendering the link report: plain-word findings, links.md, the links.png heatmaps and the
terminal table. Kept apart from `assess` so the judgement stays small and free of matplotlib/rich.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from smolnet.files import save_figure_atomic
from smolnet.files import write_text_atomic as write_atomic
from smolnet.report.assess import MTU_TOLERANCE

# -- words --------------------------------------------------------------------------------


def _fmt(x, unit="") -> str:
    if x is None:
        return "n/a"
    return f"{x:,.0f}{unit}" if abs(x) >= 100 else f"{x:.1f}{unit}"


def findings(doc: dict) -> list[str]:
    """What is wrong, in plain words, with what to do about it."""
    out = []
    hosts = {h["name"]: h for h in doc["hosts"]}
    for h in doc["hosts"]:
        if h["status"] == "down":
            out.append(f"{h['name']}: not measured: {h['error']}.")
    links = {(l["src"], l["dst"]): l for l in doc["links"]}
    done = set()
    for (s, d), l in links.items():
        pair = frozenset((s, d))
        rev = links.get((d, s))
        if "mtu-mismatch" in l["warnings"] and pair not in done:
            done.add(pair)
            ms, md = hosts[s].get("mtu_configured"), hosts[d].get("mtu_configured")
            eff = l["mtu_effective"]
            if rev and rev["mtu_effective"] is not None:
                eff = min(eff, rev["mtu_effective"])
            carried = eff - eff % 100 if eff % 100 <= MTU_TOLERANCE else eff
            both = f"both ends are set to {ms}" if ms == md else f"{s} is set to {ms} and {d} to {md}"
            out.append(
                f"{s} <-> {d}: {both} but the path carries {carried}; large frames are dropped silently. "
                f"Set the switch port to {min(ms or eff, md or eff)} or both hosts to {carried}."
            )
    for (s, d), l in links.items():
        x = l["throughput_mbit"]
        w = l["warnings"]
        if l["status"] == "down" and "mtu-blackhole" in w:
            out.append(
                f"{s} -> {d}: TCP connects but about nothing arrives ({_fmt(x)} Mbit/s): an MTU black hole, "
                "not a slow link. Make every MTU on the path agree."
            )
        elif (
            l["status"] == "down"
            and hosts.get(s, {}).get("status") != "down"
            and hosts.get(d, {}).get("status") != "down"
        ):
            out.append(f"{s} -> {d}: down: {l['error']}.")
        if "asymmetric" in w:
            y = links[(d, s)]["throughput_mbit"]
            out.append(
                f"{s} -> {d} is the slow direction: {_fmt(x)} Mbit/s against {_fmt(y)} Mbit/s from {d} to {s}. "
                f"Check {s}'s uplink (cable, duplex, shaping, Wi-Fi)."
            )
        if "below-ceiling" in w:
            pct = 100 * x / l["ceiling_mbit"]
            out.append(
                f"{s} -> {d} reaches {_fmt(x)} Mbit/s, {pct:.0f}% of the {_fmt(l['ceiling_mbit'])} Mbit/s "
                "the rated speeds allow."
            )
        if "probe-limited" in w:
            out.append(
                f"{s} -> {d}: the sender ran out of CPU, so {_fmt(x)} Mbit/s is a lower bound (try --backend iperf3)."
            )
        if "probe-failed" in w:
            out.append(f"{s} -> {d}: a probe failed: {l['error']}.")
    if not out:
        out.append(f"All {len(doc['links'])} links are ok.")
    if doc.get("incomplete"):
        out.insert(0, "This report is incomplete: the run was interrupted before every link was measured.")
    return out


def _cell(l: dict | None, value: str) -> str:
    if l is None:
        return "n/a"
    if l["status"] == "down":
        return "down" if value.startswith("n/a") else f"{value} ✗"
    return f"{value} ⚠" if l["status"] == "degraded" else value


def _table(doc: dict, title: str, value) -> list[str]:
    names = [h["name"] for h in doc["hosts"]]
    links = {(l["src"], l["dst"]): l for l in doc["links"]}
    lines = [f"### {title}", "", "| src \\ dst | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for s in names:
        row = []
        for d in names:
            row.append("—" if s == d else _cell(links.get((s, d)), value(links.get((s, d)) or {})))
        lines.append(f"| **{s}** | " + " | ".join(row) + " |")
    return lines + [""]


def render_md(doc: dict) -> str:
    st = doc["settings"]
    lines = [
        "# Link report",
        "",
        f"Measured {doc['created']} with `{st.get('backend')}` throughput probes of {st.get('duration_s')} s"
        f"{' (incomplete run)' if doc.get('incomplete') else ''}. Rows are the source, columns the "
        "destination; ⚠ marks a degraded link, ✗ a link that is down.",
        "",
    ]
    lines += _table(doc, "Goodput (Mbit/s, receiver side)", lambda l: _fmt(l.get("throughput_mbit")))
    lines += _table(doc, "Round trip p50 (µs)", lambda l: _fmt((l.get("rtt_us") or {}).get("p50")))
    lines += _table(
        doc,
        "Effective MTU (bytes)",
        lambda l: f"{l.get('mtu_effective') or 'n/a'} / {l.get('mtu_configured') or 'n/a'}",
    )
    lines += ["(effective / configured)", "", "## Findings", ""]
    lines += [f"- {f}" for f in findings(doc)]
    lines += [
        "",
        "## Hosts",
        "",
        "| host | address | iface | MTU | rated Mbit/s | device | status |",
        "|---|---|---|---:|---:|---|---|",
    ]
    for h in doc["hosts"]:
        lines.append(
            f"| {h['name']} | {h['address']} | {h['iface'] or 'n/a'} | {h['mtu_configured'] or 'n/a'} | "
            f"{_fmt(h['link_rate_mbit'])} | {h['device']} | {h['status']}"
            f"{': ' + h['error'] if h['error'] else ''} |"
        )
    return "\n".join(lines) + "\n"


def render_png(doc: dict, path: str | os.PathLike) -> None:
    """Heatmaps (goodput, RTT p50, effective MTU) with values in the cells; cividis is
    readable with every common colour-vision deficiency; degraded cells are hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [h["name"] for h in doc["hosts"]]
    n = len(names)
    links = {(l["src"], l["dst"]): l for l in doc["links"]}
    # (title, value, format, shown on a down link: the MTU is what explains a black hole)
    panels = [
        ("Goodput, Mbit/s", lambda l: l["throughput_mbit"], "{:.0f}", False),
        ("RTT p50, µs", lambda l: (l["rtt_us"] or {}).get("p50"), "{:.0f}", False),
        ("Effective MTU, bytes", lambda l: l["mtu_effective"], "{:d}", True),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(4.2 * 3 + 1, 0.6 * n + 2.6))
    cmap = matplotlib.colormaps["cividis"].with_extremes(bad="#bbbbbb")
    for ax, (title, get, fmt, when_down) in zip(axes, panels):
        m = np.full((n, n), np.nan)
        for i, s in enumerate(names):
            for j, d in enumerate(names):
                l = links.get((s, d))
                v = get(l) if l and (l["status"] != "down" or when_down) else None
                if v is not None:
                    m[i, j] = v
        ax.imshow(np.ma.masked_invalid(m), cmap=cmap, aspect="auto")
        finite = m[np.isfinite(m)]
        mid = (finite.min() + finite.max()) / 2 if finite.size else 0
        for i, s in enumerate(names):
            for j, d in enumerate(names):
                l = links.get((s, d))
                if s == d:
                    text = "—"
                elif l is None:
                    text = "n/a"
                elif l["status"] == "down" and not np.isfinite(m[i, j]):
                    text = "down"
                else:
                    v = m[i, j]
                    text = fmt.format(int(v) if fmt == "{:d}" else v) if np.isfinite(v) else "n/a"
                colour = "black" if (np.isfinite(m[i, j]) and m[i, j] > mid) else "white"
                if s == d or not np.isfinite(m[i, j]):
                    colour = "black"
                if s == d:
                    ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, color="white"))
                elif l is not None and l["status"] == "degraded":
                    ax.add_patch(
                        plt.Rectangle(
                            (j - 0.5, i - 0.5), 1, 1, fill=False, hatch="//", edgecolor="#E69F00", linewidth=2
                        )
                    )
                    text += " !"
                elif l is not None and l["status"] == "down":
                    ax.add_patch(
                        plt.Rectangle(
                            (j - 0.5, i - 0.5), 1, 1, fill=False, hatch="xx", edgecolor="#CC79A7", linewidth=2
                        )
                    )
                    if text != "down":
                        text += "\ndown"
                ax.text(j, i, text, ha="center", va="center", color=colour, fontsize=9, fontweight="bold")
        ax.set_xticks(range(n), names, rotation=30, ha="right")
        ax.set_yticks(range(n), names)
        ax.set_xlabel("destination")
        ax.set_ylabel("source")
        ax.set_title(title)
    fig.suptitle(
        "smolnet link report"
        + (" (incomplete)" if doc.get("incomplete") else "")
        + "  ·  orange // and ! = degraded, pink xx = down, grey = no value"
    )
    fig.tight_layout()
    save_figure_atomic(fig, path)


def write_report(doc: dict, out_dir: str | os.PathLike | None, json_file: str | None = None) -> list[str]:
    """links.json, links.md and links.png under out_dir, plus json_file when given."""
    written = []
    text = json.dumps(doc, indent=2) + "\n"
    if out_dir is not None:
        d = Path(out_dir)
        write_atomic(d / "links.json", text)
        write_atomic(d / "links.md", render_md(doc))
        render_png(doc, d / "links.png")
        written += [str(d / "links.json"), str(d / "links.md"), str(d / "links.png")]
    if json_file:
        write_atomic(json_file, text)
        written.append(json_file)
    return written


def rich_table(doc: dict):
    from rich.table import Table

    t = Table(title="smolnet links" + (" (incomplete)" if doc.get("incomplete") else ""))
    for col, kw in (
        ("link", {}),
        ("status", {}),
        ("goodput Mbit/s", {"justify": "right"}),
        ("ceiling", {"justify": "right"}),
        ("RTT p50 µs", {"justify": "right"}),
        ("MTU eff/cfg", {"justify": "right"}),
        ("method", {}),
        ("warnings / error", {}),
    ):
        t.add_column(col, **kw)
    colour = {"ok": "green", "degraded": "yellow", "down": "red"}
    for l in doc["links"]:
        t.add_row(
            f"{l['src']} → {l['dst']}",
            f"[{colour[l['status']]}]{l['status']}[/]",
            _fmt(l["throughput_mbit"]),
            _fmt(l["ceiling_mbit"]),
            _fmt((l["rtt_us"] or {}).get("p50")),
            f"{l['mtu_effective'] or 'n/a'}/{l['mtu_configured'] or 'n/a'}",
            l["method"] or "-",
            ", ".join(l["warnings"]) or (l["error"] or ""),
        )
    return t
