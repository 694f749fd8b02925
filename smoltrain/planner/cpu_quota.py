"""The CPU-quota model: how a host held to a Linux CFS quota spends its time.

It applies to capped hosts only: a rank whose compute report read both a CPU limit and the
period it is enforced over (`cpu_limit_cores` and `cpu_period_s`), or whose busy thread showed
a throttle cycle (`cpu_cycle`: a hidden cap), gets `Rank.cpu_quota` (HostCompute.quota()),
and a comm cost flagged `quota` (a cap below the cores a rank needs for compute plus sends).
Everything else (an uncapped Pi or Mac, a rank sharing a machine) never reaches these terms,
and the plan for it is the plain alpha-beta and FLOP model of timing.py and capacity.py, but
for a batch-1 decode chain, whose one rule (decode_chain) holds capped or not: a quota only
makes its stages burst.

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

from smoltrain.calibration.pace import HELD_BACK


def in_turn_mbit(rate_mbit: float, wire_mbit: float, capped_cpu_mbit: list[float]) -> float:
    """A link's rate when an end is held to a quota: its CPU time per byte and the wire's
    add up (measured on the sim: a 0.15-core host moved 62-81 MB/s over a 119 MB/s wire with
    CPU for 143). No capped end: `rate_mbit` unchanged."""
    if not capped_cpu_mbit:
        return rate_mbit
    return min(rate_mbit, 1 / (1 / wire_mbit + 1 / min(capped_cpu_mbit)))


def _burst_share(rk) -> float | None:
    """A CPU second's wall time at full speed, over its time at the rank's pace: the quota's
    share of its period where one was read or seen, else 1/pace where the host ran held back
    without showing its period (a hidden cap; a long period shows no cycle within the probe's
    windows). None: the rank is not held back. A draw's hidden 0.08-core hosts (pace 12.9 and
    6.7, no cycle read; random:774035478, issue 36) ran a pp decode stage's 0.5-0.8 ms of CPU in
    0.7-2.3 ms of wall time, not at their pace: charged at it, the plan was 1.85x too slow."""
    if rk.cpu_quota:
        return rk.cpu_quota[0] / rk.cpu_quota[1]
    return 1 / rk.pace if rk.pace > HELD_BACK else None


def held_back(ranks: list) -> bool:
    """Whether any rank runs held back (a quota, read or hidden): its chain runs in bursts."""
    return any(_burst_share(rk) is not None for rk in ranks)


def decode_chain(stage_s: list, ranks: list, tr, names: list[str], wire) -> float:
    """Seconds per token of a batch-1 decode chain (pp). Each rank's work per token is its
    stage plus its messages, all at the rank's pace as measured. A message handled costs a
    whole ring step's `message_s` (comm_cpu: one sent and one received) at each end, not half
    and not the slower end's alone: in a chain every message wakes a peer that slept a whole
    trip, and sender and receiver pay in turn. On the home sim a pp rank spent 0.109-0.134 ms
    CPU a message sent or received where a tp rank of the same run spent 0.094-0.127 ms a ring
    step; on `cores`, uncapped, 0.13-0.15 ms against a calibrated 0.115 (generate --json
    decode.per_rank; issue 36). A byte moved costs each end half a ring step's. A token
    crosses every stage in turn at full speed (a quota host's pace times its cap; any other
    host's pace) plus the wire's latency and bytes; over many tokens a quota host does its own
    work at no more than its cap: its pace. The longer of the two."""
    full = [_burst_share(rk) for rk in ranks]
    msgs, nbytes = tr.link_msgs(), tr.link_bytes()
    chain, busiest = 0.0, 0.0
    for i, rk in enumerate(ranks):
        cc = rk.comm_cpu
        handled = sum(m for (s, d), m in msgs.items() if i in (s, d))
        moved = sum(b for (s, d), b in nbytes.items() if i in (s, d))
        work = stage_s[i] + handled * cc["message_s"] + moved / cc["bytes_s"] / 2 if cc else stage_s[i]
        chain += work * (full[i] or 1.0)
        busiest = max(busiest, work)
    for (s, d), m in msgs.items():
        chain += wire.get(names[s], names[d]).seconds(nbytes[(s, d)], m)
    return max(chain, busiest)
