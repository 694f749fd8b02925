"""Placement on hand-built ranks: shares, layer cuts, head splits, rank order, refusals, all
judged by the plan's own cost model (rank_time and make_plan)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from computetools import write_compute

from smoltrain.models.spec import get_model
from smoltrain.planner.links import Link, LinkModel
from smoltrain.planner.placement import (
    PlacementError,
    candidate_orders,
    counts_from_shares,
    even_counts,
    named_batch_ranges,
    validate,
)
from smoltrain.planner.placement_plan import place, place_dict
from smoltrain.planner.plan import make_plan
from smoltrain.planner.ranks import Rank, resolve_ranks

TINY = get_model("tiny")
GB = 1e9


def ranks(mem: float = 8 * GB, **speed) -> list[Rank]:
    """Generic hosts, each `speed` times the generic profile's FLOP/s and memory bandwidth."""
    base = resolve_ranks(1)[0].device
    return [
        Rank(
            n,
            replace(base, flops_fp32=base.flops_fp32 * f, flops_fp16=base.flops_fp16 * f, mem_bw=base.mem_bw * f),
            mem,
        )
        for n, f in speed.items()
    ]


def links(names, mbit: float = 1000.0, **slow_mbit) -> LinkModel:
    """Every pair at `mbit`, except pairs touching a host named in `slow_mbit` (its rate)."""
    out = {}
    for a in names:
        for b in names:
            if a != b:
                rate = min([slow_mbit[x] for x in (a, b) if x in slow_mbit] or [mbit])
                out[(a, b)] = Link(rate or None, 100.0, "ok" if rate else "down")
    return LinkModel({"kind": "test"}, out)


def step(p, rk, lm=None, **kw) -> float:
    return make_plan(p.strategy, TINY, p.world, ranks=rk, lm=lm, single=False, placement=place_dict(p), **kw)["step_s"]


def test_even_counts_put_the_extra_first():
    assert even_counts(6, 4) == [2, 2, 1, 1]
    assert even_counts(8, 2) == [4, 4]


@pytest.mark.parametrize("strategy", ["dp", "fsdp", "syncps", "edp"])
def test_equal_speeds_give_the_even_split(strategy):
    rk = ranks(a=1, b=1, c=1)
    auto = place(strategy, "auto", TINY, rk, batch=9, seq=32)
    even = place(strategy, "even", TINY, rk, batch=9, seq=32)
    assert counts_from_shares(9, auto.shares) == counts_from_shares(9, even.shares) == [3, 3, 3]
    assert abs(sum(auto.shares) - 1) < 1e-12


def test_equal_speeds_cut_layers_and_heads_evenly():
    rk = ranks(a=1, b=1, c=1, d=1)
    assert place("pp", "even", TINY, rk, batch=8, seq=32, microbatches=4).layers == [[0, 2], [2, 4], [4, 5], [5, 6]]
    assert place("tp", "even", TINY, rk, batch=8, seq=32).heads == [[0, 2], [2, 4], [4, 5], [5, 6]]
    rk3 = ranks(a=1, b=1, c=1)
    assert place("pp", "auto", TINY, rk3, batch=8, seq=32, microbatches=4).layers == [[0, 2], [2, 4], [4, 6]]
    assert place("tp", "auto", TINY, rk3, batch=8, seq=32).heads == [[0, 2], [2, 4], [4, 6]]


def test_twice_as_fast_gets_twice_the_work():
    rk = ranks(fast=2, slow=1)
    dp = place("dp", "auto", TINY, rk, batch=12, seq=32)
    assert dict(zip(dp.order, counts_from_shares(12, dp.shares))) == {"fast": 8, "slow": 4}
    tp = place("tp", "auto", TINY, rk, batch=12, seq=32)
    heads = {n: hi - lo for n, (lo, hi) in zip(tp.order, tp.heads)}
    assert heads["fast"] > heads["slow"]
    assert [hi - lo for lo, hi in tp.ffn] == [TINY.ffn * (hi - lo) // TINY.heads for lo, hi in tp.heads]
    pp = place("pp", "auto", TINY, rk, batch=12, seq=32, microbatches=4)
    layers = {n: hi - lo for n, (lo, hi) in zip(pp.order, pp.layers)}
    assert layers["fast"] > layers["slow"]
    even = place("pp", "even", TINY, rk, batch=12, seq=32, microbatches=4)
    kw = dict(batch=12, seq=32, microbatches=4)
    assert step(pp, rk, **kw) < step(even, rk, **kw)


def test_placement_follows_the_dtype_that_runs():
    """`a` has fast bf16 (3.9x its fp32), `b` none but twice a's fp32: in fp32 b is faster,
    in bf16 a is (3.9 against 2). With compute-bound ranks the batch follows the FLOP/s of
    the dtype that runs: fp32 1:2, bf16 3.9:2 (of 12: 4 and 8, then 8 and 4)."""
    base = resolve_ranks(1)[0].device
    big = replace(base, mem_bw=1e15)  # compute-bound: the split follows FLOP/s alone
    rk = [
        Rank("a", replace(big, flops_fp32=1e12, flops_fp16=3.9e12), 8 * GB),
        Rank("b", replace(big, flops_fp32=2e12, flops_fp16=2e12), 8 * GB),
    ]
    got = {}
    for dtype in ("fp32", "bf16"):
        p = place("dp", "auto", TINY, rk, dtype=dtype, batch=12, seq=32)
        got[dtype] = dict(zip(p.order, counts_from_shares(12, p.shares)))
    assert got["fp32"] == {"a": 4, "b": 8}
    assert got["bf16"] == {"a": 8, "b": 4}


def test_tp_charges_the_models_own_embeddings():
    """Llama-3.2-1B (rotary, tied head) tp over two 16 GB hosts fits: each holds half of every
    layer and the embedding once, (16 x 60.83M / 2 + 262.67M) = 749.3M parameters x 16 bytes
    (fp32 weight, gradient, two AdamW moments) = 11.99 GB of 14.4 usable; no learned position
    table and no second head (the old charge, (2 x 262.67M + 131072 x 2048) x 16 = 12.7 GB for
    the embeddings alone, refused it)."""
    llama = get_model("llama-3.2-1b")
    rk = ranks(mem=16 * GB, a=1, b=1)
    p = place("tp", "even", llama, rk, batch=1, seq=64)
    assert p.heads == [[0, 16], [16, 32]]
    d = make_plan("tp", llama, 2, ranks=rk, batch=1, seq=64, single=False, placement=place_dict(p))
    held = 16 * llama.layer_params() / 2 + llama.embedding_params()
    assert held == pytest.approx(749.3e6, rel=1e-3)
    m = d["ranks"][0]["memory"]
    assert m["weights"] + m["grads"] + m["optimizer"] == pytest.approx(held * 16, rel=1e-6)
    assert all(r["fits"] for r in d["ranks"])


def test_a_host_without_memory_for_a_layer_gets_none_and_the_plan_says_why():
    rk = ranks(a=1, b=1, c=1)
    rk[2].memory_bytes = 1e5  # 100 KB: not one layer of tiny
    for strategy in ("pp", "dp", "tp"):
        p = place(strategy, "auto", TINY, rk, batch=8, seq=32, microbatches=2)
        assert p.order == ["a", "b"]
        assert [e["name"] for e in p.excluded] == ["c"] and "needs" in p.excluded[0]["why"]


def test_a_model_that_cannot_fit_is_refused():
    big = get_model("gpt2-124m")
    for strategy in ("dp", "pp", "tp"):
        with pytest.raises(PlacementError, match="gpt2-124m"):
            place(strategy, "auto", big, ranks(mem=1e6, a=1, b=1), batch=8, seq=64, microbatches=2)
    # fits in total but not evenly: even refuses, auto cuts by memory
    rk = ranks(a=1, b=1)
    rk[0].memory_bytes, rk[1].memory_bytes = 1.2 * GB, 3 * GB  # a: the embedding and about 3 layers
    with pytest.raises(PlacementError, match="even"):
        place("pp", "even", big, rk, batch=1, seq=64, microbatches=1)
    p = place("pp", "auto", big, rk, batch=1, seq=64, microbatches=1)
    assert {n: hi - lo for n, (lo, hi) in zip(p.order, p.layers)}["a"] <= 3


def test_rank_order_keeps_the_slow_uplink_off_the_busiest_transfer():
    """Four equal hosts, one with a slow link: pp's chain puts it at an end (one boundary, not two)."""
    rk = ranks(a=1, slow=1, b=1, d=1)
    lm = links([r.name for r in rk], slow=10.0)
    kw = dict(batch=8, seq=32, microbatches=4)
    p = place("pp", "auto", TINY, rk, lm, **kw)
    assert p.order[0] == "slow" or p.order[-1] == "slow"
    even = place("pp", "even", TINY, rk, lm, **kw)
    assert even.order == ["a", "slow", "b", "d"]
    assert step(p, rk, lm, **kw) < step(even, rk, lm, **kw)
    # star (syncps): the hub is the host whose links are fastest
    names = ["a", "b", "slow", "d"]
    star = links(names, mbit=10.0, d=10000.0)  # d's links are fast, every other pair slow
    assert place("syncps", "auto", TINY, ranks(a=1, b=1, slow=1, d=1), star, batch=8, seq=32).order[0] == "d"


def test_a_down_link_is_routed_around_or_named():
    """The sim's home faults: one pair cannot carry full frames. Any order that avoids it is
    chosen, by even as by auto; with no such order, the refusal names the link."""
    rk = ranks(a=1, b=1, c=1)
    lm = links([r.name for r in rk])
    lm.links[("a", "b")] = Link(None, 100.0, "down")
    lm.links[("b", "a")] = Link(None, 100.0, "down")
    for mode in ("even", "auto"):
        p = place("pp", mode, TINY, rk, lm, batch=8, seq=32, microbatches=2)
        chain = list(zip(p.order, p.order[1:]))
        assert ("a", "b") not in chain and ("b", "a") not in chain, p.order
    with pytest.raises(PlacementError, match="a -> b is down"):  # a ring of three must use every pair
        place("dp", "even", TINY, rk, lm, batch=8, seq=32)


def test_order_search_beyond_eight_hosts_uses_the_heuristic():
    names = [f"h{i}" for i in range(10)]
    orders = candidate_orders(names, "chain", lambda a, b, n: 10.0 if "h3" in (a, b) else 1.0, 1.0)
    assert orders and (orders[0][0] == "h3" or orders[0][-1] == "h3")


def test_parameter_server_split_follows_the_placement_and_survives_a_leave():
    pl = {"order": ["a", "b", "c"], "shares": [0.5, 0.25, 0.25]}
    assert named_batch_ranges(8, ["a", "b", "c"], pl) == {"a": (0, 4), "b": (4, 6), "c": (6, 8)}
    r = named_batch_ranges(8, ["a", "c"], pl)
    assert sum(hi - lo for lo, hi in r.values()) == 8 and r["a"][1] - r["a"][0] > r["c"][1] - r["c"][0]


def test_validate_refuses_a_placement_the_run_cannot_execute():
    with pytest.raises(PlacementError, match="layers"):
        validate({"order": ["a", "b"], "layers": [[0, 2], [3, 6]]}, "pp", TINY, 8, 2)
    with pytest.raises(PlacementError, match="order"):
        validate({"order": ["a", "a"], "shares": [0.5, 0.5]}, "dp", TINY, 8, 2)
    validate(
        json.loads(json.dumps(place("tp", "even", TINY, ranks(a=1, b=1, c=1, d=1), batch=8, seq=32).to_dict())),
        "tp",
        TINY,
        8,
        4,
    )


def _compute_file(tmp_path, fast="rank0", names=("rank0", "rank1", "rank2")):
    return write_compute(tmp_path / "compute.json", names, fast)


def test_plan_shows_the_placement_next_to_even(tmp_path, capsys):
    from smoltrain.cli import main

    c = _compute_file(tmp_path)
    assert (
        main(
            [
                "plan",
                "--strategy",
                "pp",
                "--world",
                "3",
                "--microbatches",
                "4",
                "--compute",
                str(c),
                "--no-what-if",
                "--json",
                str(tmp_path / "p.json"),
            ]
        )
        == 0
    )
    sec = json.loads((tmp_path / "p.json").read_text())["placement"]
    assert sec["mode"] == "auto" and sec["speed_source"] == "measured"  # auto: a compute report was given
    assert sec["layers"][0][1] - sec["layers"][0][0] > 2 and sec["speedup"] > 1.2
    out = capsys.readouterr().out
    assert "placement auto" in out and "auto vs even" in out
    assert (
        main(
            [
                "plan",
                "--strategy",
                "all",
                "--world",
                "3",
                "--compute",
                str(c),
                "--placement",
                "even",
                "--no-what-if",
                "--json",
                str(tmp_path / "all.json"),
            ]
        )
        == 0
    )
    doc = json.loads((tmp_path / "all.json").read_text())
    assert doc["ranking_placed"] and all(p["placement"]["mode"] == "even" for p in doc["plans"] if "placement" in p)


def test_run_config_carries_the_placement_over_the_wire():
    from smoltrain.run.config import ConfigError, RunConfig

    pl = place("tp", "even", TINY, ranks(a=1, b=1, c=1, d=1), batch=8, seq=32).to_dict()
    cfg = RunConfig(
        strategy="tp",
        backend="socket",
        model=TINY,
        steps=1,
        batch=8,
        seq=32,
        lr=1e-3,
        seed=0,
        names=("a", "b", "c", "d"),
        devices=("cpu",) * 4,
        placement=pl,
    )
    back = RunConfig.from_wire(json.loads(json.dumps(cfg.to_wire())))
    assert back.placement == pl and cfg.report_view()["placement"] == pl
    bad = cfg.to_wire()
    bad["placement"] = [1, 2]
    with pytest.raises(ConfigError, match="placement"):
        RunConfig.from_wire(bad)


def test_decode_placement_minimises_the_sum_of_stages_and_closes_the_ring():
    """Batch-1 decode runs the stages one after another (CONTRACT section 6): auto minimises
    the sum of stage compute and hops, so a host 4x faster takes every layer but the one each
    other stage must hold (tiny8: 8 - 3 = 5 of 8), where a training pipeline balances stages.
    The last stage returns the token to the first, so a down link is avoided around the ring."""
    rk = ranks(slow1=1, fast=4, slow2=1, slow3=1)
    kw = dict(task="infer", batch=1, seq=64)
    tiny8 = get_model("tiny8")
    p = place("pp", "auto", tiny8, rk, **kw)
    assert {n: hi - lo for n, (lo, hi) in zip(p.order, p.layers)}["fast"] == 5
    even = place("pp", "even", tiny8, rk, **kw)
    plan = {
        q.mode: make_plan("pp", tiny8, 4, mode="infer", ranks=rk, single=False, placement=place_dict(q))
        for q in (p, even)
    }
    assert plan["auto"]["step_s"] < plan["even"]["step_s"]
    lm = links([r.name for r in rk])
    lm.links[("slow3", "slow1")] = Link(None, 100.0, "down")  # the even order's token return
    back = place("pp", "even", tiny8, rk, lm, **kw).order
    assert (back[-1], back[0]) != ("slow3", "slow1") and back != ["slow1", "fast", "slow2", "slow3"]
