"""Torch threads per rank (contract §9), settled by the controller before any rank starts.

A host's `smol_threads` is used as given; without it a rank runs as many threads as its
host lets it use (smolnet.cpus), which the rank reads on the host itself (0 here). Ranks
that share this machine (`--local N`, or several `ansible_connection: local` hosts) share
its CPUs: each gets an equal part, at least 1, unless `--threads` says otherwise.

A host held to half a core or less by a cap it cannot read runs one thread, where the compute
report measured its pace (a cap it reads, it counts itself). A host capped at 0.24 of a core
it could not read ran two threads on two visible CPUs: decode took 14 ms of CPU a token on its
stage where the other stages, one thread each, took 0.5-0.8, and the chain ran at 0.31 of its
plan (bench_compute, seed 424258229, draw random:4284612623). Calibration times one thread, so
the plan's figures are the ones it then runs at.
"""

from __future__ import annotations

from smolnet.cpus import usable_cpus
from smoltrain.host import check_threads


def local_threads(requested: int | None, world: int) -> list[int]:
    """`--local N [--threads T]`: T for every rank (checked against this machine's CPUs), else CPUs / N."""
    cpus = usable_cpus()
    if requested is not None:
        return [check_threads(requested, "this machine", cpus)] * world
    return [max(1, cpus // world)] * world


def inventory_threads(hosts, caps: dict[str, int] | None = None) -> list[int]:
    """smol_threads per host; hosts on this machine without it split its CPUs; others decide on
    the host (0); `caps` (cap_threads) bounds any of them."""
    cpus = usable_cpus()
    local = [h for h in hosts if h.local]
    caps = caps or {}
    out = []
    for h in hosts:
        if h.threads is not None:
            if h.local:
                check_threads(h.threads, f"host {h.name} (this machine)", cpus)
            n = h.threads
        elif h.local:
            n = max(1, cpus // len(local))
        else:
            n = 0
        if h.name in caps:
            n = min(n, caps[h.name]) if n else caps[h.name]
        out.append(n)
    return out


def cap_threads(hosts, compute: str | None) -> dict[str, int]:
    """One thread, by name, for each host whose busy thread the compute report measured at half
    a core or less under a cap it could not read (a cap it reads, its own CPUs count already);
    {} without a report covering every host. A many-core host that other work slows a little
    keeps its threads: one thread's pace does not say how many cores it has."""
    from smolnet.errors import SmolError
    from smoltrain.calibration.pace import one_thread
    from smoltrain.planner.compute import default_path, load_compute

    path = default_path(compute)
    if path is None:
        return {}
    try:
        figs = load_compute(path, hosts)
    except (SmolError, OSError, ValueError):  # no report of these hosts: nothing measured to bound them by
        return {}
    return {n: 1 for n, f in figs.items() if one_thread(f.cpu_pace, bool(f.cpu_limit_cores))}
