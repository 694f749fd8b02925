"""Compute seconds and memory of one rank for the work it is given (capacity.RankWork).

The one cost model of a rank's own work, used by the plan for every rank, by placement for
every candidate piece (a batch share, a layer cut, a slice of heads) and by the single-host
verdict: FLOPs over the device's FLOP/s in the dtype that runs, or memory traffic over its
bandwidth, whichever is slower; on measured hosts the timed training steps' fixed cost is
added per pass and the optimizer's share once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

from smoltrain.models.spec import ModelSpec
from smoltrain.planner import capacity

DECODE_PASS = 1 / 3  # a forward pass's share of a training pass's fixed cost (backward runs twice its work)


@dataclass(frozen=True)
class Shape:
    """What every rank of one plan shares: the strategy, the mode and the step's shape."""

    strategy: str
    mode: str
    model: ModelSpec
    dtype: str
    batch: int
    seq: int
    passes: int = 1  # forward/backward passes per step on each rank (pipeline microbatches, accumulation)
    compute_dtype: str | None = None  # the matmuls' dtype where it differs from `dtype` (planner.widths)
    quantize: str | None = None  # inference weights' format (planner.widths)


@dataclass
class RankTime:
    compute_s: float
    flops_s: float
    memory_s: float
    update_s: float  # of compute_s: the measured optimizer update, paid once per step

    @property
    def bound(self) -> str:
        return "compute" if self.flops_s >= self.memory_s else "memory-bandwidth"


def seconds(rk, w: capacity.RankWork, sh: Shape) -> RankTime:
    """One rank's compute for its work, per step (train) or per generated token (infer)."""
    model = sh.model
    fl = capacity.flops(w, model, sh.mode, sh.seq)
    mt = capacity.memory_traffic(w, model, sh.mode, sh.dtype, sh.batch, sh.seq, sh.strategy, sh.quantize)
    t_fl = fl / rk.device.flops(sh.compute_dtype or sh.dtype)
    t_mem = mt / rk.device.mem_bw
    if rk.measured:
        # the timed steps' fixed cost: what every pass pays whatever its size (operator dispatch,
        # Python), for the rank's share of the operations
        passes = (rk.fixed_s - rk.optimizer_s) * capacity.fixed_share(w, model, sh.strategy)
        if sh.mode == "train":  # timed steps hold the memory traffic already
            # a pipeline or an accumulating host pays the per-pass fixed cost each time; the
            # AdamW update once, for the parameters the rank owns
            update = rk.optimizer_s * w.params_owned / model.params()
            return RankTime(t_fl + passes * sh.passes + update, t_fl, t_mem, update)
        # decode: one forward pass of one token, a third of a training pass's operations
        return RankTime(max(t_fl, t_mem) + passes * DECODE_PASS, t_fl, t_mem, 0.0)
    return RankTime(max(t_fl, t_mem), t_fl, t_mem, 0.0)


def memory(w: capacity.RankWork, sh: Shape) -> capacity.Memory:
    return capacity.memory(w, sh.model, sh.mode, sh.dtype, sh.seq, sh.strategy, sh.quantize)


def fits(rk, mem: capacity.Memory) -> bool:
    return mem.total <= available(rk)


def available(rk) -> float:
    return rk.memory_bytes * capacity.HEADROOM


def row(r: int, rk, w: capacity.RankWork, sh: Shape) -> tuple[dict, RankTime]:
    """The plan's `ranks` entry of rank r, and its times."""
    t = seconds(rk, w, sh)
    mem = memory(w, sh)
    return (
        {
            "rank": r,
            "name": rk.name,
            "device": rk.device.name,
            "flops_per_step": capacity.flops(w, sh.model, sh.mode, sh.seq),
            "memory_traffic_bytes": capacity.memory_traffic(
                w, sh.model, sh.mode, sh.dtype, sh.batch, sh.seq, sh.strategy, sh.quantize
            ),
            "compute_s": t.compute_s,
            "bound": t.bound,
            "memory": mem.to_dict(),
            "memory_available": int(available(rk)),
            "fits": fits(rk, mem),
        },
        t,
    )
