"""Per-rank timings of one step: compute, communication and waiting, adding up to the step.

Why: a step time alone cannot say whether a prediction missed on compute or on the links.
Each worker reports its own step time and the time it spent inside communication calls;
inside those calls a rank both moves bytes and waits for slower peers, and no transport
tells the two apart. A rank's compute is what is left of its own step:

    compute_s = own step - own communication

Communication is a figure of the step, the same for every rank, as the plan predicts it:

  - ranks that compute side by side (dp, tp, ...): the rank that spent least time in
    communication arrived last and waited least, so its figure is taken as the transfer
    time every rank pays;
  - pipeline stages (mp, pp) wait for each other by design, so no rank's communication
    time is free of waiting; there it is what the step holds beyond the stages' measured
    compute laid out on the schedule (`planner.timing.pipeline` with free hops).

    wait_s = step - compute_s - comm_s      (step: the slowest rank's step time)
"""

from __future__ import annotations


def rank_timings(parts: dict[int, tuple[float, float]], step_s: float, stages_m: int | None = None) -> list[dict]:
    """parts: rank -> (its step seconds, its seconds in communication). stages_m: the number
    of microbatches when the ranks are pipeline stages in rank order (1 for mp), else None."""
    if not parts:
        return []
    compute = {r: max(0.0, own - own_comm) for r, (own, own_comm) in parts.items()}
    if stages_m and len(parts) > 1:
        from smoltrain.planner.timing import pipeline

        stages = [compute[r] for r in sorted(compute)]
        critical, _ = pipeline(stages, [0.0] * (len(stages) - 1), [0.0] * (len(stages) - 1), stages_m, True)
        comm = max(0.0, step_s - critical)
    else:
        comm = max(0.0, min(c for _, c in parts.values()))
    out = []
    for rank in sorted(parts):
        c = min(comm, max(0.0, step_s - compute[rank]))
        out.append(
            {"rank": rank, "compute_s": compute[rank], "comm_s": c, "wait_s": max(0.0, step_s - compute[rank] - c)}
        )
    return out
