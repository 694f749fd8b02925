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
from smoltrain.planner.split import dtype_bytes

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
    tuning: object = None  # planner.tuning.Tuning: LoRA, a quantised base, checkpointing (train)

    def work(self, w: capacity.RankWork) -> capacity.RankWork:
        """`w` as this shape trains it (planner.tuning): the one place a tuning changes a rank's work."""
        return self.tuning.work(w, self.model) if self.tuning is not None and self.mode == "train" else w


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
    if sh.mode == "infer":
        return decode(rk, w, sh)[0]
    model, w = sh.model, sh.work(w)
    fl = capacity.flops(w, model, sh.mode, sh.seq)
    mt = capacity.memory_traffic(w, model, sh.mode, sh.dtype, sh.batch, sh.seq, sh.strategy, sh.quantize)
    t_fl = fl / rk.device.flops(sh.compute_dtype or sh.dtype)
    t_mem = mt / rk.device.mem_bw
    if rk.measured:
        # the timed steps' fixed cost: what every pass pays whatever its size (operator dispatch,
        # Python), for the rank's share of the operations
        passes = (rk.fixed_s - rk.optimizer_s) * capacity.fixed_share(w, model, sh.strategy)
        # LoRA: the timed steps also wrote the frozen weights' gradients, which this rank does not
        passes = max(0.0, passes - capacity.frozen_grad_bytes(w, model) / rk.device.mem_bw)
        # timed steps hold the memory traffic already; a pipeline or an accumulating host pays
        # the per-pass fixed cost each time, the AdamW update once, for the parameters it owns
        update = rk.optimizer_s * w.params_owned / model.params()
        return RankTime(t_fl + passes * sh.passes + update, t_fl, t_mem, update)
    return RankTime(max(t_fl, t_mem), t_fl, t_mem, 0.0)


def decode(rk, w: capacity.RankWork, sh: Shape, rows: int = 1, pad: int = 1) -> tuple[RankTime, str]:
    """One decode step of `rows` sequences (the matrix products padded to `pad` rows) on one
    rank, and where its weight-read rate came from: the weights read at the rank's rate for
    that many rows (DeviceProfile.weight_rate: calibrate's timed few-row product, else the
    memory bandwidth) and each sequence's KV cache at the memory bandwidth, or the FLOPs,
    whichever is slower; on measured hosts plus what each layer costs beyond its products
    (calibrate's timed block at that many rows) and the rank's engine step (decode_engine_s:
    header, wire codec, bookkeeping, sampling; once a step whatever its layers), else a
    forward pass's share of the timed fixed cost."""
    model, a = sh.model, dtype_bytes(sh.dtype)
    n = max(rows, pad)
    rate, source = rk.device.weight_rate(None if sh.quantize else sh.dtype, n)
    weights = capacity.weight_bytes(w, model, a, sh.quantize)[0]
    t_mem = weights / rate + rows * capacity.kv_bytes(w, model, a) / rk.device.mem_bw
    per_row = capacity.flops(w, model, "infer", sh.seq)
    products = w.tokens * 2 * w.matmul_params  # the rest of per_row is attention over the row's own cache
    t_fl = (n * products + rows * (per_row - products)) / rk.device.flops(sh.compute_dtype or sh.dtype)
    fixed = 0.0
    over = rk.device.layer_overhead(sh.compute_dtype or sh.dtype, n) if rk.measured else None
    if over is not None:  # calibrate's timed inference block, less its products, at this many rows
        # and the engine's own step (header, wire codec, bookkeeping, sampling), once per rank
        fixed = over * w.layers + (rk.device.decode_engine_s or 0.0)
    elif rk.measured and rk.decode_fixed_s is not None:  # calibrate's timed one-token forward
        fixed = rk.decode_fixed_s * capacity.fixed_share(w, model, sh.strategy)
    elif rk.measured:  # an older report: one forward pass, a third of a training pass's operations
        fixed = (rk.fixed_s - rk.optimizer_s) * capacity.fixed_share(w, model, sh.strategy) * DECODE_PASS
    return RankTime(max(t_fl, t_mem) + fixed, t_fl, t_mem, 0.0), source


def decode_source(ranks: list, sh: Shape) -> str:
    """Where the ranks' decode weight rates come from (DeviceProfile.weight_rate): the one
    source they share, else "mixed"."""
    got = {rk.device.weight_rate(None if sh.quantize else sh.dtype, 1)[1] for rk in ranks}
    return got.pop() if len(got) == 1 else "mixed"


def memory(w: capacity.RankWork, sh: Shape) -> capacity.Memory:
    return capacity.memory(sh.work(w), sh.model, sh.mode, sh.dtype, sh.seq, sh.strategy, sh.quantize)


def fits(rk, mem: capacity.Memory) -> bool:
    return mem.total <= available(rk)


def available(rk) -> float:
    return rk.memory_bytes * capacity.HEADROOM


def row(r: int, rk, w: capacity.RankWork, sh: Shape) -> tuple[dict, RankTime]:
    """The plan's `ranks` entry of rank r, and its times."""
    t = seconds(rk, w, sh)
    mem = memory(w, sh)
    tw = sh.work(w)
    return (
        {
            "rank": r,
            "name": rk.name,
            "device": rk.device.name,
            "flops_per_step": capacity.flops(tw, sh.model, sh.mode, sh.seq),
            "memory_traffic_bytes": capacity.memory_traffic(
                tw, sh.model, sh.mode, sh.dtype, sh.batch, sh.seq, sh.strategy, sh.quantize
            ),
            "compute_s": t.compute_s,
            "bound": t.bound,
            "memory": dict(mem.to_dict(), host_bytes=int(rk.memory_bytes), fits=fits(rk, mem)),
            "memory_available": int(available(rk)),
            "fits": fits(rk, mem),
        },
        t,
    )
