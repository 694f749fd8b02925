"""Step time from the ranks' compute and the traffic: one function per kind of split.

A strategy's kind is its registry trait: `layers` (a chain of stages: mp, or a pipeline
when microbatched), `server` (a parameter server's star: rank 0 aggregates and updates),
and `lockstep` for every other split (batch rings, heads, sequence, experts): the slowest
rank, then the collectives, less what hides behind backward. A new kind registers its
function with `@step_time("kind")` and names it in `kind_of`, and the plan uses it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from smoltrain.models.spec import ModelSpec
from smoltrain.planner import capacity, cfs, cpu_quota, timing
from smoltrain.planner.links import LinkModel
from smoltrain.planner.split import dtype_bytes
from smoltrain.planner.traffic import Traffic


@dataclass
class Setting:
    """What a step-time function reads: the traffic, the ranks and their compute, the links."""

    tr: Traffic
    info: object  # registry.StrategyInfo
    model: ModelSpec
    names: list[str]
    ranks: list
    compute_s: list[float]  # per rank, from rank_time
    update_s: list[float]  # per rank: of compute_s, the measured optimizer update
    lm: LinkModel  # links as the ranks' CPUs see them (compute.cpu_links)
    wire: LinkModel  # the links themselves
    batch: int
    seq: int
    microbatches: int
    dtype: str
    train: bool
    overlap: bool = True

    @property
    def world(self) -> int:
        return len(self.names)


@dataclass
class StepTime:
    compute_s: float
    comm_s: float
    cc: timing.CommCost
    bubble: float = 0.0
    rank_compute_s: list[float] | None = None  # per-rank compute when the kind reshapes it (a chain on quota hosts)


STEP_TIME: dict[str, Callable[[Setting], StepTime]] = {}


def step_time(kind: str):
    def register(fn):
        STEP_TIME[kind] = fn
        return fn

    return register


def kind_of(info) -> str:
    if info.splits == "layers":
        return "layers"
    if info.parameter_server:
        return "server"
    return "lockstep"


def of(s: Setting) -> StepTime:
    return STEP_TIME[kind_of(s.info)](s)


@step_time("lockstep")
def lockstep(s: Setting) -> StepTime:
    """The slowest rank computes, then the collectives run; a ring moves at its slowest
    member's pace. dp's buckets hide behind backward only where every rank has a core to
    spare for them (a capped host sends on the core it computes on), and only the wire's
    share hides: the CPU's share competes with backward."""
    compute_s = max(s.compute_s)
    cc = timing.comm_cost(s.tr, s.names, s.lm)
    comm_s = cc.total_s
    if s.overlap and s.train and cc.overlappable_s > 0 and all(rk.comm_core for rk in s.ranks):
        wire = timing.comm_cost(s.tr, s.names, s.wire) if s.lm is not s.wire else cc
        comm_s = (
            comm_s
            - cc.overlappable_s
            + max(0.0, cc.overlappable_s - wire.overlappable_s)
            + timing.exposed_overlap(wire.overlappable_s, wire.last_bucket_s, 2 / 3 * compute_s)
        )
    return StepTime(compute_s, comm_s, cc)


@step_time("server")
def server(s: Setting) -> StepTime:
    """A parameter server: the workers compute, rank 0 sums every gradient and updates
    (memory-bound, capacity.server_seconds) between the last push and the first pull; its
    gather starts worker by worker as each one's backward ends."""
    st = lockstep(s)
    if s.train and s.world > 1:
        st.compute_s += capacity.server_seconds(s.model, s.world, s.ranks[0].device.mem_bw)
        st.comm_s -= timing.staggered_saving(s.tr, s.names, s.lm, s.compute_s)
    return st


@step_time("layers")
def layers(s: Setting) -> StepTime:
    """A chain of stages. Training: the GPipe schedule over the boundary hops (timing.pipeline),
    plus whatever else crosses (tied embeddings); on CPU-quota hosts the schedule is laid out on
    each host's periods (cfs.py), which gives each stage's compute as it runs in bursts. Decode:
    the stages one after another, each message paid at both ends (cpu_quota.decode_chain; on
    quota hosts in bursts)."""
    cc = timing.comm_cost(s.tr, s.names, s.lm)
    if s.world == 1:
        return StepTime(max(s.compute_s), cc.total_s, cc)
    stage = list(s.compute_s)
    if not s.train:
        if not math.isfinite(cc.total_s):
            return StepTime(sum(stage), cc.total_s, cc)
        t = cpu_quota.decode_chain(stage, s.ranks, s.tr, s.names, s.wire)
        if not cpu_quota.held_back(s.ranks):  # the stages as timed; their messages and hops the rest
            return StepTime(sum(stage), max(0.0, t - sum(stage)), cc)
        f = t / (sum(stage) + cc.total_s)  # the same parts, run in bursts: each in proportion
        return StepTime(sum(stage) * f, cc.total_s * f, cc)
    mb = s.batch * s.seq * s.model.hidden * dtype_bytes(s.dtype) / s.microbatches
    # the boundary hops are in the schedule; add what else crosses (tied embeddings)
    hops = {i for i, ph in enumerate(s.tr.phases) if not ph.what.startswith("tied")}
    rest = timing.comm_cost(s.tr, s.names, s.lm, skip=hops).total_s
    bubble = (s.world - 1) / (s.microbatches + s.world - 1)
    if any(rk.cpu_quota for rk in s.ranks) and math.isfinite(cc.total_s):
        ct = cfs.chain(*on_periods(s, mb), s.microbatches)
        critical = timing.critical_path(ct.compute_s, ct.update_s, s.microbatches)
        return StepTime(critical, max(0.0, ct.step_s - critical) + rest, cc, bubble, ct.compute_s)
    compute_s, comm_s = timing.pipeline(stage, *hops_of(s.lm, s.names, mb), s.microbatches, True, s.update_s)
    return StepTime(compute_s, comm_s + rest, cc, bubble)


def on_periods(s: Setting, mb: float) -> tuple[list, list, list, list]:
    """The chain as cfs.chain takes it: each stage's work and message CPU at full speed (its
    measured figures are at its pace), each host's quota, and the wire's time per hop."""
    stages, cpus = [], []
    for st, up, rk in zip(s.compute_s, s.update_s, s.ranks):
        full = 1 / rk.pace
        cc = rk.comm_cpu
        msg = (cc["message_s"] + mb / cc["bytes_s"] / 2) * full if cc else 0.0
        stages.append(cfs.Stage(max(0.0, st - up) * full, up * full, [msg, msg], [msg, msg]))
        q = rk.cpu_quota
        wake = (rk.device.burst_wake_s or 0.0) * full
        cpus.append(cfs.Cpu(rk.pace, q[0] if q else None, q[1] if q else None, wake_s=wake))
    return (stages, cpus, *hops_of(s.wire, s.names, mb))


def hops_of(lm: LinkModel, names: list[str], nbytes: float) -> tuple[list[float], list[float]]:
    """(forward, backward) seconds of each hop of a chain carrying `nbytes` on `lm`."""
    ends = list(zip(names, names[1:]))
    return [lm.get(a, b).seconds(nbytes) for a, b in ends], [lm.get(b, a).seconds(nbytes) for a, b in ends]
