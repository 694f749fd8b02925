"""The CPU-quota model: how a host held to a Linux CFS quota spends its time.

It applies to capped hosts only: a rank whose compute report measured both a CPU limit and
the period it is enforced over (`cpu_limit_cores` and `cpu_period_s`, HostCompute.quota())
gets `Rank.cpu_quota`, and a comm cost flagged `quota` (a cap below the cores a rank needs
for compute plus sends). Everything else (an uncapped Pi or Mac, a host whose cap cannot be
read, a rank sharing a machine) never reaches these terms, and the plan for it is the plain
alpha-beta and FLOP model of timing.py and capacity.py.

Behaviours of CFS, measured on the sim and standard Linux semantics:

- quota bursts: a process that idled at least a period starts its next stretch of work on
  a whole period's quota at full speed, then continues at the cap's average pace;
- a capped end pays CPU and wire in turn: once its quota is spent nothing drains its
  socket until the next period, so its per-byte CPU time and the wire's add up;
- a batch-1 decode chain (one token in flight) runs each stage at full speed while its
  quota lasts, and no host spends more than its quota over time: a token takes the
  chain's work at full speed, or the busiest host's work at its cap's pace if longer.
"""

from __future__ import annotations


def quota_seconds(t: float, quota: tuple[float, float] | None) -> float:
    """Wall seconds of a stretch of work that takes `t` at a CFS-capped host's average pace,
    begun after the host idled at least a period: the period's whole quota runs at full
    speed, then the cap's pace. Measured in a 2.5 ms / 10 ms cgroup: 7.5 ms of CPU took
    22.9 ms, not the 30 the pace says; 30.8 ms took 112, not 123."""
    if not quota:
        return t
    q, period = quota
    return t * q / period if t <= period else t - (period - q)


def quota_stages(stage_s: list, optimizer_s: list, hop_f: list, hop_b: list, quotas: list) -> list:
    """A one-microbatch pipeline's stage times on quota-held hosts. A stage works twice per
    step, its forward and then its backward and update, idle in between while the others
    work. A stretch after an idle gap of a period or more starts on a fresh quota. The
    first stage's backward runs straight into the next step's forward, and the last stage's
    forward into its backward; each of them is then one stretch."""
    n = len(stage_s)
    fwd = [(s - o) / 3 for s, o in zip(stage_s, optimizer_s)]
    out = []
    for i in range(n):
        if not quotas[i]:
            out.append(stage_s[i])
            continue
        period = quotas[i][1]
        # idle from the forward's end to the backward's start, and from the update to the next forward
        gap_f = sum(stage_s[i + 1 :]) + sum(hop_f[i:]) + sum(hop_b[i:])
        gap_b = sum(stage_s[:i]) + sum(hop_f[:i]) + sum(hop_b[:i])
        if gap_f >= period and gap_b >= period:
            runs = [fwd[i], stage_s[i] - fwd[i]]
        elif gap_f >= period or gap_b >= period:
            runs = [stage_s[i]]
        else:
            runs = []
        out.append(sum(quota_seconds(r, quotas[i]) for r in runs) if runs else stage_s[i])
    return out


def quota_hop_seconds(nbytes: float, wire, ends: list) -> float | None:
    """A one-microbatch pipeline's hop when an end is held to a quota: the wire's time, plus
    each quota end's CPU for the message run as a burst on the quota it saved while idle
    (compute.cpu_links charges the cap's pace, right for a host that is busy all step).
    None when no end is held to a quota."""
    held = [r for r in ends if r.cpu_quota and r.comm_cpu]
    if not held or not wire.up:
        return None
    cpu = max(quota_seconds(r.comm_cpu["message_s"] + nbytes / r.comm_cpu["bytes_s"], r.cpu_quota) for r in held)
    return wire.seconds(nbytes) + cpu


def in_turn_mbit(rate_mbit: float, wire_mbit: float, capped_cpu_mbit: list[float]) -> float:
    """A link's rate when an end is held to a quota: its CPU time per byte and the wire's
    add up (measured on the sim: a 0.15-core host moved 62-81 MB/s over a 119 MB/s wire with
    CPU for 143). No capped end: `rate_mbit` unchanged."""
    if not capped_cpu_mbit:
        return rate_mbit
    return min(rate_mbit, 1 / (1 / wire_mbit + 1 / min(capped_cpu_mbit)))


def idles(ranks: list, microbatches: int) -> bool:
    """A one-microbatch pipeline leaves each stage idle between its stretches: with a quota
    host among its ranks, the bursts above apply."""
    return microbatches == 1 and any(rk.cpu_quota for rk in ranks)


def pipeline_hops(nbytes: float, names: list[str], ranks: list, wire_lm, cpu_lm, burst: bool):
    """(forward hops, backward hops) of a chain: the CPU-adjusted links, or, on an idling
    quota pipeline (`burst`), the wire plus each quota end's CPU as a burst."""

    def hop(s: int, d: int) -> float:
        t = quota_hop_seconds(nbytes, wire_lm.get(names[s], names[d]), [ranks[s], ranks[d]]) if burst else None
        if t is not None:
            return t
        return cpu_lm.get(names[s], names[d]).seconds(nbytes)

    n = len(names)
    return [hop(r, r + 1) for r in range(n - 1)], [hop(r + 1, r) for r in range(n - 1)]


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
