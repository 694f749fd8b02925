"""Planning low-communication training (DiLoCo): bytes per outer step, the inner steps H, and
the setting that would beat the best single host.

Replicas train H inner steps on their own slices, then all-reduce the pseudo-gradient
(weights at the last outer step minus their own) once, as a ring, in `--sync-dtype`. So the
links carry one all-reduce of the parameters every H steps instead of every step:

    bytes per outer step (rank r) = 2 * sum(segment bytes) - seg[(r+1)%N] - seg[(r+2)%N]
    bytes per token               = busiest rank's bytes per outer step / (H * global tokens)
    step time (per inner step)    = compute + (all-reduce + outer update) / H

Segments are the ring's N nearly equal element ranges (the first numel % N get one more);
a segment costs its elements at the sync dtype's size, and in int8 one fp32 scale per
INT8_CHUNK elements more: the transport's own layout (smoltrain.comm.layout), which the
plan reads, so plan and wire count the same bytes. Without `--inner-steps` the plan picks the
smallest H that keeps communication at or under `--target-comm` of the step time.
"""

from __future__ import annotations

import math

from smolnet.errors import UsageError
from smoltrain.comm.layout import SYNC_BYTES, ring_segments, segment_bytes
from smoltrain.planner.bottleneck import human_bytes, human_s
from smoltrain.planner.traffic import Phase, Traffic, Transfer

TARGET_COMM = 0.1  # default share of the step time communication may take
MAX_INNER_STEPS = 10_000
FALLBACK_INNER_STEPS = 16  # `run` without a plan to pick H from
MOMENTUM_FROM = 200  # outer steps from which the default outer step is Nesterov 0.7 / 0.9 (else plain averaging)
UPDATE_PASSES = 12  # fp32 passes over the parameters per outer step (pseudo-gradient, casts, Nesterov, copy)


def rank_bytes(numel: int, dtype: str, world: int, rank: int) -> int:
    """Payload bytes rank `rank` sends in one outer all-reduce: every segment in the
    reduce-scatter but (r+1)%N, every segment in the all-gather but (r+2)%N."""
    if world < 2 or numel == 0:
        return 0
    seg = [segment_bytes(hi - lo, dtype) for lo, hi in ring_segments(numel, world)]
    return 2 * sum(seg) - seg[(rank + 1) % world] - seg[(rank + 2) % world]


def outer_traffic(numel: int, dtype: str, world: int) -> Traffic:
    """One outer all-reduce as 2(N-1) ring rounds with each rank's exact segment bytes."""
    tr = Traffic("outer", "train", world)
    if world < 2:
        return tr
    seg = [segment_bytes(hi - lo, dtype) for lo, hi in ring_segments(numel, world)]
    for t in range(world - 1):  # reduce-scatter: rank r sends the partial sum of segment r - t
        tr.phases.append(
            Phase(
                f"reduce-scatter pseudo-gradient ({dtype})",
                [Transfer(r, (r + 1) % world, seg[(r - t) % world]) for r in range(world)],
            )
        )
    for t in range(world - 1):  # all-gather: rank r passes on segment r + 1 - t
        tr.phases.append(
            Phase(
                f"all-gather pseudo-gradient ({dtype})",
                [Transfer(r, (r + 1) % world, seg[(r + 1 - t) % world]) for r in range(world)],
            )
        )
    return tr


def pick_inner_steps(sync_s: float, compute_s: float, target: float) -> int:
    """The smallest H with sync_s / H <= target * (compute_s + sync_s / H)."""
    if sync_s <= 0:
        return 1
    if compute_s <= 0 or not math.isfinite(sync_s):
        return MAX_INNER_STEPS
    return max(1, min(MAX_INNER_STEPS, math.ceil(sync_s * (1 - target) / (target * compute_s) - 1e-9)))


FLAGS = ("inner_steps", "outer_lr", "outer_momentum", "sync_dtype", "target_comm")


def check_args(args, outer_steps: bool) -> None:
    """The outer-step flags of `run` and `plan` apply only to a strategy with outer steps (their
    ranges are argparse's, smoltrain.validate); fills in the defaults that do not depend on the run."""
    given = [f for f in FLAGS if getattr(args, f, None) is not None]
    if given and not outer_steps:
        flags = ", ".join("--" + f.replace("_", "-") for f in given)
        raise UsageError(f"{flags}: only for a low-communication strategy (diloco), not --strategy {args.strategy}")
    for f, v in (("sync_dtype", "fp32"), ("target_comm", TARGET_COMM)):
        if getattr(args, f, None) is None:
            setattr(args, f, v)


def add_arguments(p, run: bool) -> None:
    """The outer-step flags, shared by `run` and `plan`."""
    from smoltrain import validate

    p.add_argument(
        "--inner-steps",
        type=validate.count(MAX_INNER_STEPS),
        metavar="H",
        help="diloco: inner steps per outer step (default: the plan's)",
    )
    if run:
        by_length = f"(default: 0.7 for runs of {MOMENTUM_FROM}+ outer steps, else 1: plain averaging)"
        p.add_argument("--outer-lr", type=validate.real(0, 10, lo_open=True), help=f"diloco: outer SGD lr {by_length}")
        p.add_argument(
            "--outer-momentum",
            type=validate.real(0, 1, hi_open=True),
            help=f"diloco: outer Nesterov momentum in [0, 1) (default: 0.9 for {MOMENTUM_FROM}+ outer steps, else 0)",
        )
    p.add_argument(
        "--sync-dtype", choices=tuple(SYNC_BYTES), help="diloco: the pseudo-gradient's dtype on the wire (default fp32)"
    )
    p.add_argument(
        "--target-comm",
        type=validate.real(0, 1, lo_open=True, hi_open=True),
        help="diloco without --inner-steps: the smallest H keeping communication at or under this share "
        f"of the step time (default {TARGET_COMM})",
    )


def outer_optimizer(lr: float | None, momentum: float | None, steps: int, inner_steps: int) -> tuple[float, float, str]:
    """(outer lr, outer momentum, why) for a run of `steps` inner steps at H: what was given;
    otherwise plain averaging (1, 0) for a run of fewer than MOMENTUM_FROM outer steps, the
    papers' Nesterov 0.7 / 0.9 from there on (measured: docs/diloco.md, BENCHMARKS.md)."""
    outer = -(-steps // inner_steps)
    if lr is not None and momentum is not None:
        return lr, momentum, "as given"
    long = outer >= MOMENTUM_FROM
    d_lr, d_mu = (0.7, 0.9) if long else (1.0, 0.0)
    why = (
        f"{outer} outer steps: the papers' Nesterov settings pay over hundreds"
        if long
        else f"{outer} outer steps, fewer than {MOMENTUM_FROM}: plain averaging; outer momentum pays over hundreds"
    )
    return (d_lr if lr is None else lr), (d_mu if momentum is None else momentum), why


def options(outer: dict | None) -> dict:
    """The plan's diloco settings: inner_steps (None: pick by target_comm), sync_dtype, target_comm."""
    o = dict(outer or {})
    return {
        "inner_steps": o.get("inner_steps") or None,
        "sync_dtype": o.get("sync_dtype") or "fp32",
        "target_comm": o.get("target_comm") or TARGET_COMM,
    }


def outer_phase(model, ranks: list, names: list[str], lm, outer: dict | None, compute_s: float, tuning=None):
    """The outer step as the builder's amortised phase (planner.phases): one ring all-reduce of
    the pseudo-gradient and the outer update, every H inner steps, and the anchor and momentum
    every rank keeps (two fp32 copies of what trains); under LoRA (`tuning`) the adapters alone.
    H is the given inner_steps, else the smallest keeping communication at or under target_comm."""
    from smoltrain.planner import timing
    from smoltrain.planner.phases import Amortised

    o = options(outer)
    world, dtype = len(names), o["sync_dtype"]
    numel = tuning.trainable(model) if tuning is not None else model.params()
    tr = outer_traffic(numel, dtype, world)
    cc = timing.comm_cost(tr, names, lm)
    slowest_bw = min(rk.device.mem_bw for rk in ranks[:world]) if ranks else 0.0
    update_s = UPDATE_PASSES * numel * 4 / slowest_bw if slowest_bw else 0.0
    sync_s = cc.total_s + update_s
    H = o["inner_steps"] or pick_inner_steps(sync_s, compute_s, o["target_comm"])
    why_every = "given" if o["inner_steps"] else f"target_comm {o['target_comm']:g}"
    ph = Amortised("outer step", tr, H, cc, update_s, 2 * numel * 4, dtype, why_every, o["target_comm"])
    why = "as given" if o["inner_steps"] else f"keeps communication at or under {o['target_comm']:.0%} of the step"
    ph.note = (
        f"one ring all-reduce of the {dtype} pseudo-gradient every {H} inner steps "
        f"({human_bytes(ph.busiest)} from the busiest rank, {human_s(sync_s)} with the outer update); H {why}"
    )
    return ph
