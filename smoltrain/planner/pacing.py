"""Paced shares: an outer-step strategy's sequences per host counted over the H batches of an
outer step rather than each batch, in proportion to each host's pace.

One arithmetic for the run and its plan. diloco under `--placement auto` lays out its first
outer step from the plan's paces (each host's placed sequences per step over the compute
seconds the plan gave it for them) and the roster re-balances later ones from measured pace
(strategies.roster); the plan predicts each rank's compute, the step, H and the memory from
the same split (planner.paced). Whole sequences of one batch can leave a host a second a
step behind the others; counted over H batches a host gets, say, 1.23 of 8 a step, trained
as 1 or 2 in each inner step (placement.paced_ranges). Torch-free: the planner imports it.
"""

from __future__ import annotations

from smoltrain.planner.placement import counts_from_shares, paced_ranges, split_batch


def placed_paces(placement: dict | None, batch: int) -> dict[str, float]:
    """Each host's pace (sequences per second) from an auto placement: its sequences per step
    (`shares` of `batch`) over the compute seconds the plan gave it for them (`compute_s`, per
    rank); empty without them (an even or hand-given split, a placement from elsewhere)."""
    p = placement or {}
    order, shares, secs = p.get("order") or [], p.get("shares"), p.get("compute_s")
    if p.get("mode") != "auto" or not shares or not secs or len(secs) != len(order):
        return {}
    counts = counts_from_shares(batch, list(shares))
    return {n: c / s for n, c, s in zip(order, counts, secs) if c > 0 and s > 0}


def paced_counts(pace: dict[str, float], names: list[str], steps: int, batch: int) -> dict | None:
    """The sequences each member trains over the next `steps` batches, in proportion to its pace
    ({steps, counts}: the roster's `paced`), or None where a member has no pace. A host's fixed
    cost per step makes its pace grow with its share, so this moves toward equal times in steps
    rather than at once; equal times are its fixed point."""
    total = steps * batch
    if steps < 1 or total < len(names) or any(n not in pace for n in names):
        return None
    cuts = split_batch(total, [pace[n] for n in names])  # at least one sequence each: paces stay measured
    return {"steps": steps, "counts": {n: hi - lo for n, (lo, hi) in zip(names, cuts)}}


def per_step(paced: dict, names: list[str], batch: int) -> list[list[int]]:
    """Per member (in `names` order), the sequences it trains in each inner step of the paced
    outer step (floor(n/steps) or one more: placement.paced_ranges, as the run slices them)."""
    ranges = paced_ranges(batch, int(paced["steps"]), [int(paced["counts"][n]) for n in names])
    return [[hi - lo for lo, hi in rank] for rank in ranges]
