"""Where a rank's decode time goes: CPU and wall seconds inside its messages.

A decode step's wall time is the rank's own work (its layers, the engine's bookkeeping)
plus its messages (the CPU that sends and receives them, and the wait for a peer). The
plan models each term; `TimedComm` measures the message part on the comm the ranks
really use, so a report can say which term a miss comes from: the engine counts, per
decode step, its whole CPU and wall time and, of them, what its comm calls took.
"""

from __future__ import annotations

import time

CALLS = ("send", "recv", "send_recv", "broadcast", "all_reduce", "reduce_scatter", "all_gather", "all_to_all")


class TimedComm:
    """A comm whose collective calls add their CPU and wall seconds (and count) to `cpu`,
    `wall` and `calls`; everything else passes through to the comm it wraps."""

    def __init__(self, comm):
        self._comm = comm
        self.cpu = self.wall = 0.0
        self.calls = 0

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if name not in CALLS:
            return attr

        def timed(*a, **kw):
            c0, w0 = time.process_time(), time.perf_counter()
            try:
                return attr(*a, **kw)
            finally:
                self.cpu += time.process_time() - c0
                self.wall += time.perf_counter() - w0
                self.calls += 1

        return timed

    def mark(self) -> tuple[float, float, int]:
        return self.cpu, self.wall, self.calls
