"""Batch-1 decode time (docs/inference.md): per token, pp runs its stages one after another, so
a token costs the sum over stages of each stage's compute (weights read, each layer's cost
beyond its products, and the rank's engine step) plus every hop's messages, each message
paying the link's latency and each end's measured CPU per message; tp's ranks run in
lockstep (the slowest rank, then the all-reduces)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from smoltrain.models.spec import get_model
from smoltrain.planner import capacity, rank_time
from smoltrain.planner import compute as measured
from smoltrain.planner.links import from_class
from smoltrain.planner.plan import make_plan
from smoltrain.planner.ranks import resolve_ranks, share_machine

LAYER_S, ENGINE_S, MESSAGE_S, BYTES_S = 2e-4, 3e-4, 1e-4, 50e6


class H:
    def __init__(self, name):
        self.name, self.device, self.local, self.link_rate_mbit, self.vars = name, "generic", False, None, {}


def host(name: str, machine: str, engine: float | None = ENGINE_S) -> dict:
    return {
        "name": name,
        "status": "ok",
        "error": None,
        "machine_id": machine,
        "cores": 2,
        "cpu_limit_cores": None,
        "flops": {"fp32": 10e9},
        "mem_bw_bytes_s": 5e9,
        "usable_memory_bytes": 4e9,
        "decode_layer_s": {"fp32": {"1": LAYER_S}},
        "decode_engine_s": engine,
        "comm_cpu": {"message_s": MESSAGE_S, "bytes_s": BYTES_S},
        "train_step": [],
    }


def ranks_of(tmp_path, engine: float | None = ENGINE_S) -> list:
    p = tmp_path / "compute.json"
    hosts = [host("a", "m1", engine), host("b", "m2", engine)]
    p.write_text(json.dumps({"schema": "smoltrain.compute/1", "created": "x", "hosts": hosts}))
    hs = [H("a"), H("b")]
    ranks, source = measured.apply(resolve_ranks(2, hs), hs, str(p), get_model("tiny"))
    assert source == "measured"
    return ranks


def reads(rk, strategy: str, r: int) -> float:
    """A rank's decode step with no fixed cost: its weights and KV cache read, or its FLOPs."""
    model = get_model("tiny")
    w = capacity.layout(strategy, "infer", model, 2, 1, 64)[r]
    sh = rank_time.Shape(strategy, "infer", model, "fp32", 1, 64)
    return rank_time.decode(replace(rk, measured=False), w, sh)[0].compute_s


def test_pp_decode_is_the_sum_of_stages_engines_and_hops(tmp_path):
    """tiny over two stages, 3 layers each: each stage pays its reads, 3 x the layer cost and one
    engine step; the hop carries the hidden state (96 fp32) and the step's 32-byte header as
    two messages, and the sampled token (8 bytes) comes back as one; a message costs the
    wire's one-way latency plus each end's CPU per message, in turn (the receiver slept), and
    a byte the wire's time plus half a ring step's CPU at each end. A token is the sum of all
    of it: nothing overlaps with one sequence."""
    ranks = ranks_of(tmp_path)
    assert [rk.device.decode_engine_s for rk in ranks] == [ENGINE_S, ENGINE_S]
    wire = from_class("1gbe").default
    moved = 96 * 4 + 32 + 8
    hops = wire.seconds(96 * 4 + 32, 2) + wire.seconds(8, 1) + 2 * (3 * MESSAGE_S + moved / BYTES_S / 2)
    stages = [reads(rk, "pp", r) + 3 * LAYER_S + ENGINE_S for r, rk in enumerate(ranks)]
    doc = make_plan("pp", get_model("tiny"), 2, mode="infer", seq=64, ranks=ranks, lm=from_class("1gbe"))
    assert doc["compute_s_per_rank"] == pytest.approx(stages, rel=1e-9)
    assert doc["comm_s_per_step"] == pytest.approx(hops, rel=1e-9)
    assert doc["step_s"] == pytest.approx(sum(stages) + hops, rel=1e-9)
    assert doc["tokens_per_s"] == pytest.approx(1 / (sum(stages) + hops), rel=1e-9)
    # a report without the engine's figure plans each stage that much faster: both stages, in series
    bare = make_plan("pp", get_model("tiny"), 2, mode="infer", seq=64, ranks=ranks_of(tmp_path, None))
    assert doc["step_s"] - bare["step_s"] == pytest.approx(2 * ENGINE_S, rel=1e-6)


def test_tp_decode_pays_one_engine_step_per_token(tmp_path):
    """tp's two ranks each run every layer (half its heads) and their engine step at once:
    the engine adds its seconds once to a token, not once per rank."""
    with_engine = make_plan("tp", get_model("tiny"), 2, mode="infer", seq=64, ranks=ranks_of(tmp_path))
    bare = make_plan("tp", get_model("tiny"), 2, mode="infer", seq=64, ranks=ranks_of(tmp_path, None))
    assert with_engine["comm_s_per_step"] == pytest.approx(bare["comm_s_per_step"])
    assert with_engine["step_s"] - bare["step_s"] == pytest.approx(ENGINE_S, rel=1e-6)


def test_a_rank_with_half_a_machine_takes_twice_the_engine_step(tmp_path):
    (rk,) = ranks_of(tmp_path)[:1]
    (half,) = share_machine([replace(rk, shared=False)], busy=2, cores=1)
    assert half.device.decode_engine_s == pytest.approx(2 * ENGINE_S)


def test_the_engine_probe_times_a_real_engine_step():
    """The probe runs the one-process engine's decode step on a layer-less stage (it raises
    if the engine's interfaces move under it) and reports seconds per step."""
    import torch

    from smoltrain.calibration import engine_probe

    s = engine_probe.engine_step_s(torch, 1.0)
    assert 0 < s < 1


def test_repeated_probes_keep_the_median_engine_step():
    from smoltrain.calibration.cluster import median_probe

    docs = [
        {"flops": {"fp32": 1.0}, "mem_bw_bytes_s": 1.0, "usable_memory_bytes": 1, "decode_engine_s": x}
        for x in (4e-4, 1e-4, 2e-4)
    ]
    assert median_probe(docs)["decode_engine_s"] == 2e-4


def test_the_decode_token_is_judged_term_by_term():
    """generate's vs_plan: a rate on plan can hide a stage twice as slow beside hops twice as
    fast. A pp chain's stages add up, tp's lockstep waits for its slowest; the rest of the token
    is messages and hops, each judged as plan --compare judges a training rank's terms."""
    from smoltrain.infer.report import vs_plan, vs_plan_line

    plan = {"step_s": 0.004, "ranks": [{"name": "a", "compute_s": 0.001}, {"name": "b", "compute_s": 0.001}]}
    per = {"a": {"work_wall_ms": 2.0}, "b": {"work_wall_ms": 1.0}}
    decode = {"tokens_per_s": 250.0, "per_rank": per}  # 4 ms a token, as planned
    pp = vs_plan(plan, decode, "pp")
    assert [(r["name"], round(r["ratio"], 2), r["verdict"]) for r in pp["ranks"]] == [
        ("a", 2.0, "outside"),
        ("b", 1.0, "within"),
    ]
    assert pp["rest"]["planned_s"] == pytest.approx(0.002) and pp["rest"]["measured_s"] == pytest.approx(0.001)
    assert pp["outside"] == ["stage on a x2.00", "messages and hops x0.50"]
    tp = vs_plan(plan, decode, "tp")  # the slowest stage: 3 ms planned and 2 ms measured for the rest
    assert tp["rest"]["planned_s"] == pytest.approx(0.003) and tp["rest"]["measured_s"] == pytest.approx(0.002)
    # the plan's own communication where it gives one (a quota chain's stages burst faster than at pace)
    assert vs_plan({**plan, "comm_s_per_step": 0.0015}, decode, "pp")["rest"]["planned_s"] == 0.0015
    assert "stage a 2.00 ms (plan 1.00, x2.00)" in vs_plan_line(pp)
    # nothing to judge: no plan, no timed plan, a rank the plan does not name, a mesh
    assert vs_plan(None, decode, "pp") is None
    assert vs_plan({**plan, "step_s": None}, decode, "pp") is None
    assert vs_plan(plan, {**decode, "per_rank": {"a": per["a"]}}, "pp") is None
    assert vs_plan(plan, decode, "pp", mesh="pp=2,tp=2") is None
