"""Torch threads per rank (contract §9), settled by the controller before any rank starts.

A host's `smol_threads` is used as given; without it a rank runs as many threads as its
host lets it use (smolnet.cpus), which the rank reads on the host itself (0 here). Ranks
that share this machine (`--local N`, or several `ansible_connection: local` hosts) share
its CPUs: each gets an equal part, at least 1, unless `--threads` says otherwise.
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


def inventory_threads(hosts) -> list[int]:
    """smol_threads per host; hosts on this machine without it split its CPUs; others decide on the host (0)."""
    cpus = usable_cpus()
    local = [h for h in hosts if h.local]
    out = []
    for h in hosts:
        if h.threads is not None:
            if h.local:
                check_threads(h.threads, f"host {h.name} (this machine)", cpus)
            out.append(h.threads)
        elif h.local:
            out.append(max(1, cpus // len(local)))
        else:
            out.append(0)
    return out
