"""How many CPUs this process may use: its affinity mask (which a cpuset narrows), held to
its cgroup's CPU quota. A rank runs that many torch threads unless its host says otherwise
(`smol_threads`); more threads than this only queue behind each other.
"""

from __future__ import annotations

import math
import os


def affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def usable_cpus(quota: tuple[int, int] | None | bool = True) -> int:
    """CPUs from affinity and cpuset, at most the CFS quota rounded down, at least 1.
    `quota`: (quota, period) to use instead of this process's own (True: read it; None: none)."""
    n = affinity_cpus()
    if quota is True:
        from smolnet.sim.cgroup import own_quota

        quota = own_quota()
    if quota:
        n = min(n, math.floor(quota[0] / quota[1] + 1e-9))
    return max(1, n)
