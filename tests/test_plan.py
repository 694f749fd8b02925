"""smoltrain plan: each strategy's bytes against hand arithmetic, textbook ratios, the time
and capacity model, the document's fields, rendering, and one-line errors."""

import json

import pytest

from smolnet.errors import UsageError
from smoltrain.cli import main
from smoltrain.models.spec import get_model
from smoltrain.planner.devices import LINK_CLASSES
from smoltrain.planner.links import from_class
from smoltrain.planner.plan import make_plan, what_if, what_if_sentence
from smoltrain.planner.ranks import resolve_ranks
from smoltrain.planner.request import PlanRequest, build_plan
from smoltrain.schema import check_any

TINY = get_model("tiny")
# tiny: per layer attn 4*96*96 = 36864, mlp 2*96*384 = 73728, norms 4*96 = 384 -> 110976;
# 6 layers 665856; wte 256*96 = 24576, wpe 64*96 = 6144, head 256*96 = 24576, ln_f 192 -> 55488.
P_TINY = 665856 + 55488
assert P_TINY == 721344


def plan(strategy, model=TINY, world=2, **kw):
    """The plan `run` would show: the one resolver, ranks on this machine unless hosts are given."""
    kw.setdefault("calibration", False)
    kw.setdefault("placement", "even")
    return build_plan(PlanRequest(strategy, model, world=world, local=kw.get("hosts") is None, **kw))


def links(doc):
    return {(ln["src"], ln["dst"]): ln["bytes_per_step"] for ln in doc["links"]}


def test_tiny_param_count_matches_the_shape_arithmetic():
    assert TINY.params() == P_TINY


def test_dp_ring_all_reduce_bytes():
    d = plan("dp", world=2)
    # 2(N-1)/N * P * 4 = 1 * 721344 * 4
    assert links(d) == {("rank0", "rank1"): 2885376, ("rank1", "rank0"): 2885376}
    assert d["bytes_per_step"] == 2885376
    assert d["bytes_per_token"] == pytest.approx(2885376 / (8 * 64))  # 5635.5
    d4 = plan("dp", world=4)
    # ring successors only: 2*3/4 * 721344 * 4 = 4328064 on 0->1, 1->2, 2->3, 3->0
    assert links(d4) == {(f"rank{r}", f"rank{(r + 1) % 4}"): 4328064 for r in range(4)}


def test_fsdp_is_one_and_a_half_dp_with_unit_padding():
    assert plan("fsdp", world=2)["bytes_per_step"] == 4328064  # 3 * 1/2 * 721344 * 4
    assert plan("fsdp", world=2)["bytes_per_step"] == 1.5 * plan("dp", world=2)["bytes_per_step"]
    # world 5: each block (110976 = 5*22195 + 1) pads by 4, the head (24768 = 5*4953 + 3) by 2,
    # the embeddings (30720) by 0: 721344 + 6*4 + 2 = 721370 elements.
    d = plan("fsdp", world=5)
    assert d["bytes_per_step"] == round(3 * 4 / 5 * 721370 * 4)  # 6925152
    ratio = d["bytes_per_step"] / plan("dp", world=5)["bytes_per_step"]
    assert ratio == pytest.approx(1.5, rel=1e-4) and ratio > 1.5  # padding is tiny but counted


def test_syncps_star_with_rank0_as_server_and_worker():
    d = plan("syncps", world=3)
    P4 = P_TINY * 4  # 2885376
    assert links(d) == {("rank1", "rank0"): P4, ("rank2", "rank0"): P4, ("rank0", "rank1"): P4, ("rank0", "rank2"): P4}
    assert d["bytes_per_step"] == 2 * P4  # the server sends to both
    assert links(plan("edp", world=3)) == links(d)


def test_mp_and_pp_send_bsh_per_boundary():
    bsh = 8 * 64 * 96 * 4  # 196608
    d = plan("mp", world=2)
    assert links(d) == {("rank0", "rank1"): bsh, ("rank1", "rank0"): bsh}
    p = plan("pp", world=3, microbatches=4)
    assert links(p) == {
        ("rank0", "rank1"): bsh,
        ("rank1", "rank2"): bsh,
        ("rank1", "rank0"): bsh,
        ("rank2", "rank1"): bsh,
    }
    assert p["bytes_per_step"] == 2 * bsh  # the middle stage, both ways
    assert p["bytes_per_token"] == 2 * bsh / (8 * 64)  # 768
    # PP textbook: b*s*h*bytes per boundary per microbatch (microbatch b = 8/4 = 2)
    fwd = next(ph for ph in p["phases"] if ph["what"] == "activations forward")
    assert fwd["rounds"] == 4 and fwd["bytes_per_round"] == 2 * (2 * 64 * 96 * 4)
    assert p["bubble_fraction"] == pytest.approx(2 / (4 + 2))  # (p-1)/(m+p-1)


def test_tied_embeddings_under_pp_add_the_gradient_sync():
    g = get_model("gpt2-124m")
    d = plan("pp", model=g, world=2, batch=4, seq=128)
    bsh = 4 * 128 * 768 * 4
    emb = 50257 * 768 * 4
    assert links(d) == {("rank0", "rank1"): bsh + emb, ("rank1", "rank0"): bsh + emb}
    assert any("tied" in n for n in d["notes"])
    assert links(plan("pp", world=2)) == {
        ("rank0", "rank1"): 8 * 64 * 96 * 4,
        ("rank1", "rank0"): 8 * 64 * 96 * 4,
    }  # tiny is untied


def test_tp_megatron_two_all_reduces_per_layer_each_way():
    d = plan("tp", world=2)
    # 4 all-reduces per layer per step (2 fwd + 2 bwd) x 6 layers x 2(N-1)/N x b*s*h*4
    assert d["bytes_per_step"] == 4 * 6 * 1 * 196608 == 4718592
    d3 = plan("tp", world=3, batch=6)
    assert d3["bytes_per_step"] == round(4 * 6 * (2 * 2 / 3) * (6 * 64 * 96 * 4))


def test_tp_decode_two_all_reduces_per_layer_per_token():
    m = get_model("llama-3.1-8b")

    class H:
        def __init__(self, n):
            self.name, self.device, self.local, self.link_rate_mbit, self.vars = n, "mac-mini-m4", False, None, {}

    d = plan("tp", model=m, world=2, mode="infer", dtype="bf16", seq=1024, link_class="10gbe", hosts=[H("m1"), H("m2")])
    # 2 ARs x 32 layers x 2(N-1)/N x h*2 bytes = 64 * 8192, and rank 0 broadcasts the step's 32-byte header
    assert d["bytes_per_token"] == 64 * 4096 * 2 + 32 == 524320
    # two ranks swap a small hidden state whole (comm.ring, one message each way, not the ring's
    # two rounds): 2 ARs x 32 layers messages per token (+ the header from m1)
    assert all(ln["messages_per_step"] == 2 * 32 + (ln["src"] == "m1") for ln in d["links"])
    # each Mac reads its 4 GB half of the weights per token: memory-bound, not link-bound
    assert d["bottleneck"] == "memory-bandwidth"
    assert all(r["fits"] for r in d["ranks"])


def test_pp_decode_sends_hidden_and_returns_token_id():
    m = get_model("llama-3.1-8b")
    d = plan("pp", model=m, world=4, mode="infer", dtype="bf16", seq=512, link_class="1gbe")
    assert links(d) == {
        ("rank0", "rank1"): 8224,
        ("rank1", "rank2"): 8224,
        ("rank2", "rank3"): 8224,
        ("rank3", "rank0"): 8,
    }  # h*2 bytes and the step's 32-byte header; int64 token id
    assert d["bytes_per_token"] == 8224 and d["batch"] == 1
    # infer/pp.py sends the header and the hidden state as two messages a hop: latency is paid
    # twice on each forward hop, once on the token's way back (7 round trips' halves a token)
    msgs = {(ln["src"], ln["dst"]): ln["messages_per_step"] for ln in d["links"]}
    assert msgs == {("rank0", "rank1"): 2, ("rank1", "rank2"): 2, ("rank2", "rank3"): 2, ("rank3", "rank0"): 1}
    alpha = from_class("1gbe").get("rank0", "rank1").alpha_s
    wire = from_class("1gbe").get("rank0", "rank1").bytes_per_s
    assert d["comm_s_per_step"] == pytest.approx(7 * alpha + (3 * 8224 + 8) / wire)


def test_ep_all_to_all_and_dense_all_reduce():
    m = get_model("mixtral-8x7b")
    d = plan("ep", model=m, world=4, dtype="bf16", batch=4, seq=256)
    per_pair = 4 * 256 / 4 * 2 * 4096 * 2 / 4  # T_local * k * h * a / N = 1048576
    a2a = per_pair * 4 * 32  # 4 all-to-alls per layer, 32 layers
    expert = 32 * 8 * 3 * 4096 * 14336
    dense = m.params() - expert
    ar = 2 * 3 / 4 * dense * 2
    got = links(d)
    assert got[("rank0", "rank2")] == round(a2a)  # not a ring neighbour
    assert got[("rank0", "rank1")] == pytest.approx(a2a + ar, abs=2)
    with pytest.raises(UsageError, match="mixture-of-experts"):
        plan("ep", world=2)


def test_sp_ring_attention_and_gradient_all_reduce():
    d = plan("sp", world=2)
    kv = 2 * 8 * 32 * 96 * 4  # K and V of the local half-sequence: 196608
    rounds = 3 * 1 * 6  # fwd 1 + bwd 2 passes of (N-1) steps, per layer
    assert d["bytes_per_step"] == kv * rounds + P_TINY * 4


def test_infer_replicas_send_nothing():
    d = plan("dp", world=3, mode="infer")
    assert d["links"] == [] and d["bytes_per_token"] == 0
    assert d["tokens_per_s"] > 0


def test_slowest_link_rules_the_ring_and_link_bound_says_where():
    names = ["a", "b", "c"]

    def link(s, d, rate):
        return {
            "src": s,
            "dst": d,
            "status": "ok",
            "throughput_mbit": rate,
            "rtt_us": {"p50": 100.0},
            "warnings": [],
            "error": None,
        }

    rep = {
        "schema": "smolnet.links/1",
        "hosts": [{"name": n} for n in names],
        "links": [link(s, d, 50.0 if (s, d) == ("b", "c") else 900.0) for s in names for d in names if s != d],
    }

    class H:
        def __init__(self, n):
            self.name, self.device, self.local, self.link_rate_mbit, self.vars = n, "pi5", False, None, {}

    hosts = [H(n) for n in names]
    d = plan("fsdp", world=3, hosts=hosts, links=rep)
    assert d["bottleneck"] == "link"
    assert "b -> c" in d["bottleneck_where"]
    slow = {(ln["src"], ln["dst"]): ln for ln in d["links"]}[("b", "c")]
    assert slow["rate_mbit"] == 50.0
    # the whole ring waits for b -> c: 3 collectives x 2 rounds x (alpha + chunk / 50 Mbit/s)
    chunk = sum(-(-u // 3) * 3 for u in [30720] + [110976] * 6 + [24768]) * 4 / 3
    assert d["comm_s_per_step"] == pytest.approx(3 * 2 * (50e-6 * 8 + chunk / (50e6 / 8)), rel=0.01)


class GPU:
    def __init__(self, n):
        self.name, self.device, self.local, self.link_rate_mbit, self.vars = n, "rtx4050-laptop", False, None, {}


def test_latency_bottleneck_for_tp_decode_on_gbe():
    # tiny decode on two GPUs: 2 all-reduces x 6 layers = 12 swaps of the 384-byte hidden state
    # per token (two ranks swap it whole, one message each way), each waiting 100 us (half the
    # 1 GbE RTT), against microseconds of compute
    d = plan("tp", world=2, mode="infer", hosts=[GPU("g1"), GPU("g2")], link_class="1gbe")
    assert d["bottleneck"] == "latency"
    header = 100e-6 + 32 / (941e6 / 8)  # rank 0's step header comes first
    assert d["comm_s_per_step"] == pytest.approx(12 * 100e-6 + 12 * (96 * 4) / (941e6 / 8) + header)
    assert "messages per step" in d["bottleneck_where"]


def test_a_down_link_is_the_bottleneck():
    names = ["a", "b"]
    rep = {
        "schema": "smolnet.links/1",
        "hosts": [{"name": n} for n in names],
        "links": [
            {"src": "a", "dst": "b", "status": "ok", "throughput_mbit": 900.0, "rtt_us": {"p50": 90.0}},
            {"src": "b", "dst": "a", "status": "down", "throughput_mbit": None, "rtt_us": None},
        ],
    }
    d = plan("dp", world=2, hosts=[GPU("a"), GPU("b")], links=rep)
    assert d["bottleneck"] == "link" and "b -> a is down" in d["bottleneck_where"]
    assert d["step_s"] is None
    json.dumps(d, allow_nan=False)  # no infinities in the document


def test_capacity_bottleneck_when_the_model_does_not_fit():
    class H:
        def __init__(self, n):
            self.name, self.device, self.local, self.link_rate_mbit, self.vars = n, "pi5", False, None, {}

    d = plan("dp", model=get_model("llama-3.1-8b"), world=2, hosts=[H("p1"), H("p2")], link_class="1gbe")
    assert d["bottleneck"] == "capacity"
    assert "p1" in d["bottleneck_where"] and not d["ranks"][0]["fits"]
    # weights, gradients and Adam: 8B x (4 + 4 + 8) bytes, far above the Pi 5's 8 GiB
    assert d["ranks"][0]["memory"]["weights"] == get_model("llama-3.1-8b").params() * 4


def test_plan_document_fields_and_rank_names():
    d = plan("pp", world=2, microbatches=2, link_class="1gbe")
    for f in (
        "strategy",
        "mode",
        "model",
        "world_size",
        "dtype",
        "batch",
        "seq",
        "microbatches",
        "bytes_per_token",
        "bytes_per_step",
        "links",
        "compute_s_per_step",
        "comm_s_per_step",
        "step_s",
        "tokens_per_s",
        "bottleneck",
        "bottleneck_where",
    ):
        assert f in d, f
    assert d["schema"] == "smoltrain.plan/1"
    check_any(d)
    for f in ("name", "params", "layers", "hidden"):
        assert f in d["model"]
    for ln in d["links"]:
        assert set(ln) >= {"src", "dst", "bytes_per_step", "seconds_per_step", "rate_mbit"}
        assert ln["rate_mbit"] == LINK_CLASSES["1gbe"].goodput_mbit
    assert {ln["src"] for ln in d["links"]} == {"rank0", "rank1"}
    assert d["bottleneck"] in ("link", "latency", "compute", "memory-bandwidth", "capacity")
    assert d["step_s"] == pytest.approx(d["compute_s_per_step"] + d["comm_s_per_step"])
    assert d["tokens_per_s"] == pytest.approx(8 * 64 / d["step_s"])
    json.dumps(d, allow_nan=False)


def test_what_if_names_the_link_class_tp_needs():
    m = get_model("gpt2-124m")

    class H:  # two GPUs: fast compute, so the links matter
        def __init__(self, n):
            self.name, self.device, self.local, self.link_rate_mbit, self.vars = n, "rtx4050-laptop", False, None, {}

    ranks = resolve_ranks(2, [H("g1"), H("g2")], None)
    kw = dict(dtype="fp32", batch=8, seq=256, microbatches=1, mode="train")
    d = make_plan("tp", m, 2, ranks=ranks, lm=from_class("1gbe"), **kw)
    rows = what_if("tp", m, 2, ranks, **kw)
    assert [r["link_class"] for r in rows][0] == "1gbe"
    assert d["bottleneck"] in ("link", "latency")
    s = what_if_sentence(d, rows)
    first_ok = next(r for r in rows if r["bottleneck"] not in ("link", "latency"))
    assert f"tp needs {first_ok['link_class']} here" in s
    # decode in bf16: pp sends h*2 = 1536 bytes per token per boundary
    kw.update(mode="infer", dtype="bf16")
    p = make_plan("pp", m, 2, ranks=ranks, lm=from_class("1gbe"), **kw)
    s = what_if_sentence(p, what_if("pp", m, 2, ranks, **kw))
    assert s.startswith("pp over your 1gbe links sends 1.57 KB per token; the link is not the bottleneck")


# --- the command line -------------------------------------------------------------------


def cli(capsys, *argv):
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_summary_what_if_json_and_chart(capsys, tmp_path):
    rc, out, _ = cli(
        capsys,
        "--strategy",
        "pp",
        "--world",
        "2",
        "--link-class",
        "1gbe",
        "--json",
        str(tmp_path / "p.json"),
        "--chart",
        str(tmp_path / "p.png"),
    )
    assert rc == 0
    assert "bottleneck" in out and "what if the links were" in out and "per token" in out
    d = json.loads((tmp_path / "p.json").read_text())
    assert d["strategy"] == "pp" and d["links"][0]["bytes_per_step"] == 8 * 64 * 96 * 4
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_all_ranks_strategies(capsys, tmp_path):
    rc, out, _ = cli(
        capsys,
        "--strategy",
        "all",
        "--world",
        "2",
        "--link-class",
        "1gbe",
        "--json",
        str(tmp_path / "all.json"),
        "--chart",
        str(tmp_path / "all.png"),
    )
    assert rc == 0 and "best first" in out
    d = json.loads((tmp_path / "all.json").read_text())
    assert d["schema"] == "smoltrain.plans/1"
    check_any(d)
    got = {p["strategy"] for p in d["plans"]}
    assert got == {"dp", "fsdp", "syncps", "edp", "diloco", "mp", "pp", "tp", "sp"}
    assert [s["strategy"] for s in d["skipped"]] == ["ep"]
    tps = {p["strategy"]: p["tokens_per_s"] for p in d["plans"]}
    assert d["ranking"][0] == max(tps, key=tps.get)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--strategy", "dp", "--model", "gpt-9"], "unknown model"),
        (["--strategy", "zz"], "unknown strategy"),
        (["--strategy", "pp", "--world", "7"], "needs at least 7 layers"),
        (["--strategy", "mp", "--world", "12"], "needs at least 12 layers"),
        (["--strategy", "dp", "--link-class", "40gbe"], "unknown link class"),
        (["--model", "tiny"], "--strategy is required"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(capsys, argv, needle):
    rc, out, err = cli(capsys, *argv)
    assert rc == 2
    assert needle in err and len(err.strip().splitlines()) == 1


def _links_report(path, names):
    host = {
        "address": None,
        "iface": None,
        "mtu_configured": 1500,
        "link_rate_mbit": 1000,
        "device": "pi5",
        "status": "ok",
        "error": None,
    }
    link = {
        "status": "ok",
        "throughput_mbit": 941.0,
        "retransmits": 0,
        "rtt_us": {"min": 150.0, "p50": 150.0, "p90": 150.0, "p99": 150.0, "max": 150.0},
        "mtu_effective": 1500,
        "mtu_configured": 1500,
        "ceiling_mbit": 941.5,
        "method": "builtin",
        "warnings": [],
        "error": None,
    }
    path.write_text(
        json.dumps(
            {
                "schema": "smolnet.links/1",
                "created": "2026-12-02T10:00:00Z",
                "settings": {"duration_s": 1.0, "backend": "builtin"},
                "hosts": [dict(host, name=n) for n in names],
                "links": [dict(link, src=s, dst=d) for s in names for d in names if s != d],
            }
        )
    )


def test_cli_links_report_lacking_inventory_hosts(capsys, tmp_path):
    inv = tmp_path / "inv.yml"
    inv.write_text(
        "all:\n  children:\n    cluster:\n      hosts:\n"
        "        n1: {ansible_connection: local, cluster_ip: 127.0.0.11, device: pi5}\n"
        "        n2: {ansible_connection: local, cluster_ip: 127.0.0.12, device: pi5}\n"
        "        n3: {ansible_connection: local, cluster_ip: 127.0.0.13, device: pi5}\n"
    )
    rep = tmp_path / "links.json"
    _links_report(rep, ["n1", "n2"])
    rc, _, err = cli(capsys, "--strategy", "dp", "-i", str(inv), "--links", str(rep))
    assert rc == 2 and "lacks hosts n3 of the inventory" in err
    _links_report(rep, ["n1", "n2", "n3"])
    rc, out, _ = cli(
        capsys,
        "--strategy",
        "dp",
        "-i",
        str(inv),
        "--links",
        str(rep),
        "--json",
        str(tmp_path / "p.json"),
        "--no-what-if",
    )
    assert rc == 0
    d = json.loads((tmp_path / "p.json").read_text())
    assert d["world_size"] == 3 and {r["device"] for r in d["ranks"]} == {"pi5"}
    assert {(ln["src"], ln["dst"]) for ln in d["links"]} == {("n1", "n2"), ("n2", "n3"), ("n3", "n1")}


def test_world_defaults_to_links_report_hosts(capsys, tmp_path):
    rep = tmp_path / "links.json"
    _links_report(rep, ["x", "y", "z", "w"])
    rc, _, _ = cli(
        capsys,
        "--strategy",
        "tp",
        "--links",
        str(rep),
        "--json",
        str(tmp_path / "p.json"),
        "--no-what-if",
        "--model",
        "gpt2-124m",
    )
    assert rc == 0
    assert json.loads((tmp_path / "p.json").read_text())["world_size"] == 4


def test_calibrate_writes_a_profile_the_plan_uses(capsys, tmp_path):
    cal = tmp_path / "cal.json"
    assert main(["calibrate", "--out", str(cal), "--seconds", "0.05"]) == 0
    doc = json.loads(cal.read_text())
    from smolnet.cpus import usable_cpus

    # measured at the threads a rank runs here: the CPUs this process may use (contract §9)
    assert doc["schema"] == "smoltrain.calibration/1" and doc["threads"] == usable_cpus()
    check_any(doc)
    assert doc["flops_fp32"] > 0 and doc["mem_bw"] > 0 and 0 < doc["train_efficiency"] <= 1
    rc, _, _ = cli(
        capsys,
        "--strategy",
        "dp",
        "--world",
        "2",
        "--calibration",
        str(cal),
        "--no-what-if",
        "--json",
        str(tmp_path / "p.json"),
        "--link-class",
        "1gbe",
    )
    assert rc == 0
    d = json.loads((tmp_path / "p.json").read_text())
    # generic ranks now compute at the calibrated rate: matmul peak x the measured training fraction
    flops = d["ranks"][0]["flops_per_step"]
    rate = doc["flops_fp32"] * doc["train_efficiency"]
    assert d["compute_s_per_step"] == pytest.approx(
        max(flops / rate, d["ranks"][0]["memory_traffic_bytes"] / doc["mem_bw"]), rel=1e-6
    )
    (tmp_path / "bad.json").write_text("{}")
    rc, _, err = cli(capsys, "--strategy", "dp", "--calibration", str(tmp_path / "bad.json"))
    assert rc == 2 and "calibration" in err


def test_gpipe_schedule_and_bucket_overlap_arithmetic():
    from smoltrain.planner.timing import exposed_overlap, pipeline

    # 2 stages of 0.3 s per step, 2 microbatches, 10 ms hops: forward 0.05 s and backward
    # 0.1 s per stage per microbatch. Forward: 0.05 + 0.01 + 0.05, then one more slot of 0.05;
    # backward: 0.1 + 0.01 + 0.1, then one more slot of 0.1.
    comp, comm = pipeline([0.3, 0.3], [0.01], [0.01], 2, True)
    assert comp == pytest.approx(0.45) and comm == pytest.approx(0.02)
    # buckets: 0.3 s of all-reduce, the last bucket 0.1 s, 0.15 s of backward to hide behind
    assert exposed_overlap(0.3, 0.1, 0.15) == pytest.approx(0.1 + 0.05)
    assert exposed_overlap(0.3, 0.1, 1.0) == pytest.approx(0.1)  # only the last is exposed


def test_star_server_nic_carries_every_worker():
    d = plan("syncps", world=3, link_class="1gbe", batch=9)  # 3 sequences each: no worker ends early
    # pushes: 2 workers x P*4 bytes into rank 0's one NIC, then the pulls out of it
    nic = 941e6 / 8
    assert d["comm_s_per_step"] == pytest.approx(2 * (2 * P_TINY * 4 / nic + 100e-6))
    assert "rank0's" in d["bottleneck_where"]


def test_find_report_takes_only_a_report_covering_the_hosts(tmp_path):
    from smoltrain.planner.links import find_report

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    _links_report(a, ["n1", "n2"])
    _links_report(b, ["n1", "n2", "n3"])
    assert find_report(["n1", "n2", "n3"], [str(a), str(b)])["_path"] == str(b)
    assert find_report(["n1", "n4"], [str(a), str(b), str(tmp_path / "missing.json")]) is None
