"""The CPU-quota model: how a host held to a Linux CFS quota spends its time.

It applies to capped hosts only: a rank whose compute report read both a CPU limit and the
period it is enforced over (`cpu_limit_cores` and `cpu_period_s`), or whose busy thread showed
a throttle cycle (`cpu_cycle`: a hidden cap), gets `Rank.cpu_quota` (HostCompute.quota()),
and a comm cost flagged `quota` (a cap below the cores a rank needs for compute plus sends).
Everything else (an uncapped Pi or Mac, a rank sharing a machine) never reaches these terms,
and the plan for it is the plain alpha-beta and FLOP model of timing.py and capacity.py.

Behaviours of CFS, measured on the sim and standard Linux semantics:

- quota bursts: a process runs at full speed while its period's quota lasts, then waits for
  the next period; a training chain's stages work in bursts, laid out on the periods in cfs.py;
- a capped end pays CPU and wire in turn: once its quota is spent nothing drains its
  socket until the next period, so its per-byte CPU time and the wire's add up;
- a batch-1 decode chain (one token in flight) runs each stage at full speed while its
  quota lasts, and no host spends more than its quota over time: a token takes the
  chain's work at full speed, or the busiest host's work at its cap's pace if longer.
"""

from __future__ import annotations


def in_turn_mbit(rate_mbit: float, wire_mbit: float, capped_cpu_mbit: list[float]) -> float:
    """A link's rate when an end is held to a quota: its CPU time per byte and the wire's
    add up (measured on the sim: a 0.15-core host moved 62-81 MB/s over a 119 MB/s wire with
    CPU for 143). No capped end: `rate_mbit` unchanged."""
    if not capped_cpu_mbit:
        return rate_mbit
    return min(rate_mbit, 1 / (1 / wire_mbit + 1 / min(capped_cpu_mbit)))


def decode_chain(stage_s: list, ranks: list, tr, names: list[str], wire) -> float | None:
    """Seconds per token of a batch-1 decode chain (pp) with a quota host among its ranks;
    None when none is held to a quota. Each rank's work per token is its stage plus its
    messages, all at the rank's pace as measured. A message handled costs a whole ring
    step's `message_s` (comm_cpu: one sent and one received), not half: in a chain every
    message wakes a peer that slept a whole trip, and on the home sim a pp rank spent
    0.109-0.134 ms CPU a message sent or received where a tp rank of the same run spent
    0.094-0.127 ms a ring step (generate --json decode.per_rank; issue 36). A byte moved
    costs each end half a ring step's. A token crosses
    every stage in turn at full speed (a quota host's pace times its cap) plus the wire's
    latency and bytes; over many tokens a quota host does its own work at no more than its
    cap: its pace. The longer of the two."""
    if not any(rk.cpu_quota for rk in ranks):
        return None
    msgs, nbytes = tr.link_msgs(), tr.link_bytes()
    chain, busiest = 0.0, 0.0
    for i, rk in enumerate(ranks):
        cc = rk.comm_cpu
        handled = sum(m for (s, d), m in msgs.items() if i in (s, d))
        moved = sum(b for (s, d), b in nbytes.items() if i in (s, d))
        work = stage_s[i] + handled * cc["message_s"] + moved / cc["bytes_s"] / 2 if cc else stage_s[i]
        chain += work * (rk.cpu_quota[0] / rk.cpu_quota[1] if rk.cpu_quota else 1.0)
        busiest = max(busiest, work)
    for (s, d), m in msgs.items():
        chain += wire.get(names[s], names[d]).seconds(nbytes[(s, d)], m)
    return max(chain, busiest)
