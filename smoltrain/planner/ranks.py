"""The ranks a plan charges: who they are, how fast, how much memory, and in which order.

A Rank is a device profile (nominal, or measured by `smoltrain calibrate` via
planner/compute.py) plus the few measured costs the plan needs. Ranks that share one machine
(`--local N`) split its cores (`share_machine`); a placement puts them in its rank order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from smolnet.errors import UsageError
from smoltrain import registry
from smoltrain.planner.devices import DeviceProfile, get_device


@dataclass
class Rank:
    name: str
    device: DeviceProfile
    memory_bytes: float
    fixed_s: float = 0.0  # measured fixed cost of a whole-model training step (planner/compute.py)
    measured: bool = False  # figures from a compute report, not a device profile
    comm_cpu: dict | None = None  # measured CPU cost of communication on this host (planner/compute.py)
    shared: bool = False  # speed already shares its machine's cores with the other ranks there
    comm_core: bool = True  # a core is left for communication while the rank computes
    optimizer_s: float = 0.0  # of fixed_s: the whole model's AdamW update, once per step
    cpu_quota: tuple[float, float] | None = None  # (quota, period) seconds of a measured CFS cap
    pace: float = 1.0  # wall seconds per CPU second of one busy thread there (its figures are at it)
    decode_fixed_s: float | None = None  # measured per-token cost of a whole-model decode step beyond its reads


def rank_names(world: int, hosts=None) -> list[str]:
    return [h.name for h in hosts[:world]] if hosts else [f"rank{r}" for r in range(world)]


def _profile(device: str, calibration) -> DeviceProfile:
    if device == "generic" and calibration is not None:
        return calibration
    return get_device(device)


def host_memory(host, name: str, default: float) -> float:
    """The inventory's `smol_memory_gb` for this host, else the device profile's memory."""
    gb = (getattr(host, "vars", None) or {}).get("smol_memory_gb")
    if gb is None:
        return default
    try:
        return float(gb) * 1e9
    except (TypeError, ValueError):
        raise UsageError(f"host {name}: smol_memory_gb must be a number, got {gb!r}") from None


def resolve_ranks(world: int, hosts=None, calibration=None) -> list[Rank]:
    if hosts is not None and len(hosts) < world:
        raise UsageError(f"world {world} is larger than the {len(hosts)} hosts of the inventory")
    out = []
    for r, name in enumerate(rank_names(world, hosts)):
        host = hosts[r] if hosts else None
        prof = _profile(getattr(host, "device", "generic") or "generic", calibration)
        out.append(Rank(name, prof, host_memory(host, name, prof.memory_bytes)))
    return out


def busy_ranks(strategy: str, world: int, microbatches: int = 1, mode: str = "train") -> int:
    """How many ranks compute at the same time: a pipeline keeps at most min(m, p) busy, and
    mp (or any pipeline in decode) one."""
    info = registry.REGISTRY.get(strategy)
    if info is None or info.splits != "layers":
        return world
    if not info.microbatched or mode == "infer":
        return 1
    return min(world, microbatches)


def share_machine(ranks: list[Rank], cores: int | None = None, busy: int | None = None) -> list[Rank]:
    """Ranks on one machine (--local, or the sim) split its cores: each rank runs one torch
    thread, so a rank keeps its (one-thread) rate while there is a core for each busy rank."""
    n = len(ranks)
    if all(r.shared for r in ranks):  # measured per machine_id (planner/compute.py) already
        return ranks
    cores = cores or os.cpu_count() or 1
    f = min(1.0, cores / (busy or n))
    return [
        Rank(
            r.name,
            replace(
                r.device,
                flops_fp32=r.device.flops_fp32 * f,
                flops_fp16=r.device.flops_fp16 * f,
                flops_bf16=r.device.flops_bf16 * f if r.device.flops_bf16 else None,
                mem_bw=r.device.mem_bw * f,
                **r.device.decode_scaled(f),
            ),
            r.memory_bytes / n,
            r.fixed_s / f,
            r.measured,
            dict(r.comm_cpu, message_s=r.comm_cpu["message_s"] / f, bytes_s=r.comm_cpu["bytes_s"] * f)
            if r.comm_cpu
            else None,
            comm_core=r.comm_core and cores / n >= 2,
            optimizer_s=r.optimizer_s / f,
            decode_fixed_s=None if r.decode_fixed_s is None else r.decode_fixed_s / f,
        )
        for r in ranks
    ]


def in_placement_order(items: list, placement: dict) -> list:
    """Ranks or hosts (anything with a .name) in the placement's rank order, then those it
    leaves out: the first len(order) are the placed run's ranks."""
    by = {x.name: x for x in items}
    missing = [n for n in placement["order"] if n not in by]
    if missing:
        raise UsageError(f"placement names {', '.join(missing)}, not among the hosts {', '.join(by)}")
    return [by[n] for n in placement["order"]] + [x for x in items if x.name not in placement["order"]]


def placed_ranks(ranks: list[Rank], placement: dict) -> list[Rank]:
    """The ranks in the placement's order (hosts it leaves out dropped)."""
    return in_placement_order(ranks, placement)[: len(placement["order"])]
