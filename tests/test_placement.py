"""Placement on hand-built speed profiles: shares, layer cuts, head splits, rank order, refusals."""

from __future__ import annotations

import json

import pytest
from computetools import write_compute

from smoltrain.models.spec import get_model
from smoltrain.planner.placement import (
    PlacementError,
    counts_from_shares,
    even_counts,
    named_batch_ranges,
    place,
    validate,
)
from smoltrain.planner.placement_search import candidate_orders
from smoltrain.planner.placement_split import predict
from smoltrain.planner.speeds import HostSpeed, host_speeds

TINY = get_model("tiny")
GB = 1e9


def speeds(**tok_s):
    return {n: HostSpeed(n, 1.0 / t, 8 * GB) for n, t in tok_s.items()}


def test_even_counts_put_the_extra_first():
    assert even_counts(6, 4) == [2, 2, 1, 1]
    assert even_counts(8, 2) == [4, 4]


@pytest.mark.parametrize("strategy", ["dp", "fsdp", "syncps", "edp"])
def test_equal_speeds_give_the_even_split(strategy):
    sp = speeds(a=1e4, b=1e4, c=1e4)
    auto = place(strategy, "auto", TINY, list(sp), sp, 9, 32)
    even = place(strategy, "even", TINY, list(sp), sp, 9, 32)
    assert counts_from_shares(9, auto.shares) == counts_from_shares(9, even.shares) == [3, 3, 3]
    assert abs(sum(auto.shares) - 1) < 1e-12


def test_equal_speeds_cut_layers_and_heads_evenly():
    sp = speeds(a=1e4, b=1e4, c=1e4, d=1e4)
    assert place("pp", "even", TINY, list(sp), sp, 8, 32, 4).layers == [[0, 2], [2, 4], [4, 5], [5, 6]]
    assert place("tp", "even", TINY, list(sp), sp, 8, 32).heads == [[0, 2], [2, 4], [4, 5], [5, 6]]
    sp2 = speeds(a=1e4, b=1e4, c=1e4)
    assert place("pp", "auto", TINY, list(sp2), sp2, 8, 32, 4).layers == [[0, 2], [2, 4], [4, 6]]
    assert place("tp", "auto", TINY, list(sp2), sp2, 8, 32).heads == [[0, 2], [2, 4], [4, 6]]


def test_twice_as_fast_gets_twice_the_work():
    sp = speeds(fast=2e4, slow=1e4)
    dp = place("dp", "auto", TINY, list(sp), sp, 12, 32)
    assert dict(zip(dp.order, counts_from_shares(12, dp.shares))) == {"fast": 8, "slow": 4}
    tp = place("tp", "auto", TINY, list(sp), sp, 12, 32)
    heads = {n: hi - lo for n, (lo, hi) in zip(tp.order, tp.heads)}
    assert heads["fast"] > heads["slow"]
    assert [hi - lo for lo, hi in tp.ffn] == [TINY.ffn * (hi - lo) // TINY.heads for lo, hi in tp.heads]
    pp = place("pp", "auto", TINY, list(sp), sp, 12, 32, 4)
    layers = {n: hi - lo for n, (lo, hi) in zip(pp.order, pp.layers)}
    assert layers["fast"] > layers["slow"]
    assert (
        predict(pp, TINY, sp, 12, 32, 4)["step_s"]
        < predict(place("pp", "even", TINY, list(sp), sp, 12, 32, 4), TINY, sp, 12, 32, 4)["step_s"]
    )


def test_a_host_without_memory_for_a_layer_gets_none_and_the_plan_says_why():
    sp = speeds(a=1e4, b=1e4, c=1e4)
    sp["c"] = HostSpeed("c", 1e-4, 1e5)  # 100 KB: not one layer of tiny
    for strategy in ("pp", "dp", "tp"):
        p = place(strategy, "auto", TINY, list(sp), sp, 8, 32, 2)
        assert p.order == ["a", "b"]
        assert [e["name"] for e in p.excluded] == ["c"] and "needs" in p.excluded[0]["why"]


def test_a_model_that_cannot_fit_is_refused():
    sp = {n: HostSpeed(n, 1e-4, 1e6) for n in "ab"}
    big = get_model("gpt2-124m")
    for strategy in ("dp", "pp", "tp"):
        with pytest.raises(PlacementError, match="gpt2-124m"):
            place(strategy, "auto", big, list(sp), sp, 8, 64, 2)
    # fits in total but not evenly: even refuses, auto cuts by memory
    sp = {"a": HostSpeed("a", 1e-4, 1.2 * GB), "b": HostSpeed("b", 1e-4, 3 * GB)}  # a: the embedding and 3 layers
    with pytest.raises(PlacementError, match="even"):
        place("pp", "even", big, ["a", "b"], sp, 1, 64, 1)
    p = place("pp", "auto", big, ["a", "b"], sp, 1, 64, 1)
    assert {n: hi - lo for n, (lo, hi) in zip(p.order, p.layers)}["a"] <= 3


def test_rank_order_keeps_the_slow_uplink_off_the_busiest_transfer():
    """Four equal hosts, one with a slow link: pp's chain puts it at an end (one boundary, not two)."""
    sp = speeds(a=1e4, b=1e4, slow=1e4, d=1e4)

    def link_s(src, dst, n):
        return n / (1e6 if "slow" in (src, dst) else 1e8)

    p = place("pp", "auto", TINY, ["a", "slow", "b", "d"], sp, 8, 32, 4, link_s)
    assert p.order[0] == "slow" or p.order[-1] == "slow"
    even = place("pp", "even", TINY, ["a", "slow", "b", "d"], sp, 8, 32, 4, link_s)
    assert even.order == ["a", "slow", "b", "d"]
    assert predict(p, TINY, sp, 8, 32, 4, link_s)["step_s"] < predict(even, TINY, sp, 8, 32, 4, link_s)["step_s"]

    # star (syncps): the hub is the host whose links are fastest
    def star_s(src, dst, n):
        return n / (1e9 if "d" in (src, dst) else 1e7)

    assert place("syncps", "auto", TINY, ["a", "b", "slow", "d"], sp, 8, 32, 1, star_s).order[0] == "d"


def test_order_search_beyond_eight_hosts_uses_the_heuristic():
    names = [f"h{i}" for i in range(10)]
    orders = candidate_orders(names, "chain", lambda a, b, n: 10.0 if "h3" in (a, b) else 1.0, 1.0)
    assert orders and (orders[0][0] == "h3" or orders[0][-1] == "h3")


def test_speeds_from_a_compute_report_and_nominal_fallback():
    doc = {
        "schema": "smoltrain.compute/1",
        "hosts": [
            {
                "name": "a",
                "machine_id": "m1",
                "usable_memory_bytes": 4e9,
                "flops": {"fp32": 1e10},
                "mem_bw_bytes_s": 1e10,
                "train_step": [
                    {"model": "tiny", "batch": 2, "seq": 64, "seconds": 0.03},
                    {"model": "tiny", "batch": 8, "seq": 64, "seconds": 0.09},
                ],
            }
        ],
    }
    sp = host_speeds(doc, ["a", "b"], TINY)
    assert sp["a"].source == "measured" and sp["b"].source == "nominal"
    assert sp["a"].s_per_token == pytest.approx(0.06 / (6 * 64)) and sp["a"].fixed_s == pytest.approx(0.01)
    with pytest.raises(Exception, match="compute"):
        host_speeds({"schema": "other"}, ["a"], TINY)


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
        json.loads(
            json.dumps(place("tp", "even", TINY, ["a", "b", "c", "d"], speeds(a=1, b=1, c=1, d=1), 8, 32).to_dict())
        ),
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

    pl = place("tp", "even", TINY, ["a", "b", "c", "d"], speeds(a=1, b=1, c=1, d=1), 8, 32).to_dict()
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


def test_demo_section_pictures_who_got_what(tmp_path):
    from smoltrain.commands.demo_placement import markdown, picture, work_of

    even = {"order": ["a", "b", "c"], "layers": [[0, 2], [2, 4], [4, 6]]}
    auto = {"order": ["c", "a", "b"], "layers": [[0, 4], [4, 5], [5, 6]], "why": ["c: layers 0..3"]}
    assert work_of(auto)[0] == ("c", 4 / 6, "layers 0..3")
    rows = [
        {
            "strategy": "pp",
            "even": {"tokens_per_s": 800.0, "placement": even},
            "auto": {"tokens_per_s": 1300.0, "placement": auto},
            "plan": {"speedup": 1.5, "predicted": {"even": {"tokens_per_s": 900.0}, "auto": {"tokens_per_s": 1350.0}}},
        }
    ]
    assert picture(rows, tmp_path / "p.png") and (tmp_path / "p.png").stat().st_size > 1000
    text = "\n".join(markdown(rows, "p.png"))
    assert "| pp | 900 | 800 | 1,350 | 1,300 | 1.50x | 1.62x |" in text and "](p.png)" in text
