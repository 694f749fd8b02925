"""One cost core: the time a link takes for a message is computed in one place
(`Link.seconds`), and every plan that times a transfer goes through it."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

from smoltrain.planner.links import Link

ROOT = Path(__file__).resolve().parents[1] / "smoltrain"
HOME = ROOT / "planner" / "links.py"  # the one module allowed to write the formula


def _attr(node, name: str) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == name


def link_time_sites(source: str) -> list[int]:
    """Lines that compute link time by hand: bytes divided by a link's `.bytes_per_s`, or a
    link's `.alpha_s` added to something (latency plus transfer)."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.BinOp):
            continue
        by_goodput = isinstance(node.op, ast.Div) and _attr(node.right, "bytes_per_s")
        plus_latency = isinstance(node.op, ast.Add) and any(
            _attr(side, "alpha_s")
            or (isinstance(side, ast.BinOp) and (_attr(side.left, "alpha_s") or _attr(side.right, "alpha_s")))
            for side in (node.left, node.right)
        )
        if by_goodput or plus_latency:
            hits.append(node.lineno)
    return hits


def test_the_detector_sees_each_hand_written_form():
    assert link_time_sites("t = ln.alpha_s + n / ln.bytes_per_s")
    assert link_time_sites("t = m * ln.alpha_s + n / ln.bytes_per_s if ln.up else inf")
    assert link_time_sites("t = n / wire.bytes_per_s")
    assert not link_time_sites("t = ln.seconds(n, m)\na = m * ln.alpha_s")


def test_no_module_but_links_computes_link_time():
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        if path == HOME:
            continue
        lines = link_time_sites(path.read_text())
        if lines:
            found[str(path.relative_to(ROOT.parent))] = lines
    assert not found, f"link time computed outside planner/links.py (use Link.seconds): {found}"
    assert link_time_sites(HOME.read_text()), "the formula's home no longer holds it"


def test_link_seconds_is_latency_per_message_plus_bytes_over_goodput():
    ln = Link(800.0, 300.0)  # 100 MB/s, 150 us one way
    assert ln.seconds(1e6) == pytest.approx(150e-6 + 0.01)
    assert ln.seconds(1e6, 3) == pytest.approx(3 * 150e-6 + 0.01)
    assert ln.seconds(0, 0) == 0.0
    assert math.isinf(Link(None, 300.0).seconds(1))
    assert math.isinf(Link(800.0, 300.0, "down").seconds(1))


def _tp_group():
    """Three unlike hosts whose CPUs cost their messages, on links slow one way round the ring."""
    from smoltrain.models.spec import get_model
    from smoltrain.planner.devices import get_device
    from smoltrain.planner.links import LinkModel
    from smoltrain.planner.ranks import Rank

    names = ["mini", "jet", "lap"]
    devs = ["mac-mini-m4", "jetson-orin-nano", "rtx4050-laptop"]
    cpu = {"message_s": 3e-4, "bytes_s": 200e6}
    ranks = [Rank(n, get_device(d), get_device(d).memory_bytes, comm_cpu=cpu) for n, d in zip(names, devs)]
    slow = {("mini", "jet"), ("jet", "lap"), ("lap", "mini")}  # the given order's ring is the slow way
    links = {(a, b): Link(100.0 if (a, b) in slow else 900.0, 400.0) for a in names for b in names if a != b}
    return get_model("gpt2-124m"), ranks, LinkModel({"kind": "test"}, links)


def _infer_plan(strategy: str, m, ranks, lm, cut: dict, **widths) -> dict:
    """plan --mode infer of one fp32 sequence at 256 positions over the cut's hosts in its order."""
    from smoltrain.planner.plan import make_plan

    by = {rk.name: rk for rk in ranks}
    order = [by[n] for n in cut["order"]]
    return make_plan(
        strategy, m, 3, "fp32", 1, 256, mode="infer", ranks=order, lm=lm, single=False, placement=cut, **widths
    )


def test_a_serve_tp_group_is_the_infer_plan_of_that_group():
    """plan --mode serve's tp group and plan --mode infer over the same hosts: the same ring
    order, the same KV cache per rank (a head share's, times the rows), the same messages
    timed on the same CPU-adjusted links at the same wire width, so the same step."""
    from smoltrain.planner import serve
    from smoltrain.planner.compute import cpu_links
    from smoltrain.planner.placement_plan import Ask, place_dict, search

    m, ranks, lm = _tp_group()
    names = [rk.name for rk in ranks]
    assert cpu_links(lm, ranks).get("mini", "jet").alpha_s > lm.get("mini", "jet").alpha_s  # CPU adds to hops
    for wire in ("int8", None):
        widths = {"wire_dtype": wire} if wire else {}
        cut = place_dict(search(Ask("tp", "auto", m, ranks, lm, "infer", "fp32", 1, 256, widths=widths or None)))
        infer = _infer_plan("tp", m, ranks, lm, cut, **widths)
        assert cut["order"] != names  # the search turned the ring round; serve must follow it
        got = serve.group_step(m, ranks, names, lm, "tp", "fp32", 1, 256, pad=1, placement="auto", wire=wire)
        assert got["order"] == cut["order"]
        assert got["kv_cache_bytes"] == pytest.approx([r["memory"]["kv_cache"] for r in infer["ranks"]])
        assert sum(got["kv_cache_bytes"]) == pytest.approx(2 * m.layers * m.kv_dim * 256 * 4)  # one cache, split
        assert got["step_s"] == pytest.approx(infer["step_s"])
        assert got["step_s"] - max(infer["compute_s_per_rank"]) == pytest.approx(infer["comm_s_per_step"])
        four = serve.group_step(m, ranks, names, lm, "tp", "fp32", 4, 256, pad=1, placement="auto", wire=wire)
        assert four["kv_cache_bytes"] == pytest.approx([4 * r["memory"]["kv_cache"] for r in infer["ranks"]])
    # the int8 wire all-gathers a quarter-width vector: its step differs from the fp32 one
    int8 = serve.group_step(m, ranks, names, lm, "tp", "fp32", 1, 256, pad=1, placement="auto", wire="int8")
    fp32 = serve.group_step(m, ranks, names, lm, "tp", "fp32", 1, 256, pad=1, placement="auto")
    assert int8["step_s"] != pytest.approx(fp32["step_s"])


SIZES = [(2, 1000), (2, (1 << 20) // 4), (2, (1 << 20) // 4 + 1), (3, 999), (4, 1 << 19)]


@pytest.mark.parametrize("world,numel", SIZES)
def test_the_plan_counts_the_transports_all_reduce_rounds_and_bytes(world, numel):
    """The planner's all-reduce makes the rounds the transport's schedule makes (two ranks and a
    small buffer swap it whole in one round) and the same bytes per rank."""
    import torch

    from smoltrain.comm import ring
    from smoltrain.planner.traffic import all_reduce

    flat = torch.zeros(numel)
    planned = all_reduce(world, numel * 4, "grads")
    assert len(planned) == 1
    for r in range(world):
        sends, _ = ring.all_reduce_steps(flat, ring._byte_view(flat), r, world)
        assert planned[0].repeat == len(sends)
        sent = sum(len(v) for _, v, _ in sends)
        assert sum(t.nbytes for t in planned[0].transfers if t.src == r) * planned[0].repeat == pytest.approx(sent)


def test_a_serve_pp_group_of_one_row_is_the_infer_plans_chain():
    """A pp group serving one request is the infer plan's decode chain: the same stages, each
    message paid at both ends, the same wire (cpu_quota.decode_chain for both)."""
    from smoltrain.planner import serve

    m, ranks, lm = _tp_group()
    names = [rk.name for rk in ranks]
    got = serve.group_step(m, ranks, names, lm, "pp", "fp32", 1, 256, pad=1)
    infer = _infer_plan("pp", m, ranks, lm, {"order": got["order"], "layers": got["layers"]})
    assert got["lanes"] == 1 and got["step_s"] == pytest.approx(infer["step_s"])
    # five messages a token (two a hop down the chain, the token id back), each paid at both ends
    assert infer["comm_s_per_step"] > 2 * 5 * 3e-4
