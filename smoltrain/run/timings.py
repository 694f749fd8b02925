"""Per-rank timings of one step: compute, communication and waiting, adding up to the step.

Why: a step time alone cannot say whether a prediction missed on compute or on the links.
Each worker reports its own step time and the time it spent inside communication calls;
inside those calls a rank both moves bytes and waits for slower peers, and no transport
tells the two apart. The rank that spent least time in communication arrived last and
waited least, so its figure is taken as the transfer time every rank pays; the rest of a
rank's communication time, and its idle time until the slowest rank finishes, is waiting:

    compute_s = own step - own communication
    comm_s    = the least communication time of any rank this step
    wait_s    = step - compute_s - comm_s      (step: the slowest rank's step time)
"""

from __future__ import annotations


def rank_timings(parts: dict[int, tuple[float, float]], step_s: float) -> list[dict]:
    """parts: rank -> (its step seconds, its seconds in communication)."""
    if not parts:
        return []
    comm = max(0.0, min(c for _, c in parts.values()))
    out = []
    for rank in sorted(parts):
        own, own_comm = parts[rank]
        compute = max(0.0, own - own_comm)
        c = min(comm, max(0.0, step_s - compute))
        out.append({"rank": rank, "compute_s": compute, "comm_s": c, "wait_s": max(0.0, step_s - compute - c)})
    return out
