"""How fast one busy thread runs here, and the CFS period that holds it back.

Why: a capped host's figures are CPU seconds times its pace (wall seconds a CPU second of one
busy thread takes), and the plan's burst model (planner/cpu_quota.py) needs the period and the
quota, which a hidden cap does not show. A thread spun in short slices sees the throttle as
gaps in wall time, one a cycle: their spacing is the period, and the pace over the window
says how much of each period the thread ran (quota = period / pace). An uncapped host shows
no regular gaps. The cycle measured is the one the host lives by, which need not be the one
configured: a 2.67 ms quota every 10 ms (cgroup v1, 5 ms bandwidth slices) ran 5.4 ms every
20 ms or 1.4-3.4 ms every 10 ms here, one run to the next; the mean over a window is steady.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

PACE_WINDOW = 0.5  # seconds: five periods of the longest CFS period the sim draws (100 ms)
GAP_S = 0.0008  # wall seconds without progress that count as the thread held back (a slice spins ~2 us)
REGULAR = 0.2  # a gap's spacing this close to the median counts as on the cycle
HELD_BACK = 1.05  # a pace above this: the host runs held back (a cap, read or hidden, or other work)
HIDDEN_PACE = 2.0  # one busy thread at half a core or less: a cap (the host's ranks run one thread)
ON_CYCLE = 0.75  # of the spacings on it: a CFS cycle, not other work taking turns
LONG, LONG_RANK = 0.5, 0.8  # a long gap: at least half the gap at the 80th percentile of lengths


@dataclass(frozen=True)
class Pace:
    pace: float  # wall seconds per CPU second of one busy thread, >= 1
    quota_s: float | None = None  # CPU seconds a period allows, where a regular cycle showed
    period_s: float | None = None

    def cycle(self) -> dict | None:
        """The report's `cpu_cycle` entry, or None where no regular throttle showed."""
        if self.quota_s is None or self.period_s is None:
            return None
        return {"quota_s": self.quota_s, "period_s": self.period_s}


def spin(window: float, clock=time.perf_counter, cpu=time.thread_time) -> tuple[tuple, tuple, list]:
    """Spin for `window` wall seconds: ((wall, cpu) at the start, at the end, and (wall, cpu,
    gap's length) at the end of every gap longer than GAP_S)."""
    t0 = last = clock()
    start = (t0, cpu())
    marks = []
    while True:
        sum(range(64))
        now = clock()
        if now - last > GAP_S:
            marks.append((now, cpu(), now - last))
        last = now
        if now - t0 >= window:
            return start, (now, cpu()), marks


def measure(window: float = PACE_WINDOW) -> Pace:
    """This thread's pace, and the CFS cycle behind it where one shows (see the module's why)."""
    return from_marks(*spin(window))


def from_marks(start: tuple, end: tuple, marks: list) -> Pace:
    """Pace over the whole window, and the period where the gaps keep one spacing: the
    median, with most spacings near it (other work taking turns leaves irregular gaps).
    Where all the gaps keep none, the long ones may: a long period's throttle (64-88 ms of
    every 100 ms at 0.2 cores, measured here) comes with short stalls between, 1-9 ms, that
    hid it. Marks that carry their gap's length (spin's) are tried that way too."""
    pace = max(1.0, (end[0] - start[0]) / max(1e-9, end[1] - start[1]))
    if pace <= 1.0:
        return Pace(pace)
    period = _regular([m[0] for m in marks])
    if period is None and marks and len(marks[0]) > 2:
        gaps = sorted(m[2] for m in marks)
        floor = LONG * gaps[int(LONG_RANK * (len(gaps) - 1))]
        period = _regular([m[0] for m in marks if m[2] >= floor])
    return Pace(pace) if period is None else Pace(pace, period / pace, period)


def _regular(ends: list[float]) -> float | None:
    """The median spacing of gaps that end at `ends`, where most spacings keep near it."""
    if len(ends) < 3:
        return None
    spacing = [y - x for x, y in zip(ends, ends[1:])]
    period = statistics.median(spacing)
    on = sum(1 for s in spacing if abs(s - period) <= REGULAR * period)
    return period if period > 0 and on >= ON_CYCLE * len(spacing) else None


def one_thread(pace: float | None, cap_read: bool) -> bool:
    """Whether a host runs one torch thread whatever CPUs it sees: its busy thread ran at half
    a core or less (HIDDEN_PACE) under a cap it cannot read. Calibration's probe and the
    launchers (run/threads.py) both ask, so a rank runs at the threads its figures were
    measured at. One thread's pace says nothing of how many cores a host has where it is
    slowed a little by other work; a cap it reads, it counts itself."""
    return not cap_read and (pace or 0.0) >= HIDDEN_PACE


def cpu_pace(window: float = PACE_WINDOW) -> float:
    """Wall seconds a CPU second of one busy thread takes here: 1/cap on a capped host, more
    where other programs take turns on its CPU, at least 1 (no host can read a hidden cap,
    but every host runs at it)."""
    return measure(window).pace
