"""A chain of stages on CPU-quota hosts, laid out on each host's CFS periods.

Why: a host held to a quota (Q seconds of CPU every period P) runs at full speed until the
period's quota is spent, then waits for the next period; a stage of a chain works in bursts
(its forward, idle while the others work, its backward and update), so how long a burst takes
turns on how much of the period's quota is left when it starts. A 3-host mp run on a drawn
cluster (random:3909291851, issue 36) had all three cases: a 5 ms period, every burst longer
than its quota, ran at the cap's pace (27.1 ms measured, 28.5 at the pace); a 10 ms period
ran a 3.7 ms forward at full speed and a 7.4 ms backward in 12.6 ms (17.1 measured, 23.0 at
the pace); a 100 ms period never ran out, 12 ms of CPU a 58 ms step, and ran at full speed
(11.4 measured, 26.2 at the pace). Charging every stage the cap's pace made mp's plan 1.5x too
slow; no closed form covers the three, so the plan runs the schedule on the periods.

The schedule is the GPipe one timing.pipeline charges (every forward, then every backward,
then each stage's update once its own last backward is done). A hop costs its ends' CPU for
the message (comm_cpu, at full speed, through the same quota) and the wire's time between.
The periods' phases are unknown and differ host to host: the figure is the mean over several
phases, after a few steps (the steady state, which the run's median after warm-up reads). And
a stage's CPU per step is known to about 15% (one host's training step, timed by the same probe
five times: 85-117 ms), while a stage near its quota takes its work at full speed or a whole
period longer: the figure is also the mean over that spread (SPREAD), not the edge's one side.
A 4-stage mp run's last stage needed 10.5 ms of CPU a step by calibration against a 10.2 ms
quota per 100 ms: charged at the edge, 68 ms a step; measured, 9.8 (random:2326715042).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

STEPS = 6  # steps laid out at least, and until PERIODS of the longest period have passed;
PERIODS = 4  # the steps that end in the second half of that are the steady state
MAX_STEPS = 400
PHASES = 8  # phase offsets averaged over
SPREAD = (0.85, 1.0, 1.15)  # scales of every stage's work averaged over: the calibration's spread
WAKE_IDLE_S = 0.002  # a burst begun after the host sat idle this long pays its wake (Cpu.wake_s)


@dataclass
class Cpu:
    """One host's CPU: full speed within its quota per period, else `pace` wall seconds a CPU second.
    A burst of work that follows a wait of WAKE_IDLE_S or more costs `wake_s` more CPU (at full
    speed; calibrate's burst_wake_s): a stage waiting on its neighbours between microbatches pays
    it once a wait, in its work (cold caches slow the work, not the message's receipt), which is
    where a run's per-rank timings count it too."""

    pace: float = 1.0
    quota_s: float | None = None
    period_s: float | None = None
    phase_s: float = 0.0
    free_at: float = 0.0
    _period: int = -1
    _used: float = 0.0
    wake_s: float = 0.0

    def idle(self, ready: float) -> bool:
        """Whether something ready at `ready` finds the host asleep long enough to pay its wake."""
        return ready - self.free_at >= WAKE_IDLE_S

    def run(self, ready: float, work: float, woken: bool = False) -> tuple[float, float]:
        """(start, end) of `work` CPU seconds at full speed begun once both it is ready and the host
        is free; `woken`: the work follows a wait (idle), so it costs its wake more."""
        work += self.wake_s if woken else 0.0
        t = start = max(ready, self.free_at)
        if not self.quota_s or not self.period_s or self.quota_s >= self.period_s:
            t += work * (self.pace if self.quota_s is None else 1.0)
        else:
            q, p = self.quota_s, self.period_s
            while work > 1e-12:
                k = math.floor((t - self.phase_s) / p + 1e-9)  # on an edge: the period it opens
                if k != self._period:
                    self._period, self._used = k, 0.0
                edge = self.phase_s + (k + 1) * p
                left = q - self._used
                if left <= 1e-12:
                    t = edge
                    continue
                d = min(work, left, edge - t)
                t, work, self._used = t + d, work - d, self._used + d
        self.free_at = t
        return start, t


@dataclass
class Stage:
    """One stage at full speed: its work per step (forward and backward of every microbatch, its
    update) and the CPU seconds a hop's message costs it at each end."""

    work_s: float  # forward + backward, all microbatches, less the update
    update_s: float
    send_s: list[float]  # CPU to send a microbatch's message: [forward hop, backward hop]
    recv_s: list[float]


@dataclass
class ChainTime:
    step_s: float
    compute_s: list[float]  # each stage's wall time in its own work per step (throttles included)
    update_s: list[float]  # of which in its update


_MEMO: dict[tuple, ChainTime] = {}
MEMO_MAX = 4096


def chain(stages: list[Stage], cpus: list[Cpu], wire_f: list[float], wire_b: list[float], m: int) -> ChainTime:
    """Mean steady-state step of the chain over PHASES phase offsets of the hosts' periods and
    the SPREAD of the stages' work. Remembered by its inputs: a mesh search lays out the same
    chain again and again (`plan --strategy all` on the home sim: 418 chains, 110 distinct,
    most of its 5 s)."""
    key = (
        tuple((st.work_s, st.update_s, tuple(st.send_s), tuple(st.recv_s)) for st in stages),
        tuple((c.pace, c.quota_s, c.period_s, c.wake_s) for c in cpus),
        tuple(wire_f),
        tuple(wire_b),
        m,
    )
    if key not in _MEMO:
        if len(_MEMO) >= MEMO_MAX:
            _MEMO.clear()
        _MEMO[key] = _chain(stages, cpus, wire_f, wire_b, m)
    got = _MEMO[key]
    return ChainTime(got.step_s, list(got.compute_s), list(got.update_s))


def _chain(stages: list[Stage], cpus: list[Cpu], wire_f: list[float], wire_b: list[float], m: int) -> ChainTime:
    runs = []
    for f in SPREAD:
        scaled = [Stage(st.work_s * f, st.update_s * f, st.send_s, st.recv_s) for st in stages]
        for ph in range(PHASES):
            for i, c in enumerate(cpus):
                c.phase_s = ((ph / PHASES + 0.37 * i) % 1.0) * (c.period_s or 0.0)
                c.free_at, c._period, c._used = 0.0, -1, 0.0
            runs.append(_steps(scaled, cpus, wire_f, wire_b, m))
    n = len(stages)
    return ChainTime(
        sum(r[0] for r in runs) / len(runs),
        [sum(r[1][i] for r in runs) / len(runs) for i in range(n)],
        [sum(r[2][i] for r in runs) / len(runs) for i in range(n)],
    )


def _steps(stages, cpus, wire_f, wire_b, m) -> tuple[float, list[float], list[float]]:
    n = len(stages)
    ends, busy, upd = [0.0], [], []
    horizon = PERIODS * max([c.period_s or 0.0 for c in cpus] + [0.0])
    while len(busy) < STEPS or (ends[-1] < horizon and len(busy) < MAX_STEPS):
        work, up = [0.0] * n, [0.0] * n
        fwd = [[0.0] * m for _ in range(n)]  # when stage i's forward of microbatch j reaches i + 1
        for j in range(m):
            for i in range(n):
                ready, woken = 0.0, False
                if i > 0:
                    woken = cpus[i].idle(fwd[i - 1][j])
                    _, ready = cpus[i].run(fwd[i - 1][j], stages[i].recv_s[0])
                s, e = cpus[i].run(ready, stages[i].work_s / 3 / m, woken)
                work[i] += e - s
                if i < n - 1:
                    _, sent = cpus[i].run(e, stages[i].send_s[0])
                    fwd[i][j] = sent + wire_f[i]
        bwd = [[0.0] * m for _ in range(n)]  # when stage i's backward of microbatch j reaches i - 1
        for j in range(m):
            for i in reversed(range(n)):
                ready, woken = 0.0, False
                if i < n - 1:
                    woken = cpus[i].idle(bwd[i + 1][j])
                    _, ready = cpus[i].run(bwd[i + 1][j], stages[i].recv_s[1])
                s, e = cpus[i].run(ready, 2 * stages[i].work_s / 3 / m, woken)
                work[i] += e - s
                if i > 0:
                    _, sent = cpus[i].run(e, stages[i].send_s[1])
                    bwd[i][j] = sent + wire_b[i - 1]
        for i in range(n):
            s, e = cpus[i].run(0.0, stages[i].update_s)
            work[i] += e - s
            up[i] = e - s
        ends.append(max(c.free_at for c in cpus))
        busy.append(work)
        upd.append(up)
    half = ends[-1] / 2
    first = next(k for k in range(1, len(ends)) if ends[k] >= half or k >= len(ends) - 3)
    kept = len(ends) - 1 - first  # the whole steps after `first`: the steady state

    def mean(rows):
        return [sum(r[i] for r in rows[-kept:]) / kept for i in range(n)]

    return (ends[-1] - ends[first]) / kept, mean(busy), mean(upd)
