"""How fast each host trains, and how much memory it has: what placement splits work by.

Measured when a compute report (`smoltrain.compute/1`, from `smoltrain calibrate -i`) covers
the host: its timed training steps at two batch sizes give the seconds per token (the slope)
and a fixed per-step cost (the intercept), fitted by `planner.compute` exactly as the plan
does, so a host's time for n tokens is `fixed_s + n * s_per_token`. Hosts the report does not cover fall back to the
device profiles (`planner/devices.py`) with the same 6P rule, and say so (`source`).

Torch-free; placement sees only `host_speeds`.
"""

from __future__ import annotations

from dataclasses import dataclass

from smolnet.errors import UsageError
from smoltrain.models.spec import ModelSpec


@dataclass(frozen=True)
class HostSpeed:
    name: str
    s_per_token: float  # training seconds per token of the whole model (forward, backward, update)
    memory_bytes: float  # memory a training process may use there
    fixed_s: float = 0.0  # per-step cost that does not grow with the batch
    machine_id: str = ""  # ranks with the same machine share its cores
    source: str = "nominal"  # measured (compute report) or nominal (device profile)

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.s_per_token if self.s_per_token > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "s_per_token": self.s_per_token,
            "tokens_per_s": self.tokens_per_s,
            "fixed_s": self.fixed_s,
            "memory_bytes": self.memory_bytes,
            "machine_id": self.machine_id,
            "source": self.source,
        }


def _host_name(h) -> str:
    return h if isinstance(h, str) else h.name


def _flop_cost(model: ModelSpec) -> float:
    """FLOPs per trained token: 6 x parameters (2 forward, 4 backward)."""
    return 6.0 * model.params()


def _measured(entry: dict, model: ModelSpec) -> HostSpeed | None:
    """A host of the compute report: its two timed steps fitted by planner.compute (the one
    fit the plan uses too), else its fp32 matmul rate."""
    from smoltrain.planner.compute import _host

    if not isinstance(entry.get("name"), str):
        return None
    try:
        hc = _host(entry, "compute report")
    except UsageError:
        return None
    fit = hc.fit(model)
    if fit is not None:
        fixed, per, _seq = fit
    else:
        fl = hc.flops.get("fp32", 0.0)
        if fl <= 0:
            return None
        fixed, per = 0.0, _flop_cost(model) / fl
    if hc.usable_memory <= 0:
        return None
    return HostSpeed(hc.name, per, hc.usable_memory, fixed, str(entry.get("machine_id") or ""), "measured")


def _nominal(host, model: ModelSpec) -> HostSpeed:
    from smoltrain.planner.devices import get_device

    name = _host_name(host)
    dev = get_device(getattr(host, "device", None) or "generic")
    from smoltrain.planner.plan import host_memory

    mem = host_memory(host, name, dev.memory_bytes)
    return HostSpeed(name, _flop_cost(model) / dev.flops("fp32"), mem, 0.0, "", "nominal")


def host_speeds(compute_doc: dict | None, hosts, model: ModelSpec) -> dict[str, HostSpeed]:
    """Speed and memory of each host (names or inventory hosts): measured where the compute
    report has the host, else its device profile."""
    measured = {}
    if compute_doc is not None:
        if not isinstance(compute_doc, dict) or not str(compute_doc.get("schema", "")).startswith("smoltrain.compute/"):
            raise UsageError("compute report: not a smoltrain.compute/1 document")
        for entry in compute_doc.get("hosts") or []:
            hs = _measured(entry, model) if isinstance(entry, dict) else None
            if hs is not None:
                measured[hs.name] = hs
    return {_host_name(h): measured.get(_host_name(h)) or _nominal(h, model) for h in hosts}


def source_of(speeds: dict[str, HostSpeed]) -> str:
    kinds = {s.source for s in speeds.values()}
    return kinds.pop() if len(kinds) == 1 else "mixed"
