"""Per-rank timings of one step: compute, communication and waiting, adding up to the step.

Why: a step time alone cannot say whether a prediction missed on compute or on the links.
Each worker reports its own step time and the time it spent inside communication calls;
inside those calls a rank both moves bytes and waits for slower peers, and no transport
tells the two apart. A rank's compute is what is left of its own step:

    compute_s = own step - own communication

Communication is each rank's own: the time it spent in communication calls less the time
it waited there for its peers' compute. With R the step's compute critical path (ranks side by
side: the slowest rank's compute; pipeline stages (mp, pp): their measured compute laid out on
the schedule with free hops, each stage's optimizer update (which it times apart) run as soon
as its own last backward ends, in parallel with the stages before it: `planner.timing.pipeline`,
the plan's own schedule), a rank whose own step ended at `own` moved bytes for what its step
holds beyond R:

    comm_s = own - R, within 0 .. its own communication time

so each figure comes from that rank's own step and calls, not one number copied to every rank.
In a lockstep step (a ring) every rank's own step is the step period, so the figures agree, as
the plan predicts; they part where a rank's step runs longer than its peers' (it still sends
when they are done: a server's replies). The stages of a chain share one period, but each
counts its step from its own place in the cycle, so a stage's comm_s is the step's beyond R.
Telling a slow link's bytes apart from the wait for a peer inside one call needs the transport
to time them apart, which it does not.

    wait_s = step - compute_s - comm_s      (step: the slowest rank's step time)

A rank that knows where it waited outside any call (diloco: at the roster's sync for its late
peers, `own_wait`) reports that too; it is neither its compute nor its communication:

    compute_s = own step - own communication - own wait

Its communication is then its own time in calls: it timed its wait apart, and its calls
started with its peers' (after the sync), so none of their time is a wait for a peer's compute.
The wait lands in wait_s, as a wait inside a call does for the other strategies.
"""

from __future__ import annotations


def rank_timings(parts: dict[int, tuple], step_s: float, stages_m: int | None = None) -> list[dict]:
    """parts: rank -> (its step seconds, its seconds in communication[, its seconds waiting
    outside communication[, of its compute, its optimizer update]]). stages_m: the number of
    microbatches when the ranks are pipeline stages in rank order (1 for mp), else None."""
    if not parts:
        return []
    parts = {r: tuple(float(v[i]) if len(v) > i else 0.0 for i in range(4)) for r, v in parts.items()}
    compute = {r: max(0.0, own - own_comm - own_wait) for r, (own, own_comm, own_wait, _) in parts.items()}
    if stages_m and len(parts) > 1:
        from smoltrain.planner.timing import critical_path

        order = sorted(compute)
        stages, updates = [compute[r] for r in order], [min(parts[r][3], compute[r]) for r in order]
        critical = critical_path(stages, updates, stages_m)
    else:
        critical = max(compute.values())
    out = []
    for rank in sorted(parts):
        own, own_comm, own_wait, own_update = parts[rank]
        # its calls' time not spent waiting: beyond the critical path in its own step, or, for a
        # stage of a chain, in the step's (where a stage's step starts and ends is its own place
        # in the cycle, not the period: on a capped 4-stage mp run the own steps of one step were
        # 169-220 ms, the critical path 254 ms, and every stage read 0 comm in a 264 ms step
        # whose hops took 34)
        beyond = own_comm if own_wait else max(0.0, (step_s if stages_m else own) - critical)
        c = min(own_comm, beyond, max(0.0, step_s - compute[rank]))
        row = {"rank": rank, "compute_s": compute[rank], "comm_s": c, "wait_s": max(0.0, step_s - compute[rank] - c)}
        raw = dict(own_step_s=own, own_comm_s=own_comm) | (dict(own_wait_s=own_wait) if own_wait else {})
        raw |= dict(own_update_s=own_update) if own_update else {}
        out.append(row | raw)  # the rank's raw figures, to re-derive these
    return out
