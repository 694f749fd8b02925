"""Measured compute for the planner: read a `smoltrain.compute/1` report into per-host figures.

Why: device profiles are published peaks times a guessed fraction; a host's real training
rate (a Pi without fast bf16, a throttling laptop, a rank that is really a capped process)
differs by integer factors. The report's two timed training steps give, per host, a fixed
cost per step and a cost per token; the plan charges each rank those for its share of the
model. Hosts that share a machine (same machine_id) share its cores when they run at once.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from smolnet.errors import UsageError
from smoltrain.calibration.pace import HELD_BACK
from smoltrain.models.spec import ModelSpec, get_model

COMPUTE_SCHEMA = "smoltrain.compute/1"
DEFAULT_COMPUTE = "reports/compute.json"


@dataclass
class HostCompute:
    name: str
    machine_id: str
    cores: int
    cpu_limit_cores: float | None
    flops: dict  # matmul FLOP/s per dtype at one thread
    mem_bw: float  # bytes/s
    usable_memory: float  # bytes
    train_step: list = field(default_factory=list)
    comm_cpu: dict | None = None  # smoltrain comm's CPU cost here: message_s, bytes_s
    cpu_period_s: float | None = None  # the CFS period of cpu_limit_cores
    threads: int = 1  # torch threads the probe ran at (the host's smol_threads or usable CPUs)
    decode_bw: tuple = ()  # decode products' weight bytes/s: ((dtype, ((rows, bytes/s), ...)), ...)
    decode_step: list = field(default_factory=list)  # timed one-token forwards: [{model, seconds}]
    decode_layer: tuple = ()  # seconds per layer beyond the products: ((dtype, ((rows, s), ...)), ...)
    decode_engine: float | None = None  # seconds of a rank's decode engine per step (calibration.engine_probe)
    cpu_pace: float | None = None  # wall seconds per CPU second of one busy thread (calibration.pace)
    cpu_cycle: tuple | None = None  # (quota, period) seconds of the throttle a busy thread showed
    burst_wake: float | None = None  # seconds a burst costs more after the host slept (decode_probe.burst_wake)

    def quota(self) -> tuple[float, float] | None:
        """(quota, period) in seconds of a CFS cap: the one the host reads where its period was
        read too, else the cycle a busy thread showed (a hidden cap), else None."""
        if self.cpu_limit_cores and self.cpu_period_s:
            return self.cpu_limit_cores * self.cpu_period_s, self.cpu_period_s
        return self.cpu_cycle

    def cap_cores(self) -> float | None:
        """The cores a CFS cap leaves this host: the one it reads, else 1/pace where a busy
        thread ran held back (a hidden cap, or other work taking turns), else None."""
        if self.cpu_limit_cores:
            return self.cpu_limit_cores
        return 1 / self.cpu_pace if self.cpu_pace and self.cpu_pace > HELD_BACK else None

    def pace(self) -> float:
        """Wall seconds a CPU second takes here (the figures are at it): measured, else the
        cap's 1/cores below a core, else 1."""
        if self.cpu_pace:
            return max(1.0, self.cpu_pace)
        return 1 / self.cpu_limit_cores if self.cpu_limit_cores and self.cpu_limit_cores < 1 else 1.0

    def fit(self, model: ModelSpec) -> tuple[float, float, int] | None:
        """(fixed seconds per step, seconds per token, the timed seq) of the model's training step, from the
        two timed batch sizes; another calibrated model's figures scaled by FLOPs and layers
        (its AdamW update by parameters) when this model was not timed; None without timed steps."""
        steps = [s for s in self.train_step if s.get("model") == model.name] or list(self.train_step)
        if len(steps) < 2:
            return None
        a, b = (
            sorted(steps, key=lambda s: s["batch"] * s["seq"])[:1]
            + sorted(steps, key=lambda s: s["batch"] * s["seq"])[-1:]
        )
        na, nb = a["batch"] * a["seq"], b["batch"] * b["seq"]
        per = (b["seconds"] - a["seconds"]) / (nb - na) if nb > na else 0.0
        if per <= 0:  # noise: charge everything per token
            per, fixed = b["seconds"] / nb, 0.0
        else:
            fixed = max(0.0, a["seconds"] - per * na)
        if a.get("model") != model.name:
            try:
                cal = get_model(a["model"])
            except Exception:
                return None
            per *= train_flops_per_token(model, a["seq"]) / train_flops_per_token(cal, a["seq"])
            # the AdamW update in it grows with the parameters (optimizer_s), the rest with the layers
            opt = min(fixed, self.optimizer_s(cal))
            fixed = (fixed - opt) * model.layers / cal.layers + opt * model.params() / cal.params()
        return fixed, per, a["seq"]

    def decode_fixed(self, model: ModelSpec) -> float | None:
        """Seconds a decode step of the whole model pays per token beyond its weight reads and
        FLOPs: the timed one-token forward less those (another calibrated model's scaled by
        layers, as the training step's fixed cost is); None where no forward was timed."""
        steps = [s for s in self.decode_step if s.get("model") == model.name] or list(self.decode_step)
        if not steps:
            return None
        st = steps[0]
        try:
            cal = get_model(st["model"])
        except Exception:
            return None
        rate = dict(dict(self.decode_bw).get("fp32") or ()).get(1) or self.mem_bw
        work = max(4 * cal.params() / rate, 2 * cal.params() / (self.flops.get("fp32") or math.inf))
        return max(0.0, float(st["seconds"]) - work) * model.layers / cal.layers

    def optimizer_s(self, model: ModelSpec) -> float:
        """Seconds of the whole model's AdamW update (part of the fixed cost, paid once per
        step); another model's scaled by parameters; 0 where the report has none."""
        steps = [s for s in self.train_step if isinstance(s.get("optimizer_seconds"), (int, float))]
        mine = [s for s in steps if s.get("model") == model.name]
        if mine:
            return sorted(s["optimizer_seconds"] for s in mine)[len(mine) // 2]
        if not steps:
            return 0.0
        try:
            cal = get_model(steps[0]["model"])
        except Exception:
            return 0.0
        return steps[0]["optimizer_seconds"] * model.params() / cal.params()


def train_flops_per_token(model: ModelSpec, seq: int) -> float:
    """The planner's count for one token of a whole-model training step (capacity.flops)."""
    mm = model.layers * model.layer_params() + model.vocab * model.hidden
    return 6 * mm + 12 * model.layers * model.hidden * seq


def _host(d: dict, origin: str) -> HostCompute:
    try:
        return HostCompute(
            str(d["name"]),
            str(d.get("machine_id") or d["name"]),
            int(d.get("cores") or 1),
            (float(d["cpu_limit_cores"]) if d.get("cpu_limit_cores") else None),
            {k: float(v) for k, v in d["flops"].items() if v is not None},
            float(d["mem_bw_bytes_s"]),
            float(d.get("usable_memory_bytes") or 0),
            list(d.get("train_step") or []),
            d.get("comm_cpu") if isinstance(d.get("comm_cpu"), dict) else None,
            (float(d["cpu_period_s"]) if d.get("cpu_period_s") else None),
            int(d.get("threads") or 1),
            decode_rates(d.get("decode_bw_bytes_s")),
            list(d.get("decode_step") or []),
            decode_rates(d.get("decode_layer_s")),
            (float(d["decode_engine_s"]) if d.get("decode_engine_s") else None),
            (float(d["cpu_pace"]) if d.get("cpu_pace") else None),
            _cycle(d.get("cpu_cycle")),
            (float(d["burst_wake_s"]) if d.get("burst_wake_s") is not None else None),
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        raise UsageError(f"{origin}: host {d.get('name', '?')!r} lacks flops or mem_bw_bytes_s") from None


def _cycle(doc) -> tuple[float, float] | None:
    if isinstance(doc, dict) and doc.get("quota_s") and doc.get("period_s"):
        return float(doc["quota_s"]), float(doc["period_s"])
    return None


def decode_rates(doc: dict | None) -> tuple:
    """The report's decode_bw_bytes_s or decode_layer_s ({dtype: {rows: figure}}) as
    DeviceProfile.decode_bw or decode_layer, rows ascending."""
    return tuple(
        (dt, tuple(sorted((int(r), float(b)) for r, b in by_rows.items())))
        for dt, by_rows in sorted((doc or {}).items())
        if by_rows
    )


def read_compute(path: str) -> dict:
    """The report, checked against its JSON Schema (one line and exit 2 when it breaks it)."""
    from smolnet.files import read_json

    doc = read_json(path, "compute report", " (run `smoltrain calibrate -i INVENTORY`)")
    if not isinstance(doc, dict) or doc.get("schema") != COMPUTE_SCHEMA:
        raise UsageError(f"{path}: not a {COMPUTE_SCHEMA} report (run `smoltrain calibrate`)")
    from smolnet.schema import check

    check(doc, COMPUTE_SCHEMA, str(path))
    return doc


def load_compute(path: str, hosts=None) -> dict[str, HostCompute]:
    """Per-host figures by name. With `hosts` (names or inventory hosts), every one must have
    been measured: a report of another inventory is an error naming the missing hosts."""
    doc = read_compute(path)
    entries = {h.get("name"): h for h in doc.get("hosts") or [] if isinstance(h, dict)}
    ok = {n: _host(h, path) for n, h in entries.items() if h.get("status", "ok") == "ok"}
    if hosts is None:
        return ok
    names = [getattr(h, "name", h) for h in hosts]
    missing = [n for n in names if n not in entries]
    if missing:
        raise UsageError(
            f"{path}: compute report has no {', '.join(missing)} (measured: "
            f"{', '.join(entries) or 'none'}); run `smoltrain calibrate -i` on this inventory"
        )
    failed = [n for n in names if n not in ok]
    if failed:
        raise UsageError(
            f"{path}: calibration failed on {', '.join(failed)} "
            f"({entries[failed[0]].get('error')}); calibrate again or pass --compute"
        )
    return {n: ok[n] for n in names}


def default_path(path: str | None) -> str | None:
    """--compute, else reports/compute.json when it exists, else None (device profiles)."""
    if path:
        return path
    p = os.environ.get("SMOL_COMPUTE", DEFAULT_COMPUTE)
    return p if Path(p).is_file() else None


def this_machine() -> str:
    from smolnet.facts import machine_id

    return machine_id()


def for_local(path: str) -> HostCompute | None:
    """For --local ranks: an uncapped host of the report measured on this very machine."""
    mine = this_machine()
    for h in load_compute(path).values():
        if h.machine_id == mine and not h.cpu_limit_cores:
            return h
    return None


def shared_factors(figs: list[HostCompute]) -> list[float]:
    """Ranks on one machine run at once: each asks for min(cap, 1 thread) of a core; when
    the asks exceed the machine's cores, everyone there gets the same fraction."""
    ask: dict[str, float] = {}
    cores: dict[str, int] = {}
    for f in figs:
        ask[f.machine_id] = ask.get(f.machine_id, 0.0) + min(f.cpu_limit_cores or 1.0, 1.0)
        cores[f.machine_id] = f.cores
    return [min(1.0, cores[f.machine_id] / ask[f.machine_id]) for f in figs]


def measured_ranks(ranks: list, figs: list[HostCompute], model: ModelSpec, shared: bool = True) -> list:
    """The planner's ranks with measured speed, memory and fixed step cost (`shared`: ranks
    on one machine_id already split its cores here, so plan.share_machine leaves them)."""
    from smoltrain.planner.devices import DeviceProfile

    out = []
    on_machine = {}
    for f in figs:
        on_machine[f.machine_id] = on_machine.get(f.machine_id, 0) + 1
    for rk, f, share in zip(ranks, figs, shared_factors(figs)):
        # cores this rank can use: its cap, and its part of a machine it shares with other ranks
        usable = min(f.cap_cores() or f.cores, f.cores / on_machine[f.machine_id])
        fit = f.fit(model)
        f32 = f.flops.get("fp32", 0.0)
        if fit is not None:
            fixed, per, seq = fit
            achieved = train_flops_per_token(model, seq) / per
        else:
            fixed, achieved = 0.0, f32 * 0.4
        # bf16 and fp16 matmuls measured apart (a CPU with bf16 units may lack fast fp16)
        r16 = (f.flops.get("fp16") or f.flops.get("bf16") or f32) / f32 if f32 else 1.0
        rbf = (f.flops.get("bf16") or f32) / f32 if f32 else 1.0
        prof = DeviceProfile(
            f"{rk.device.name}*",
            achieved * share,
            achieved * r16 * share,
            f.mem_bw * share,
            f.usable_memory or rk.memory_bytes,
            f32,
            f.mem_bw,
            f"measured on {f.name} at {f.threads} thread(s)"
            + (f" (cap {f.cpu_limit_cores:g} cores)" if f.cpu_limit_cores else ""),
            achieved * rbf * share,
            decode_bw=f.decode_bw,
            decode_layer=f.decode_layer,
            decode_engine_s=f.decode_engine,
            burst_wake_s=f.burst_wake,
        )
        prof = replace(prof, **prof.decode_scaled(share))
        cc = None
        if f.comm_cpu and f.comm_cpu.get("message_s") and f.comm_cpu.get("bytes_s"):
            cc = {
                "message_s": float(f.comm_cpu["message_s"]) / share,
                "bytes_s": float(f.comm_cpu["bytes_s"]) * share,
                # held to a quota it can run out of: less than a core for compute and one for sends
                "quota": bool(f.cap_cores() and f.cap_cores() < min(2, f.cores)),
            }
        out.append(
            replace(
                rk,
                device=prof,
                memory_bytes=f.usable_memory or rk.memory_bytes,
                fixed_s=fixed / share,
                optimizer_s=min(fixed, f.optimizer_s(model)) / share,
                decode_fixed_s=None if f.decode_fixed(model) is None else f.decode_fixed(model) / share,
                measured=True,
                comm_cpu=cc,
                shared=shared,
                # overlapping sends need a core the rank's torch threads leave free
                comm_core=usable - min(f.threads, usable) >= 1,
                cpu_quota=f.quota() if share >= 1 else None,  # a shared machine has no quota to save
                pace=f.pace() if share >= 1 else 1.0,
            )
        )
    return out


def cpu_links(lm, ranks: list):
    """Links as a busy host sees them: each message also costs the slower end's measured
    per-message CPU time, and bytes go no faster than either end's CPU moves them. On a
    capped Pi-class host this, not the wire, is what a ring of small all-reduces waits for.
    An end held to a CPU quota pays its CPU time and the wire's in turn (cpu_quota.py)."""
    from smoltrain.planner.cpu_quota import in_turn_mbit
    from smoltrain.planner.links import Link, LinkModel

    cost = {r.name: r.comm_cpu for r in ranks if getattr(r, "comm_cpu", None)}
    if not cost:
        return lm
    names = [r.name for r in ranks]
    links = {}
    for s in names:
        for d in names:
            if s == d:
                continue
            ln = lm.get(s, d)
            ends = [cost[n] for n in (s, d) if n in cost]
            msg = max(c["message_s"] for c in ends) if ends else 0.0
            rate = ln.rate_mbit
            if rate and ends:
                wire = rate
                rate = min(rate, min(c["bytes_s"] for c in ends) * 8 / 1e6)
                rate = in_turn_mbit(rate, wire, [c["bytes_s"] * 8 / 1e6 for c in ends if c.get("quota")])
            links[(s, d)] = Link(rate, ln.rtt_us + 2e6 * msg, ln.status)
    return LinkModel(
        dict(lm.source, comm_cpu="per-message and per-byte CPU cost of each end (measured)"),
        links,
        None,
        wire=lm,
        cpu_bytes_s={n: c["bytes_s"] for n, c in cost.items()},
    )


def apply(ranks: list, hosts, path: str | None, model: ModelSpec) -> tuple[list, str]:
    """(ranks, compute_source): measured figures when a report is given or found."""
    given = path
    path = default_path(path)
    if path is None:
        return ranks, "nominal"
    if hosts is None:
        names = [r.name for r in ranks]
        named = load_compute(path)
        if all(n in named for n in names):  # a report of these very ranks (rank0..): theirs
            return measured_ranks(ranks, [named[n] for n in names], model), "measured"
        f = for_local(path)
        if f is None:
            return ranks, "nominal"
        figs = [replace(f, machine_id=f"{f.machine_id}-{i}") for i in range(len(ranks))]  # shared later
        return measured_ranks(ranks, figs, model, shared=False), "measured"
    try:
        figs = list(load_compute(path, [r.name for r in ranks]).values())
    except UsageError:
        if given:  # asked for: its hosts must be these
            raise
        return ranks, "nominal"  # the default report is of other hosts: device profiles
    return measured_ranks(ranks, figs, model), "measured"
