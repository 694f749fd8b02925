"""A comm that adds up what its calls cost: wall seconds (a training step's comm_s), process
CPU seconds and the number of calls (a decode rank's message terms, infer.engine)."""

from __future__ import annotations

import threading
import time


class TimedComm:
    """A Comm whose collective and point-to-point calls add to `seconds` (wall), `cpu` and
    `calls`; everything else passes through to the comm it wraps."""

    _timed = (
        "send", "recv", "send_recv", "broadcast", "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "barrier"
    )  # fmt: skip

    def __init__(self, comm, into: TimedComm | None = None):
        self._comm = comm
        self._into = into or self  # a group's seconds add to its world's
        self._lock = threading.Lock()
        self.seconds = self.cpu = 0.0
        self.calls = 0
        for name in self._timed:
            setattr(self, name, self._wrap(getattr(comm, name)))

    def new_group(self, ranks):
        g = self._comm.new_group(ranks)
        return None if g is None else TimedComm(g, into=self._into)

    def _wrap(self, fn):
        def call(*a, **kw):
            c0, t0 = time.process_time(), time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                with self._into._lock:
                    self._into.seconds += dt
                    self._into.cpu += dc
                    self._into.calls += 1

        return call

    def take_seconds(self) -> float:
        with self._lock:
            s, self.seconds = self.seconds, 0.0
        return s

    def mark(self) -> tuple[float, float, int]:
        """(CPU seconds, wall seconds, calls) so far: a caller takes differences."""
        return self.cpu, self.seconds, self.calls

    def __getattr__(self, name):
        return getattr(self._comm, name)
