"""Planning diloco (issue 24): bytes per outer step to the byte, the H the plan picks, the
low-communication verdict, the int8 codec, the optimizer and data pieces every strategy now shares, and
a checkpoint that completes after a member left."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from smolnet.errors import UsageError
from smoltrain import registry
from smoltrain.comm import layout
from smoltrain.models.data import Batches
from smoltrain.models.optim import SGD, make_optimizer
from smoltrain.models.spec import get_model
from smoltrain.planner import diloco, diloco_verdict
from smoltrain.planner.links import from_class
from smoltrain.planner.plan import make_plan
from smoltrain.planner.ranks import resolve_ranks
from smoltrain.schema import check_any

TINY = get_model("tiny")


def test_bytes_per_outer_step_follow_the_ring_segments_with_int8_scales():
    n, world = 1001, 3  # segments 334, 334, 333 elements
    assert layout.ring_segments(n, world) == [(0, 334), (334, 668), (668, 1001)]
    seg = {"fp32": [1336, 1336, 1332], "int8": [334 + 4, 334 + 4, 333 + 4]}
    for dtype, s in seg.items():
        assert [diloco.rank_bytes(n, dtype, world, r) for r in range(world)] == [
            2 * sum(s) - s[(r + 1) % 3] - s[(r + 2) % 3] for r in range(world)
        ]
    assert layout.segment_bytes(2049, "int8") == 2049 + 3 * 4 and layout.segment_bytes(5, "bf16") == 10
    assert diloco.rank_bytes(n, "fp32", 1, 0) == 0 and diloco.rank_bytes(n, "fp32", 2, 1) == n * 4


def test_the_plan_amortises_one_all_reduce_over_h_inner_steps():
    h = 8
    plan = make_plan("diloco", TINY, 4, batch=8, seq=64, outer={"inner_steps": h, "sync_dtype": "int8"})
    per_outer = [diloco.rank_bytes(TINY.params(), "int8", 4, r) for r in range(4)]
    assert plan["inner_steps"] == h and plan["inner_steps_source"] == "given" and plan["sync_dtype"] == "int8"
    assert plan["outer"]["bytes_per_outer_step"] == max(per_outer)
    assert plan["bytes_per_token"] == max(per_outer) / (h * 8 * 64)
    assert sorted(ln["bytes_per_outer_step"] for ln in plan["links"]) == sorted(per_outer)
    assert math.isclose(plan["step_s"], plan["compute_s_per_step"] + plan["outer"]["sync_s"] / h)
    assert math.isclose(plan["tokens_per_s"], 8 * 64 / plan["step_s"])
    dp = make_plan("dp", TINY, 4, batch=8, seq=64)
    assert plan["bytes_per_token"] < dp["bytes_per_token"] / 20
    check_any(plan)


@pytest.mark.parametrize("target", [0.05, 0.1, 0.3])
def test_without_inner_steps_the_plan_picks_the_smallest_h_within_the_target(target):
    ranks = resolve_ranks(4)
    lm = from_class("1gbe")
    plan = make_plan("diloco", TINY, 4, ranks=ranks, lm=lm, outer={"target_comm": target})
    h, sync, compute = plan["inner_steps"], plan["outer"]["sync_s"], plan["compute_s_per_step"]
    assert sync / h <= target * (compute + sync / h) + 1e-12
    assert h == 1 or sync / (h - 1) > target * (compute + sync / (h - 1))
    slower = make_plan("diloco", TINY, 4, ranks=ranks, lm=from_class("tb5"), outer={"target_comm": target})
    assert slower["inner_steps"] <= h  # faster links, fewer inner steps between syncs


def test_outer_steps_are_planned_by_trait_not_by_name(monkeypatch):
    clone = dataclasses.replace(registry.get("diloco"), name="local-sgd")
    monkeypatch.setitem(registry.REGISTRY, "local-sgd", clone)
    want = make_plan("diloco", TINY, 3, outer={"inner_steps": 5})
    got = make_plan("local-sgd", TINY, 3, outer={"inner_steps": 5})
    assert json.dumps(got).replace("local-sgd", "diloco") == json.dumps(want)


def _plans_on_slow_links(world: int = 4):
    ranks, lm = resolve_ranks(world), from_class("1gbe")
    lm.default = dataclasses.replace(lm.default, rate_mbit=20.0)  # a slow home uplink everywhere
    plans = [make_plan(s, TINY, world, ranks=ranks, lm=lm) for s in registry.names() if registry.get(s).trains]
    return plans, ranks, lm


def test_the_verdict_names_the_diloco_setting_that_beats_the_single_host():
    plans, ranks, lm = _plans_on_slow_links()
    assert all(
        p["tokens_per_s"] < p["single_host"]["tokens_per_s"] for p in plans if registry.get(p["strategy"]).synchronous
    )

    def replan(strategy, outer):
        return make_plan(strategy, TINY, 4, ranks=ranks, lm=lm, outer=outer)

    low = diloco_verdict.low_comm_verdict(plans, replan)
    assert low["beats_single_host"] and low["best"]["vs_single_host"] > 1
    assert {r["sync_dtype"] for r in low["settings"]} == set(layout.SYNC_BYTES)
    best = low["best"]
    assert best["sync_dtype"] == "int8"  # fewest bytes on a slow link: the smallest H, the least overhead
    assert f"H={best['inner_steps']}" in low["sentence"] and "int8" in low["sentence"]
    assert f"{best['vs_single_host']:.2g}x" in low["sentence"]


def test_the_verdicts_h_keeps_communication_within_its_own_nearness():
    plans, ranks, lm = _plans_on_slow_links()

    def replan(strategy, outer):
        return make_plan(strategy, TINY, 4, ranks=ranks, lm=lm, outer=outer)

    low = diloco_verdict.low_comm_verdict(plans, replan, target_comm=0.1)  # run's default target is looser
    near = 1 - diloco_verdict.NEAR
    assert low["target_comm"] == near
    for row in low["settings"]:  # each dtype at the smallest H within 5% of the compute-bound pace
        want = replan("diloco", {"sync_dtype": row["sync_dtype"], "target_comm": near})["inner_steps"]
        assert row["inner_steps"] == want >= replan("diloco", {"sync_dtype": row["sync_dtype"]})["inner_steps"]
    strict = diloco_verdict.low_comm_verdict(plans, replan, target_comm=0.02)  # a stricter target is kept
    assert strict["target_comm"] == 0.02 and strict["best"]["inner_steps"] >= low["best"]["inner_steps"]
    check_any({"schema": "smoltrain.plans/1", "ranking": [], "plans": [], "skipped": [], "low_communication": low})


def test_int8_codec_is_one_scale_per_chunk_and_rounds_to_half_a_step():
    from smoltrain.comm.quantized import decode_int8, encode_int8

    g = torch.Generator().manual_seed(1)
    for n in (1, 1000, 1024, 2049, 5000):
        x = torch.randn(n, generator=g) * 3
        x[: min(n, 1024)] *= 100  # chunks of different magnitude get their own scale
        buf = encode_int8(x)
        assert buf.dtype == torch.uint8 and buf.numel() == layout.segment_bytes(n, "int8")
        chunks = -(-n // layout.INT8_CHUNK)
        scale = buf[: 4 * chunks].view(torch.float32)
        padded = torch.cat([x.abs(), x.new_zeros(chunks * layout.INT8_CHUNK - n)])  # the last chunk may be short
        want = padded.view(chunks, -1).amax(1) / 127
        assert torch.equal(scale, want)
        y = decode_int8(buf, n)
        step = scale.repeat_interleave(layout.INT8_CHUNK)[:n]
        assert bool(((y - x).abs() <= step / 2 * (1 + 1e-6)).all())
        work = torch.full((n + 3,), float("nan"))  # a dirty scratch buffer changes nothing
        assert torch.equal(encode_int8(x, work), buf) and torch.equal(decode_int8(buf, n, torch.empty(n)), y)
    zero = encode_int8(torch.zeros(10))
    assert torch.equal(zero[:4].view(torch.float32), torch.ones(1)) and not zero[4:].any()


def test_the_verdict_says_when_no_setting_would_win_and_stays_quiet_when_sync_wins():
    plans, ranks, lm = _plans_on_slow_links()

    def hopeless(strategy, outer):  # a real plan with the compute of a host that adds nothing
        p = make_plan(strategy, TINY, 4, ranks=ranks, lm=lm, outer=outer)
        return dict(p, tokens_per_s=p["single_host"]["tokens_per_s"] * 0.5)

    low = diloco_verdict.low_comm_verdict(plans, hopeless)
    assert not low["beats_single_host"] and "no diloco setting would beat it" in low["sentence"]
    fast = [make_plan(s, TINY, 4, ranks=ranks, lm=from_class("tb5")) for s in ("dp", "diloco")]
    assert diloco_verdict.low_comm_verdict(fast, hopeless) is None  # dp already beats the single host there


def test_outer_flags_apply_to_diloco_only_and_fill_their_defaults():
    args = type("Args", (), dict(strategy="dp", inner_steps=4, outer_lr=None, sync_dtype=None, target_comm=None))()
    with pytest.raises(UsageError, match="--inner-steps: only for a low-communication strategy"):
        diloco.check_args(args, False)
    args.strategy, args.inner_steps = "diloco", None
    diloco.check_args(args, True)
    assert (args.sync_dtype, args.target_comm) == ("fp32", diloco.TARGET_COMM)


def test_sgd_is_plain_and_make_optimizer_picks_by_name():
    p = torch.ones(3)
    opt = make_optimizer("sgd", [p], 0.5)
    assert isinstance(opt, SGD)
    opt.step([torch.tensor([1.0, 2.0, -2.0])])
    assert torch.equal(p, torch.tensor([0.5, 0.0, 2.0]))
    st = opt.state_tensors()
    fresh = SGD([torch.ones(3)], 0.5)
    fresh.load_state_tensors(st)
    assert fresh.step_count == 1


def test_the_held_out_slice_is_never_trained_on():
    n = 1 << 14
    data = bytes(range(97, 122)) * (n // 25) + b"z" * (n // 16)  # the held-out sixteenth: all "z"
    data = data[len(data) - n :]
    b = Batches(data, 8, 32, seed=5, holdout=True)
    assert b.train_end == n - n // 16
    z = ord("z")
    assert all(int((b.global_batch(k)[1] == z).sum()) == 0 for k in range(300))
    ev = b.eval_batches()
    assert len(ev) == 4 and all(bool((x == z).all()) for x, _ in ev)
    assert all(torch.equal(a[0], c[0]) for a, c in zip(ev, b.eval_batches()))  # the same windows every time
    plain = Batches(data, 8, 32, seed=5)  # without --eval-every: every byte is trained on, as before
    assert plain.train_end == n and torch.equal(plain.global_batch(3)[0], Batches(data, 8, 32, 5).global_batch(3)[0])


def test_the_default_outer_step_fits_the_run_length():
    short = diloco.outer_optimizer(None, None, steps=96, inner_steps=8)
    assert short[:2] == (1.0, 0.0) and "12 outer steps" in short[2]
    long = diloco.outer_optimizer(None, None, steps=diloco.MOMENTUM_FROM * 8, inner_steps=8)
    assert long[:2] == (0.7, 0.9)
    assert diloco.outer_optimizer(0.5, None, steps=96, inner_steps=8)[:2] == (0.5, 0.0)
    assert diloco.outer_optimizer(0.5, 0.2, steps=96, inner_steps=8) == (0.5, 0.2, "as given")


def test_diloco_leaves_out_a_host_whose_one_sequence_outlasts_the_others_step():
    from dataclasses import replace

    from smoltrain.planner.placement_plan import place
    from smoltrain.planner.ranks import Rank, resolve_ranks

    base = resolve_ranks(1)[0].device
    laptop = Rank("laptop", base, 8e9, fixed_s=0.01, measured=True)
    # a pi 4x slower whose fixed cost per step alone (0.5 s) exceeds the laptop's whole step
    slow = replace(base, flops_fp32=base.flops_fp32 / 4, flops_fp16=base.flops_fp16 / 4, mem_bw=base.mem_bw / 4)
    pi = Rank("pi", slow, 8e9, fixed_s=0.5, measured=True)
    dl = place("diloco", "auto", TINY, [laptop, pi], batch=8, seq=64)
    assert dl.order == ["laptop"] and dl.shares == [1.0]
    assert [e["name"] for e in dl.excluded] == ["pi"] and "one sequence takes it" in dl.excluded[0]["why"]
    dp = place("dp", "auto", TINY, [laptop, pi], batch=8, seq=64)  # lockstep strategies keep every host
    assert sorted(dp.order) == ["laptop", "pi"] and not dp.excluded
    big = place("diloco", "auto", TINY, [laptop, pi], batch=256, seq=64)  # enough work: the pi helps again
    assert sorted(big.order) == ["laptop", "pi"]


def test_a_checkpoint_after_a_member_leaves_completes_with_the_members_parts(tmp_path):
    """Unit: the controller marks a diloco checkpoint complete once the members still in the run
    saved theirs, whether the leave arrives before or after their parts."""
    from rich.console import Console

    from smoltrain.models.spec import get_model
    from smoltrain.run.config import RunConfig
    from smoltrain.run.controller import Controller, Placement

    names = ("rank0", "rank1", "rank2")
    cfg = RunConfig("diloco", "socket", get_model("tiny"), 12, 6, 32, 1e-3, 0, names, ("cpu",) * 3)
    cfg = cfg.replace(checkpoint_dir=str(tmp_path / "ck"), inner_steps=4)
    ctl = Controller(cfg, [Placement(n, "127.0.0.1") for n in names], b"k" * 32, Console(quiet=True), str(tmp_path))

    def saved(step, who):
        (tmp_path / "ck" / f"step-{step:06d}").mkdir(parents=True, exist_ok=True)
        ctl.handle(who, {"type": "saved", "step": step, "part": who, "sha256": "0" * 64, "bytes": 1}, None)

    def marked(step):
        return (tmp_path / "ck" / f"step-{step:06d}" / "complete.json").exists()

    for who in names:
        saved(4, who)
    assert marked(4)
    saved(8, "rank0")
    saved(8, "rank1")
    assert not marked(8)  # rank2 has not saved and has not left (yet)
    ctl.handle("rank0", {"type": "event", "step": 7, "kind": "leave", "name": "rank2"}, None)
    assert marked(8)  # the leave completes it
    saved(12, "rank0")
    assert not marked(12)
    saved(12, "rank1")
    assert marked(12)
    parts = json.loads((tmp_path / "ck" / "step-000012" / "complete.json").read_text())["parts"]
    assert sorted(parts) == ["rank0", "rank1"]
    assert [e["step"] for e in ctl.events if e["kind"] == "checkpoint"] == [4, 8, 12]


@pytest.mark.parametrize("seed", range(4))
def test_paced_ranges_cover_every_batch_once_and_keep_each_ranks_steps_alike(seed):
    """Any split of the outer step's steps x batch sequences: in every step the ranks' ranges
    tile the batch in order; each rank gets its count over the steps, floor(c/steps) or one
    more in each."""
    import random

    from smoltrain.planner.placement import paced_ranges

    rng = random.Random(seed)
    for _ in range(200):
        steps, batch = rng.randint(1, 17), rng.randint(1, 20)
        n = rng.randint(1, min(5, batch))
        total = steps * batch
        cuts = sorted(rng.sample(range(1, total), n - 1)) if n > 1 else []
        counts = [b - a for a, b in zip([0] + cuts, cuts + [total])]
        got = paced_ranges(batch, steps, counts)
        for j in range(steps):
            assert got[0][j][0] == 0 and got[-1][j][1] == batch
            assert all(got[r][j][1] == got[r + 1][j][0] for r in range(n - 1))
        for r in range(n):
            sizes = [hi - lo for lo, hi in got[r]]
            assert sum(sizes) == counts[r] and max(sizes) - min(sizes) <= 1
