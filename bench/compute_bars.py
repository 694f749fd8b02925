"""The bars bench/bench_compute.py is judged on, and its verdicts: per scenario, how many runs
landed within 25% of their plan, and whether the calibrated shares follow each host's cap."""

from __future__ import annotations

BAR = (
    "step time, and every rank's compute and communication, within 25% of the plan from measured compute and links, "
    "bytes within 2%, every run of every scenario; pp and tp decode tokens/s within 25% of the plan on the same clusters"
)


def verdict(results: list[dict]) -> tuple[bool, str]:
    """Whether every run met the bar, and the headline: per scenario, runs within 25% and
    their range of measured/predicted."""
    parts, met = [], True
    for res in results:
        if res.get("error"):  # its sim or calibration failed: a miss, said as one
            met = False
            parts.append(f"{res['scenario']} FAILED")
            continue
        rows = [r for rows in res["sets"].values() for r in rows]
        q = [r["meas"] / r["pred"] for r in rows if "error" not in r]
        ok = sum(
            1
            for r in rows
            if "error" not in r and 0.75 <= r["meas"] / r["pred"] <= 1.25 and r["bytes_ok"] and not r.get("outside")
        )
        met = met and ok == len(rows)
        span = f" ({min(q):.2f}-{max(q):.2f})" if q else ""
        terms = sum(len(r.get("outside") or []) for r in rows)
        decode = [r for r in res.get("decode") or [] if "skipped" not in r]
        met = met and all(map(within, decode))
        said = tally([res])
        parts.append(
            f"{res['scenario']} {ok} of {len(rows)}{span}"
            + (f", {terms} rank terms outside 25%" if terms else "")
            + (f", {said}" if said else "")
        )
    return met, "; ".join(parts)


CAL_BAR = "calibrated share of a core within 15% of each host's cap; capped hosts rank in the order of their caps"


def calibration_verdict(results: list[dict]) -> tuple[bool, str]:
    """Whether every host's calibrated share is within 15% of its cap and every pair of hosts
    with different caps measured in the order of their caps, and the headline."""
    parts, met = [], True
    for res in results:
        cal = res.get("calibration") or []
        if not cal:
            continue
        near = sum(1 for c in cal if abs(c["ratio"] - 1) <= 0.15)
        ranked = all(a["cap"] * a["ratio"] < b["cap"] * b["ratio"] for a in cal for b in cal if a["cap"] < b["cap"])
        met = met and near == len(cal) and ranked
        parts.append(f"{res['scenario']} {near} of {len(cal)} within 15%, {'ranked' if ranked else 'NOT ranked'}")
    return met and bool(parts), "; ".join(parts) or "no calibration check ran"


def within(row: dict) -> bool:
    """A decode row ran and its tokens/s landed within 25% of the plan."""
    return "pred" in row and 0.75 <= row["meas"] / row["pred"] <= 1.25


def tally(results: list[dict]) -> str:
    """The headline's decode part (bench/compute_decode.py's rows): runs within 25% of all that ran, and their range."""
    rows = [r for res in results for r in res.get("decode") or [] if "skipped" not in r]
    if not rows:
        return ""
    q = [r["meas"] / r["pred"] for r in rows if "pred" in r]
    span = f" ({min(q):.2f}-{max(q):.2f})" if q else ""
    return f"decode {sum(map(within, rows))} of {len(rows)} within 25%{span}"
