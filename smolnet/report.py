"""The link report: judge each measured direction, then write links.json, links.md, links.png.

`assess_links` is the one place that turns figures into warnings and a status, so the
JSON, the Markdown findings, the heatmap and the terminal table always agree.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

from smolnet.files import save_figure_atomic
from smolnet.files import write_text_atomic as write_atomic

SCHEMA = "smolnet.links/1"
STATUSES = ("ok", "degraded", "down")
WARNINGS = ("mtu-mismatch", "mtu-blackhole", "asymmetric", "below-ceiling", "probe-limited", "probe-failed")
MTU_TOLERANCE = 8  # probes are exact to this; veth also accepts MTU+4
ASYMMETRIC = 0.7
BELOW_CEILING = 0.8
BLACKHOLE_FRACTION = 0.01  # "about nothing": under 1 % of the ceiling ...
BLACKHOLE_MBIT = 1.0  # ... or under 1 Mbit/s when the ceiling is unknown
RTT_KEYS = ("min", "p50", "p90", "p99", "max")


def ceiling_mbit(rate_mbit: float | None, mtu: int | None) -> float | None:
    """TCP goodput a rated Ethernet link allows: headers 52 B per packet, 38 B on the wire."""
    if not rate_mbit or not mtu:
        return None
    return round(rate_mbit * (mtu - 52) / (mtu + 38), 1)


def _min(*values):
    vals = [v for v in values if v is not None]
    return min(vals) if vals else None


def _r(x, nd=1):
    return None if x is None else round(float(x), nd)


def assess_links(hosts: list[dict], raws: list[dict]) -> list[dict]:
    """Contract link entries from raw per-direction results.

    A raw result: {src, dst, error?, rtt?, rtt_error?, pmtu?, pmtu_error?, tput?, tput_error?}.
    """
    by_name = {h["name"]: h for h in hosts}
    links = []
    for raw in raws:
        a, b = by_name.get(raw["src"], {}), by_name.get(raw["dst"], {})
        cfg = _min(a.get("mtu_configured"), b.get("mtu_configured"))
        pm = raw.get("pmtu") or {}
        eff = pm.get("mtu_effective")
        path_mtu = _min(cfg, eff)
        rate = _min(a.get("link_rate_mbit"), b.get("link_rate_mbit"))
        tp = raw.get("tput") or {}
        rtt = raw.get("rtt")
        link = {
            "src": raw["src"],
            "dst": raw["dst"],
            "status": "ok",
            "throughput_mbit": _r(tp.get("throughput_mbit")) if tp else None,
            "retransmits": tp.get("retransmits") if tp else None,
            "rtt_us": {k: rtt.get(k) for k in RTT_KEYS} if rtt else None,
            "mtu_effective": eff,
            "mtu_configured": cfg,
            "ceiling_mbit": ceiling_mbit(rate, path_mtu),
            "method": tp.get("method") if tp else None,
            "warnings": [],
            "error": None,
        }
        errors = []
        if raw.get("error"):
            errors.append(raw["error"])
        if raw.get("tput_error"):
            errors.append(f"throughput: {raw['tput_error']}")
        for what in ("rtt", "pmtu"):
            if raw.get(f"{what}_error") and not raw.get("error"):
                link["warnings"].append("probe-failed")
                errors.append(f"{what}: {raw[f'{what}_error']}")
        if pm.get("error"):
            link["warnings"].append("probe-failed")
            errors.append(f"mtu: {pm['error']}")
        if eff is not None and cfg is not None and eff + MTU_TOLERANCE < cfg:
            link["warnings"].append("mtu-mismatch")
        blackhole = False
        if tp:
            x = tp.get("throughput_mbit") or 0.0
            ceil = link["ceiling_mbit"]
            floor = BLACKHOLE_FRACTION * ceil if ceil else BLACKHOLE_MBIT
            if tp.get("connected", True) and x < max(floor, BLACKHOLE_MBIT * 0.1):
                blackhole = True
                link["warnings"].append("mtu-blackhole")
                errors.append("TCP connects but about nothing is delivered")
            elif ceil and x < BELOW_CEILING * ceil:
                link["warnings"].append("below-ceiling")
            if tp.get("cpu_limited") and not blackhole:
                link["warnings"].append("probe-limited")
        link["warnings"] = sorted(set(link["warnings"]), key=WARNINGS.index)
        link["error"] = "; ".join(dict.fromkeys(errors)) or None
        link["_blackhole"] = blackhole
        links.append(link)
    index = {(l["src"], l["dst"]): l for l in links}
    for l in links:
        rev = index.get((l["dst"], l["src"]))
        x, y = l["throughput_mbit"], rev and rev["throughput_mbit"]
        if x is not None and y and not l["_blackhole"] and not rev["_blackhole"] and x < ASYMMETRIC * y:
            l["warnings"].append("asymmetric")
            l["warnings"] = sorted(set(l["warnings"]), key=WARNINGS.index)
    for l in links:
        hard_fail = l["throughput_mbit"] is None and l["error"] is not None
        if l.pop("_blackhole") or hard_fail:
            l["status"] = "down"
        elif l["warnings"]:
            l["status"] = "degraded"
    return links


def build_report(
    hosts: list[dict], links: list[dict], settings: dict, incomplete: bool = False, extra: dict | None = None
) -> dict:
    doc = {
        "schema": SCHEMA,
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "settings": settings,
        "incomplete": bool(incomplete),
        "hosts": hosts,
        "links": links,
    }
    doc.update(extra or {})
    return doc


def validate_report(doc: dict) -> list[str]:
    """Everything in doc that breaks the smolnet.links/1 contract (empty list: valid).

    The structure is the JSON Schema's (smolnet/schemas/links-1.json); what a schema cannot
    say (links between hosts of the report, ordered percentiles, every pair measured) is here.
    """
    from smolnet.schema import schema_errors

    bad = schema_errors(doc, SCHEMA)
    if bad:
        return bad
    names = {h["name"] for h in doc["hosts"]}
    seen = set()
    for l in doc["links"]:
        where = f"link {l['src']}->{l['dst']}"
        if l["src"] not in names or l["dst"] not in names or l["src"] == l["dst"]:
            bad.append(f"{where}: src/dst must be two different hosts of the report")
        seen.add((l["src"], l["dst"]))
        r = l["rtt_us"]
        if r is not None and [r[k] for k in RTT_KEYS] != sorted(r[k] for k in RTT_KEYS):
            bad.append(f"{where}: rtt_us must be ordered min <= p50 <= p90 <= p99 <= max")
    if not doc.get("incomplete") and doc["settings"].get("scope", "matrix") == "matrix":
        want = {(a, b) for a in names for b in names if a != b}
        if want - seen:
            bad.append(f"missing links: {sorted(want - seen)[:4]}")
    return bad


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
