"""Judging the links: turn measured figures into warnings and a status, and build/validate the document.

`assess_links` is the one place that makes that judgement, so the JSON, the Markdown findings,
the heatmap and the terminal table (all in `render`) always agree.
"""

from __future__ import annotations

from datetime import datetime, timezone

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
