"""The plan on measured compute: the report's hosts, shared machines, the single-host verdict."""

from __future__ import annotations

import json

import pytest

from smolnet.errors import UsageError
from smoltrain.models.spec import get_model
from smoltrain.planner import compute as measured
from smoltrain.planner import cpu_quota
from smoltrain.planner.links import from_class
from smoltrain.planner.plan import make_plan
from smoltrain.planner.ranks import resolve_ranks


class H:
    def __init__(self, name, device="generic"):
        self.name, self.device, self.local, self.link_rate_mbit, self.vars = name, device, False, None, {}


def _host(name, fixed, per_token, machine="m1", cap=None, cores=2, flops=10e9):
    return {
        "name": name,
        "status": "ok",
        "error": None,
        "machine_id": machine,
        "cores": cores,
        "cpu_limit_cores": cap,
        "flops": {"fp32": flops, "bf16": 2 * flops},
        "mem_bw_bytes_s": 5e9,
        "usable_memory_bytes": 4e9,
        "train_step": [{"model": "tiny", "batch": b, "seq": 64, "seconds": fixed + per_token * b * 64} for b in (2, 8)],
    }


def _report(tmp_path, hosts):
    p = tmp_path / "compute.json"
    p.write_text(json.dumps({"schema": "smoltrain.compute/1", "created": "x", "hosts": hosts}))
    return str(p)


def test_report_of_another_inventory_names_the_missing_hosts(tmp_path):
    p = _report(tmp_path, [_host("a", 0.01, 1e-4)])
    with pytest.raises(UsageError, match=r"no b, c .*measured: a"):
        measured.load_compute(p, ["a", "b", "c"])
    bad = _report(tmp_path, [_host("a", 0.01, 1e-4), {"name": "b", "status": "failed", "error": "ssh refused"}])
    with pytest.raises(UsageError, match="failed on b .*ssh refused"):
        measured.load_compute(bad, ["a", "b"])
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(UsageError, match="not a smoltrain.compute/1"):
        measured.load_compute(str(tmp_path / "x.json"), ["a"])


def test_fit_recovers_fixed_and_per_token_cost(tmp_path):
    f = measured.load_compute(_report(tmp_path, [_host("a", 0.02, 3e-5)]))["a"]
    fixed, per, seq = f.fit(get_model("tiny"))
    assert fixed == pytest.approx(0.02) and per == pytest.approx(3e-5) and seq == 64


def test_another_models_fixed_cost_scales_by_layers_and_its_adamw_update_by_parameters(tmp_path):
    """Hand-computed: calibrated on tiny (6 layers, 721,344 parameters), planning tiny8 (8, 943,296):
    of a 20 ms fixed cost, the 5 ms AdamW update grows with the parameters and the rest with the
    layers (the update scaled by layers read a 135M Llama's step 2x long: bench_finetune_home)."""
    h = _host("a", 0.02, 3e-5)
    for s in h["train_step"]:
        s["optimizer_seconds"] = 0.005
    f = measured.load_compute(_report(tmp_path, [h]))["a"]
    tiny, tiny8 = get_model("tiny"), get_model("tiny8")
    fixed, _, _ = f.fit(tiny8)
    assert fixed == pytest.approx(0.015 * 8 / 6 + 0.005 * 943_296 / 721_344)
    assert f.optimizer_s(tiny8) == pytest.approx(0.005 * 943_296 / 721_344)
    assert (tiny.layers, tiny.params(), tiny8.layers, tiny8.params()) == (6, 721_344, 8, 943_296)


def test_measured_plan_charges_each_rank_its_host(tmp_path):
    """dp on 2 hosts, one 3x slower per token: each rank's time is its host's fixed cost plus
    its tokens (batch 8 x 64 / 2) at its per-token cost, by hand."""
    tiny = get_model("tiny")
    p = _report(tmp_path, [_host("slow", 0.01, 3e-4), _host("fast", 0.01, 1e-4, machine="m2")])
    ranks = resolve_ranks(2, [H("slow"), H("fast")])
    ranks, src = measured.apply(ranks, [H("slow"), H("fast")], p, tiny)
    assert src == "measured"
    d = make_plan("dp", tiny, 2, batch=8, seq=64, ranks=ranks, lm=from_class("10gbe"))
    assert d["compute_source"] == "measured"
    assert d["compute_s_per_rank"] == pytest.approx([0.01 + 256 * 3e-4, 0.01 + 256 * 1e-4], rel=1e-6)
    assert d["compute_s_per_step"] == pytest.approx(0.01 + 256 * 3e-4, rel=1e-6)
    one = d["single_host"]
    assert one["name"] == "fast" and one["fits"]
    assert one["step_s"] == pytest.approx(0.01 + 512 * 1e-4, rel=1e-6)
    assert "slower than fast alone" in d["verdict"] and "compute" in d["verdict"]


def test_nominal_without_a_report(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ranks, src = measured.apply(resolve_ranks(2, [H("a"), H("b")]), [H("a"), H("b")], None, get_model("tiny"))
    assert src == "nominal"
    d = make_plan("dp", get_model("tiny"), 2, ranks=ranks, lm=from_class("1gbe"))
    assert d["compute_source"] == "nominal" and len(d["compute_s_per_rank"]) == 2


def test_hosts_on_one_machine_share_its_cores():
    f = lambda n, m, cap, cores: measured.HostCompute(n, m, cores, cap, {"fp32": 1e9}, 1e9, 1e9)  # noqa: E731
    # four uncapped one-thread ranks on a 2-core machine: half a core each
    assert measured.shared_factors([f(str(i), "m", None, 2) for i in range(4)]) == [0.5] * 4
    # capped hosts whose caps fit the machine keep their measured speed
    assert measured.shared_factors([f("a", "m", 0.15, 2), f("b", "m", 0.65, 2)]) == [1.0, 1.0]
    # separate machines never share
    assert measured.shared_factors([f("a", "m1", None, 1), f("b", "m2", None, 1)]) == [1.0, 1.0]


def test_verdict_when_nothing_fits_alone():
    from smoltrain.planner.verdict import sentence

    s = sentence(
        {
            "strategy": "fsdp",
            "world_size": 4,
            "tokens_per_s": 10.0,
            "bottleneck": "link",
            "bottleneck_detail": {"kind": "link", "cause": "nic", "limiter": "a's uplink", "compute_s": 1, "comm_s": 2},
            "single_host": {"name": "mac", "fits": False, "step_s": None, "tokens_per_s": 0.0},
        }
    )
    assert "does not fit on any single host" in s and "link bandwidth" in s


def test_busy_host_cpu_slows_its_messages_and_bytes():
    from smoltrain.planner.compute import cpu_links
    from smoltrain.planner.devices import get_device
    from smoltrain.planner.ranks import Rank

    lm = from_class("1gbe")  # 941 Mbit/s, RTT 200 us: alpha 100 us
    ranks = [
        Rank("a", get_device("generic"), 1e9, comm_cpu={"message_s": 2e-3, "bytes_s": 50e6}),
        Rank("b", get_device("generic"), 1e9, comm_cpu={"message_s": 1e-4, "bytes_s": 500e6}),
    ]
    ln = cpu_links(lm, ranks).get("b", "a")
    assert ln.alpha_s == pytest.approx(100e-6 + 2e-3)  # the slower end's message cost
    assert ln.bytes_per_s == pytest.approx(50e6)  # a's CPU moves 50 MB/s < the wire's 117.6
    assert cpu_links(lm, [Rank("a", get_device("generic"), 1e9)]) is lm  # nothing measured: unchanged


def test_a_quota_held_host_pays_its_cpu_and_the_wire_in_turn():
    """A host under a CPU quota drains nothing while it waits for its next period, so its
    CPU time and the wire's add up: 1 / (1/117.6 + 1/150) MB/s, not min(117.6, 150)."""
    from smoltrain.planner.compute import cpu_links
    from smoltrain.planner.devices import get_device
    from smoltrain.planner.ranks import Rank

    lm = from_class("1gbe")  # 941 Mbit/s: 117.6 MB/s
    wire = 941e6 / 8
    capped = {"message_s": 1e-3, "bytes_s": 150e6, "quota": True}
    free = {"message_s": 1e-4, "bytes_s": 900e6, "quota": False}
    ranks = [
        Rank("pi", get_device("generic"), 1e9, comm_cpu=capped),
        Rank("pc", get_device("generic"), 1e9, comm_cpu=free),
    ]
    links = cpu_links(lm, ranks)
    for ln in (links.get("pi", "pc"), links.get("pc", "pi")):
        assert ln.bytes_per_s == pytest.approx(1 / (1 / wire + 1 / 150e6))  # 65.9 MB/s
    unquoted = cpu_links(lm, [Rank("pi", get_device("generic"), 1e9, comm_cpu=dict(capped, quota=False)), ranks[1]])
    assert unquoted.get("pi", "pc").bytes_per_s == pytest.approx(wire)  # a free CPU overlaps the wire


def test_default_report_of_other_hosts_falls_back_to_profiles(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "compute.json").write_text(
        json.dumps({"schema": "smoltrain.compute/1", "created": "x", "hosts": [_host("elsewhere", 0.01, 1e-4)]})
    )
    ranks = resolve_ranks(2, [H("a"), H("b")])
    assert measured.apply(ranks, [H("a"), H("b")], None, get_model("tiny"))[1] == "nominal"
    with pytest.raises(UsageError, match="no a, b"):
        measured.apply(ranks, [H("a"), H("b")], "reports/compute.json", get_model("tiny"))


def test_dp_buckets_overlap_backward_only_with_a_core_to_spare(tmp_path):
    """A capped host sends on the core it computes on: its all-reduce cannot hide behind
    backward. An 8-core host keeps a core for the bucket thread, so part of it does."""
    model = get_model("tiny")

    def plan(cap, cores):
        hosts = [_host(n, 0.01, 1e-4, machine=n, cap=cap, cores=cores) for n in ("a", "b")]
        ranks, _ = measured.apply(resolve_ranks(2, [H("a"), H("b")]), [H("a"), H("b")], _report(tmp_path, hosts), model)
        return ranks, make_plan("dp", model, 2, ranks=ranks, lm=from_class("1gbe"), single=False)

    capped_ranks, capped = plan(0.5, 2)
    free_ranks, free = plan(None, 8)
    assert not any(r.comm_core for r in capped_ranks) and all(r.comm_core for r in free_ranks)
    assert capped["comm_s_per_step"] == pytest.approx(
        make_plan("dp", model, 2, ranks=capped_ranks, lm=from_class("1gbe"), single=False, overlap=False)[
            "comm_s_per_step"
        ]
    )
    assert free["comm_s_per_step"] < capped["comm_s_per_step"]


def test_the_optimizer_is_paid_once_per_step_not_per_microbatch(tmp_path):
    """The fixed cost holds the AdamW update; a pipeline repeats its passes per microbatch
    but updates once, so the measured optimizer time comes off the repeated part."""
    model = get_model("tiny")

    def plans(opt_s):
        hosts = []
        for n in ("a", "b"):
            h = _host(n, 0.02, 1e-4, machine=n, cores=8)
            for s in h["train_step"]:
                s["optimizer_seconds"] = opt_s
            hosts.append(h)
        path = _report(tmp_path, hosts)
        assert measured.load_compute(path)["a"].optimizer_s(model) == opt_s
        ranks, _ = measured.apply(resolve_ranks(2, [H("a"), H("b")]), [H("a"), H("b")], path, model)
        kw = dict(ranks=ranks, lm=from_class("1gbe"), single=False)
        return make_plan("pp", model, 2, microbatches=4, **kw), make_plan("dp", model, 2, **kw)

    pp0, dp0 = plans(0.0)
    pp1, dp1 = plans(0.015)
    assert all(a < b for a, b in zip(pp1["compute_s_per_rank"], pp0["compute_s_per_rank"]))
    assert dp1["compute_s_per_rank"] == pytest.approx(dp0["compute_s_per_rank"])  # one pass, owns it all


def test_a_chain_on_quota_hosts_is_planned_on_their_periods(tmp_path):
    """mp on two hosts capped at half a core. A stage's compute at the cap's pace is twice its
    CPU at full speed; with 100 ms periods the stages' CPU per period stays under the 50 ms
    quota, so they run at full speed (half the pace's figure; cfs.py); with 0.2 ms periods
    every burst outlasts its quota and the pace holds. dp (lockstep) keeps the pace either
    way, and a report without the period plans mp as before (stages at the pace, in series)."""
    model = get_model("tiny")

    def plans(period):
        hosts = [dict(_host(n, 0.01, 1e-5, machine=n, cap=0.5), cpu_period_s=period) for n in ("a", "b")]
        ranks, _ = measured.apply(resolve_ranks(2, [H("a"), H("b")]), [H("a"), H("b")], _report(tmp_path, hosts), model)
        kw = dict(ranks=ranks, lm=from_class("1gbe"), single=False)
        return [make_plan(s, model, 2, **kw) for s in ("mp", "dp")]

    (mp0, dp0), (mp_long, dp_long), (mp_short, _) = plans(None), plans(100e-3), plans(0.2e-3)
    paced = mp0["compute_s_per_rank"]
    per_period = 100e-3 / (mp0["step_s"] - sum(paced) / 2)  # steps a period at full speed
    assert per_period * max(paced) / 2 < 50e-3  # so each stage's CPU a period fits its quota
    assert mp_long["compute_s_per_rank"] == pytest.approx([t / 2 for t in paced], rel=1e-6)
    assert mp_short["compute_s_per_rank"] == pytest.approx(paced, rel=0.03)
    assert mp_long["step_s"] < mp_short["step_s"] == pytest.approx(mp0["step_s"], rel=0.05)
    assert dp_long["step_s"] == pytest.approx(dp0["step_s"])


def test_a_decode_chain_on_quota_hosts_takes_the_longer_of_its_full_speed_trip_and_the_busiest_pace():
    """pp decode over two hosts, one capped at 0.25 cores: per token the chain's hops carry 2
    messages there (header, hidden states) and 1 back (the token id); each message costs a
    host a whole ring-step `message_s` (it wakes a peer that slept). At its pace the capped
    host's work is its 4 ms stage plus 3 messages x 1 ms = 7 ms; the free host's 1 ms + 3 x
    0.1. A token crosses at full speed in 7 x 0.25 + 1.3 ms plus the wire (3 latencies and
    the bytes), under 7: the capped host's pace sets the step. The uncapped sum would be
    7 + 1.3 + wire, as a chain without quota hosts takes it."""
    from smoltrain.planner.devices import get_device
    from smoltrain.planner.ranks import Rank
    from smoltrain.planner.traffic import traffic

    tr = traffic("pp", "infer", get_model("tiny"), 2, batch=1)
    assert tr.link_msgs() == {(0, 1): 2, (1, 0): 1}
    lm, names = from_class("1gbe"), ["a", "b"]
    gen = get_device("generic")
    held = Rank("a", gen, 1e9, comm_cpu={"message_s": 1e-3, "bytes_s": 1e12}, cpu_quota=(2.5e-3, 10e-3))
    free = Rank("b", gen, 1e9, comm_cpu={"message_s": 1e-4, "bytes_s": 1e12})
    nbytes = tr.link_bytes()
    moved = sum(nbytes.values())
    ln = lm.get("a", "b")
    wire = 3 * ln.alpha_s + moved / ln.bytes_per_s
    busiest = 4e-3 + 3 * 1e-3 + moved / 1e12 / 2
    assert cpu_quota.decode_chain([4e-3, 1e-3], [held, free], tr, names, lm) == pytest.approx(busiest)
    fast = Rank("a", gen, 1e9, comm_cpu={"message_s": 1e-3, "bytes_s": 1e12}, cpu_quota=(9e-3, 10e-3))
    trip = busiest * 0.9 + 1e-3 + 3 * 1e-4 + moved / 1e12 / 2 + wire  # at 0.9 cores the trip is longer
    assert cpu_quota.decode_chain([4e-3, 1e-3], [fast, free], tr, names, lm) == pytest.approx(trip)
    free_a = Rank("a", gen, 1e9, comm_cpu={"message_s": 1e-3, "bytes_s": 1e12})  # no quota: the sum
    uncapped = busiest + 1e-3 + 3 * 1e-4 + moved / 1e12 / 2 + wire
    assert cpu_quota.decode_chain([4e-3, 1e-3], [free_a, free], tr, names, lm) == pytest.approx(uncapped)
    assert not cpu_quota.held_back([free_a, free]) and cpu_quota.held_back([held, free])
    # a cap the host cannot read, and no cycle seen: held back at pace 4, it bursts all the same
    hidden = Rank("a", gen, 1e9, comm_cpu={"message_s": 1e-3, "bytes_s": 1e12}, pace=4.0)
    assert cpu_quota.decode_chain([4e-3, 1e-3], [hidden, free], tr, names, lm) == pytest.approx(busiest)
    # the infer plan steps so: its parts (stages, hops) in proportion, summing to the chain
    p = make_plan("pp", get_model("tiny"), 2, mode="infer", batch=1, seq=64, ranks=[held, free], lm=lm, single=False)
    chain = cpu_quota.decode_chain(p["compute_s_per_rank"], [held, free], tr, names, lm)
    assert p["step_s"] == pytest.approx(chain) and p["compute_s_per_step"] < sum(p["compute_s_per_rank"])


def test_a_training_chain_on_quota_hosts_pays_each_stages_wake_and_a_decode_chain_does_not(tmp_path):
    """calibrate's burst_wake_s reaches the rank (over its share of a machine, as the engine
    step); on quota hosts a pp training step lays each stage's bursts on its periods (cfs) and a
    burst that follows a wait pays the wake, so the step is longer with it. A decode chain is
    planned without it: charged once a token a stage, it took pp decode within 25% on 5 of 9 fresh
    drawn clusters where without it 8 of 9 (seed 1365777908, BENCHMARKS.md)."""
    from dataclasses import replace

    from smoltrain.planner.devices import get_device
    from smoltrain.planner.ranks import Rank
    from smoltrain.schema import check_any

    tiny = get_model("tiny")
    woke = [dict(_host(n, 0.02, 1e-9), burst_wake_s=w) for n, w in (("a", 4e-4), ("b", 6e-4))]
    check_any({"schema": "smoltrain.compute/1", "created": "x", "hosts": woke})
    ranks, _ = measured.apply(resolve_ranks(2, [H("a"), H("b")]), [H("a"), H("b")], _report(tmp_path, woke), tiny)
    assert [rk.device.burst_wake_s for rk in ranks] == pytest.approx([4e-4, 6e-4])
    lm, gen = from_class("1gbe"), get_device("generic")
    cc = {"message_s": 1e-4, "bytes_s": 1e12}

    def step(wake, mode):
        dev = replace(gen, burst_wake_s=wake)
        rks = [Rank(n, dev, 1e9, comm_cpu=cc, cpu_quota=(2.5e-3, 10e-3), pace=4.0) for n in ("a", "b")]
        kw = dict(batch=8, seq=64, microbatches=4) if mode == "train" else dict(batch=1, seq=64)
        return make_plan("pp", tiny, 2, mode=mode, ranks=rks, lm=lm, single=False, **kw)["step_s"]

    assert step(2e-3, "train") > step(None, "train")
    assert step(2e-3, "infer") == pytest.approx(step(None, "infer"))


def test_measured_decode_rate_times_the_weight_reads(tmp_path):
    """A host whose few-row products read weights at 2 GB/s (1 row), 1 (4 rows) and 0.5 (8
    rows) while a copy moves 5: decode time is the weights at that rate plus the KV cache at
    the copy's, by hand; without the figure (or in a dtype it did not time) all at 5 GB/s."""
    from smoltrain.planner import capacity, serve
    from smoltrain.schema import check_any

    tiny = get_model("tiny")
    # no fixed cost (the timed steps are per token only) and FLOPs far faster than the reads
    timed = _host("a", 0.0, 1e-9)
    (w,) = capacity.layout("pp", "infer", tiny, 1, 1, 64)
    weights, kv = w.matmul_params * 4, 2 * w.layers * tiny.kv_dim * 64 * 4  # fp32 bytes one token reads

    def plan_on(host, **kw):
        ranks, _ = measured.apply(resolve_ranks(1, [H("a")]), [H("a")], _report(tmp_path, [host]), tiny)
        return ranks, make_plan("pp", tiny, 1, mode="infer", seq=64, ranks=ranks, lm=from_class("1gbe"), **kw)

    ranks, old = plan_on(timed)
    assert old["compute_s_per_rank"] == pytest.approx([(weights + kv) / 5e9], rel=1e-6)
    assert old["decode_source"] == "memory bandwidth"
    timed["decode_bw_bytes_s"] = {"fp32": {"1": 2e9, "4": 1e9, "8": 0.5e9}}
    check_any({"schema": "smoltrain.compute/1", "created": "x", "hosts": [timed]})
    ranks, new = plan_on(timed)
    check_any(new)
    assert new["compute_s_per_rank"] == pytest.approx([weights / 2e9 + kv / 5e9], rel=1e-6)
    assert new["decode_source"] == "decode matmul" and new["tokens_per_s"] < old["tokens_per_s"]
    # bf16 was not timed: its weights (2 bytes each) at the copy's rate
    bf = make_plan("pp", tiny, 1, "bf16", mode="infer", seq=64, ranks=ranks, lm=from_class("1gbe"))
    assert bf["compute_s_per_rank"] == pytest.approx([(weights + kv) / 2 / 5e9], rel=1e-6)
    assert bf["decode_source"] == "memory bandwidth"
    # seconds per byte linear in the rows between those timed: 6 rows, halfway from 4 to 8,
    # 1.5 ns a byte; beyond 8 the 4-to-8 slope goes on: 16 rows 2 + 8 * 0.25 = 4 ns
    dev = ranks[0].device
    assert dev.weight_rate("fp32", 6)[0] == pytest.approx(1 / 1.5e-9)
    assert dev.weight_rate("fp32", 16)[0] == pytest.approx(1 / 4e-9)
    assert dev.weight_rate("fp32", 1) == (2e9, "decode matmul")
    # serving 8 at once on this host: one step reads the weights at the 8-row rate and 8 KV caches
    doc = serve.plan(tiny, ranks, from_class("1gbe"), concurrency=8, max_batch=8, seq=64)
    check_any(doc)
    (split,) = doc["candidates"]
    assert split["latency_s_per_token"] == pytest.approx(weights / 0.5e9 + 8 * kv / 5e9, rel=1e-6)
    assert doc["decode_source"] == "decode matmul"


def test_a_timed_decode_step_is_the_per_token_cost_beyond_the_reads(tmp_path):
    """A host whose one-token forward of tiny takes 5 ms, reads at 5 GB/s and computes 10
    GFLOP/s: the per-token cost is 5 ms less the larger of the reads (4 bytes a parameter)
    and the FLOPs (2 a parameter); the first pp stage, 3 of tiny's 6 layers, pays its share
    of it (capacity.fixed_share: 3 of 6 + 1 groups of operations, the head being on the
    other stage), where without the timed forward a third of the training step's fixed cost
    (20 ms, all of it outside the optimizer) is charged."""
    from smoltrain.planner import capacity
    from smoltrain.schema import check_any

    tiny = get_model("tiny")
    host = _host("a", 0.02, 1e-9)
    reads = max(4 * tiny.params() / 5e9, 2 * tiny.params() / 10e9)

    def stage_fixed(h):
        ranks, _ = measured.apply(resolve_ranks(2, [H("a"), H("b")]), [H("a"), H("b")], _report(tmp_path, h), tiny)
        (w, _) = capacity.layout("pp", "infer", tiny, 2, 1, 64)
        share = capacity.fixed_share(w, tiny, "pp")
        assert share == pytest.approx(3 / 7)
        return ranks[0], share

    rk, share = stage_fixed([host, dict(host, name="b")])
    assert rk.decode_fixed_s is None  # no timed forward: the old rule
    old = rank_time_decode(rk, tiny)
    assert old == pytest.approx(base_decode(rk, tiny) + 0.02 * share / 3, rel=1e-6)
    timed = dict(host, decode_step=[{"model": "tiny", "seconds": 5e-3}])
    check_any({"schema": "smoltrain.compute/1", "created": "x", "hosts": [timed]})
    rk, share = stage_fixed([timed, dict(timed, name="b")])
    assert rk.decode_fixed_s == pytest.approx(5e-3 - reads)
    assert rank_time_decode(rk, tiny) == pytest.approx(base_decode(rk, tiny) + (5e-3 - reads) * share, rel=1e-6)
    # a timed inference block (decode_layer_s) replaces that: each layer's cost beyond its
    # products at the step's rows, linear between the rows timed (6 rows: halfway from 4 to
    # 8, 0.6 ms), the stage's 3 layers each; serve's padded rows (2 -> 4) pay the 4-row cost
    layered = dict(timed, decode_layer_s={"fp32": {"1": 2e-4, "4": 4e-4, "8": 8e-4}})
    check_any({"schema": "smoltrain.compute/1", "created": "x", "hosts": [layered]})
    rk, _ = stage_fixed([layered, dict(layered, name="b")])
    assert rk.device.layer_overhead("fp32", 6) == pytest.approx(6e-4)
    assert rk.device.layer_overhead("bf16", 1) == pytest.approx(2e-4)  # untimed dtype: fp32's
    assert rank_time_decode(rk, tiny) == pytest.approx(base_decode(rk, tiny) + 3 * 2e-4, rel=1e-6)
    assert rank_time_decode(rk, tiny, rows=2, pad=4) == pytest.approx(base_decode(rk, tiny, 2, 4) + 3 * 4e-4, rel=1e-6)
    # a rank with half the machine (two ranks on it) takes each layer twice as long
    from dataclasses import replace

    from smoltrain.planner.ranks import share_machine

    (half,) = share_machine([replace(rk, shared=False)], busy=2, cores=1)
    assert half.device.layer_overhead("fp32", 1) == pytest.approx(4e-4)


def rank_time_decode(rk, model, rows: int = 1, pad: int = 1) -> float:
    from smoltrain.planner import capacity, rank_time

    (w, _) = capacity.layout("pp", "infer", model, 2, 1, 64)
    sh = rank_time.Shape("pp", "infer", model, "fp32", 1, 64)
    return rank_time.decode(rk, w, sh, rows, pad)[0].compute_s


def base_decode(rk, model, rows: int = 1, pad: int = 1) -> float:
    """The same step on the same rank without any fixed cost."""
    from dataclasses import replace

    return rank_time_decode(replace(rk, measured=False), model, rows, pad)
