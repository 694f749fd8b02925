"""The bars bench/bench_faults.py is judged on: what one fault cell, and one damaged checkpoint,
must show to count as handled."""

from __future__ import annotations

BAR = "fault matrix: 7 strategies x 5 faults detected within 15 s, right culprit"
CK_BAR = "damaged checkpoints x 7 strategies: skipped saying why, resumed from the intact one"


def cell_ok(row: dict) -> bool:
    """One fault cell met the bar: a flood served the legitimate client; any other fault was
    detected within 15 s and, where a worker was the culprit, blamed on it; a stopped
    controller blames itself, not rank 0."""
    if row["fault"] == "flood":
        return bool(row.get("legit_served"))
    if row["fault"] == "ctlstop" and row.get("blamed") == "rank0":
        return False
    return row.get("detect_s") is not None and row["detect_s"] <= 15 and row.get("right_culprit", True)


def ck_ok(row: dict) -> bool:
    """One damaged checkpoint met the bar: resumed from step 2 saying what it skipped, with the
    first run's losses; with nothing intact, refused."""
    if row["fault"] == "ck-none":
        return row["rc"] != 0
    return row.get("resumed_from") == 2 and bool(row.get("skipped")) and bool(row.get("losses_match"))
