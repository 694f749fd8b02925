"""One plan builder (issue 36): only planner/plan.py assembles a smoltrain.plan/1 document;
diloco's outer step is an amortised phase of that builder, with the very figures the overlay it
replaced gave; the bottleneck is a record whose words are the prose plans have always shown.

The expected figures and sentences below were recorded from the code before the refactor
(commit 09146ae), on the fixed synthetic cluster `_cluster` builds."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from smoltrain.models.spec import get_model
from smoltrain.planner import compute as measured
from smoltrain.planner import plan as builder
from smoltrain.planner.bottleneck import Bottleneck, head, words
from smoltrain.planner.links import Link, LinkModel
from smoltrain.planner.phases import Amortised
from smoltrain.planner.plan import make_plan
from smoltrain.planner.ranks import resolve_ranks

ROOT = Path(__file__).resolve().parents[1]
HOME = ROOT / "smoltrain" / "planner" / "plan.py"  # the one module allowed to assemble a plan
# fields only a smoltrain.plan/1 document has (the mesh plan and serve plan have their own documents;
# bottleneck_detail is not one: a mesh plan's layouts carry theirs, planner.mesh_plan.entry)
PLAN_FIELDS = {
    "smoltrain.plan/1",
    "comm_s_per_step",
    "compute_s_per_step",
    "compute_s_per_rank",
    "total_bytes_per_step",
    "bytes_per_outer_step",
    "inner_steps_source",
    "bubble_fraction",
}


def _copied(key: str, value) -> bool:
    """`"k": plan["k"]`: a figure read from a finished plan, not made."""
    return isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Constant) and value.slice.value == key


def assembly_sites(source: str) -> list[int]:
    """Lines that write a plan field: a dict literal naming one (or the schema), a
    `doc["field"] = ...`, or an `.update(field=...)`."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        keys = []
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and not _copied(k.value, v):
                    keys.append(k.value)
                if isinstance(v, ast.Constant):
                    keys.append(v.value)
        elif isinstance(node, ast.Assign):
            keys = [
                t.slice.value
                for t in node.targets
                if isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant)
            ]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update":
            keys = [k.arg for k in node.keywords]
        if any(isinstance(k, str) and k in PLAN_FIELDS for k in keys):
            hits.append(node.lineno)
    return hits


def test_the_detector_sees_each_way_of_assembling_a_plan():
    assert assembly_sites('doc = {"schema": "smoltrain.plan/1"}')
    assert assembly_sites('doc["comm_s_per_step"] = x')
    assert assembly_sites("doc.update(inner_steps_source='given')")
    assert assembly_sites('row = {"links": [], "compute_s_per_step": c}')
    assert not assembly_sites('shown = {"compute_s_per_rank": plan["compute_s_per_rank"]}')
    assert not assembly_sites('x = plan["comm_s_per_step"]')


def test_no_module_but_the_builder_assembles_a_plan():
    found = {}
    for path in sorted([*(ROOT / "smoltrain").rglob("*.py"), *(ROOT / "bench").rglob("*.py")]):
        if path == HOME:
            continue
        lines = assembly_sites(path.read_text())
        if lines:
            found[str(path.relative_to(ROOT))] = lines
    assert not found, f"plan fields written outside planner/plan.py (add a phase to the builder): {found}"
    assert assembly_sites(HOME.read_text()), "the builder no longer assembles the plan"


PARSE = {"split", "partition", "rpartition", "startswith", "endswith", "find", "index", "replace"}


def _reads_where(node, tainted: set[str]) -> bool:
    """The expression reads the bottleneck's words: plan["bottleneck_where"], .get("bottleneck_where"),
    or a name assigned from one."""
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and n.value == "bottleneck_where":
            return True
        if isinstance(n, ast.Name) and n.id in tainted:
            return True
    return False


def prose_parsing_sites(source: str) -> list[int]:
    """Lines that read the bottleneck back out of its words: a comparison (`in`, `==`) or a string
    method (split, startswith, ...) on bottleneck_where, directly or through a variable."""
    hits = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.Module)):
            continue
        tainted: set[str] = set()
        for n in ast.walk(fn):
            if isinstance(n, ast.Assign) and _reads_where(n.value, tainted):
                tainted |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        for n in ast.walk(fn):
            method = isinstance(n, ast.Attribute) and n.attr in PARSE and _reads_where(n.value, tainted)
            if method or (isinstance(n, ast.Compare) and _reads_where(n, tainted)):
                hits.append(n.lineno)
    return sorted(set(hits))


def test_the_detector_sees_the_words_parsed():
    assert prose_parsing_sites('w = plan.get("bottleneck_where") or ""\nw = w.split(";")[0]')
    assert prose_parsing_sites('down = "is down" in plan["bottleneck_where"]')
    assert prose_parsing_sites('x = doc["bottleneck_where"].split("; communication adds")[0]')
    assert not prose_parsing_sites("print(f\"limited by {plan['bottleneck_where']}\")")


def test_no_module_parses_the_bottleneck_out_of_its_words():
    found = {}
    for path in sorted([*(ROOT / "smoltrain").rglob("*.py"), *(ROOT / "bench").rglob("*.py")]):
        lines = prose_parsing_sites(path.read_text())
        if lines:
            found[str(path.relative_to(ROOT))] = lines
    assert not found, f"the bottleneck read back out of its words (read bottleneck_detail): {found}"


class H:
    def __init__(self, name):
        self.name, self.device, self.local, self.link_rate_mbit, self.vars = name, "generic", False, None, {}


def _host(name, fixed, per_token, machine, mem=4e9):
    steps = [{"model": "tiny", "batch": b, "seq": 64, "seconds": fixed + per_token * b * 64} for b in (2, 8)]
    return {
        "name": name,
        "status": "ok",
        "error": None,
        "machine_id": machine,
        "cores": 4,
        "cpu_limit_cores": None,
        "flops": {"fp32": 10e9, "bf16": 20e9},
        "mem_bw_bytes_s": 5e9,
        "usable_memory_bytes": mem,
        "train_step": steps,
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Four measured hosts (one with less memory) on uneven links; `down`: the same with b -> a down."""
    names = ["a", "b", "c", "d"]
    hosts = [H(n) for n in names]
    p = tmp_path_factory.mktemp("compute") / "compute.json"
    rows = [
        _host("a", 0.01, 3e-4, "m1"),
        _host("b", 0.02, 1e-4, "m2"),
        _host("c", 0.01, 2e-4, "m3"),
        _host("d", 0.015, 1.5e-4, "m4", mem=2e9),
    ]
    p.write_text(json.dumps({"schema": "smoltrain.compute/1", "created": "x", "hosts": rows}))
    ranks, _ = measured.apply(resolve_ranks(4, hosts), hosts, str(p), get_model("tiny"))
    links = {
        (x, y): Link(300.0 + 100 * i, 500.0 + 50 * j)
        for i, x in enumerate(names)
        for j, y in enumerate(names)
        if x != y
    }
    lm = LinkModel(links=links, source={"kind": "links-report"})
    down = LinkModel(links=dict(links), source={"kind": "links-report"})
    down.links[("b", "a")] = Link(300.0, 500.0, "down")
    return {"meas": (ranks, lm), "down": (ranks, down)}


# recorded before the refactor: (H, bytes/token, bytes/step, all links' bytes/step, comm s, step s,
# tokens/s, outer sync s, busiest bytes per outer step, each ring link's busy seconds per step,
# memory total per rank)
DILOCO = {
    '{"inner_steps": 8, "sync_dtype": "int8"}': (
        8,
        265.201171875,
        135783,
        543132,
        0.0046927428,
        0.053092742799999995,
        9643.50253910785,
        0.0375419424,
        1086264,
        [0.00382713, 0.0029406600000000003, 0.0024162779999999996, 0.00199794],
        25405952,
    ),
    '{"target_comm": 0.05}': (
        49,
        172.51530612244898,
        88328,
        353311,
        0.0025304069877551023,
        0.0509304069877551,
        10052.93360650146,
        0.12398994240000001,
        4328064,
        [0.002389082448979592, 0.0018032914285714286, 0.001453041306122449, 0.0012083167346938776],
        25405952,
    ),
    '{"inner_steps": 1}': (
        1,
        8453.25,
        4328064,
        17312256,
        0.12398994240000001,
        0.1723899424,
        2970.0108537190395,
        0.12398994240000001,
        4328064,
        [0.11706504000000001, 0.08836128, 0.071199024, 0.05920752000000001],
        25405952,
    ),
}


@pytest.mark.parametrize("outer", list(DILOCO))
def test_diloco_comes_from_the_builder_with_the_figures_it_had(cluster, outer, monkeypatch):
    seen = []
    document = builder.document
    monkeypatch.setattr(builder, "document", lambda *a: seen.append(a[-1]) or document(*a))
    ranks, lm = cluster["meas"]
    d = make_plan("diloco", get_model("tiny"), 4, ranks=ranks, lm=lm, outer=json.loads(outer))
    (ph,) = seen  # the builder made it, with the outer step as its amortised phase
    assert isinstance(ph, Amortised) and ph.every == d["inner_steps"]
    h, bpt, bps, total, comm, step, tps, sync, busiest, link_s, mem = DILOCO[outer]
    got = (d["inner_steps"], d["bytes_per_token"], d["bytes_per_step"], d["total_bytes_per_step"])
    assert got == (h, bpt, bps, total)
    assert d["comm_s_per_step"] == pytest.approx(comm, rel=1e-12)
    assert d["step_s"] == pytest.approx(step, rel=1e-12)
    assert d["tokens_per_s"] == pytest.approx(tps, rel=1e-12)
    assert d["outer"]["sync_s"] == pytest.approx(sync, rel=1e-12)
    assert d["outer"]["bytes_per_outer_step"] == busiest
    assert [ln["seconds_per_step"] for ln in d["links"]] == pytest.approx(link_s, rel=1e-12)
    assert [ln["messages_per_step"] for ln in d["links"]] == [6 / h] * 4
    assert [r["memory"]["total"] for r in d["ranks"]] == [mem] * 4
    assert {p["every_steps"] for p in d["phases"]} == {h} and len(d["phases"]) == 6  # 2(N-1) ring rounds


# recorded before the refactor: the plan's bottleneck_where, one per form of the record
PROSE = {
    ("down", "diloco", "train", '{"inner_steps": 1}'): (
        "outer",
        "link a -> b: one 4.33 MB fp32 all-reduce every 1 steps takes 124 ms, 124 ms per step against "
        "48.4 ms of compute",
    ),
    ("down", "diloco", "infer", None): (
        "rank",
        "rank 1 (b, generic*): 7.28 ms of memory traffic per token; communication adds 0 us",
    ),
    ("down", "diloco", "train", '{"inner_steps": 8, "sync_dtype": "int8"}'): (
        "rank",
        "rank 0 (a, generic*): 48.4 ms of FLOPs per step; communication adds 4.69 ms per step (1.09 MB every 8 steps)",
    ),
    ("down", "dp", "train", None): (
        "bandwidth",
        "link a -> b (300 Mbit/s) carries 4.33 MB per step, busy 120 ms against 48.4 ms of compute",
    ),
    ("down", "edp", "train", None): ("down", "link b -> a is down; the plan cannot run over it"),
    ("down", "mp", "infer", None): (
        "stages",
        "4 stages, slowest rank 1 (b, generic*) with 2.1 ms of memory traffic per token; decode runs the stages "
        "one after another; communication adds 2.08 ms",
    ),
    ("down", "sp", "infer", None): (
        "latency",
        "6 messages per step wait 650 us round trips on c -> d; latency is 6.9 ms of 7.26 ms communication",
    ),
    ("meas", "edp", "train", None): (
        "nic",
        "a's uplink carries the star's traffic, 331 ms per step against 57.1 ms of compute",
    ),
}
PROSE_BIG = {  # gpt2-124m
    ("meas", "dp", "train"): ("memory", "rank 3 (d, generic*) needs 2.11 GB of 1.8 GB usable memory"),
    ("meas", "mp", "train"): (
        "stages",
        "4 stages, slowest rank 3 (d, generic*) with 6.05 s of FLOPs per step; pipeline bubble 75% of the step; "
        "communication adds 4.3 s",
    ),
}


def _check_words(d: dict, cause: str, prose: str) -> None:
    rec = Bottleneck.from_dict(d["bottleneck_detail"])
    assert rec.cause == cause and rec.kind == d["bottleneck"]
    assert words(rec) == d["bottleneck_where"] == prose
    assert prose.startswith(head(rec))


@pytest.mark.parametrize("key", list(PROSE), ids=lambda k: "-".join(str(x) for x in k[:3]))
def test_the_record_in_words_is_the_prose_plans_have_shown(cluster, key):
    where, strategy, mode, outer = key
    ranks, lm = cluster[where]
    outer = json.loads(outer) if outer else None
    d = make_plan(strategy, get_model("tiny"), 4, mode=mode, ranks=ranks, lm=lm, outer=outer)
    _check_words(d, *PROSE[key])


@pytest.mark.parametrize("key", list(PROSE_BIG), ids=lambda k: "-".join(k))
def test_capacity_and_pipeline_stages_in_words(cluster, key):
    where, strategy, mode = key
    ranks, lm = cluster[where]
    _check_words(make_plan(strategy, get_model("gpt2-124m"), 4, mode=mode, ranks=ranks, lm=lm), *PROSE_BIG[key])


def test_the_verdict_reads_the_record_not_the_words(cluster):
    """A down link and a capacity limit say so by their cause; words on a record are never parsed."""
    ranks, lm = cluster["down"]
    d = make_plan("edp", get_model("tiny"), 4, ranks=ranks, lm=lm)
    assert d["verdict"] == "edp on 4 ranks cannot run here: link b -> a is down."
    d["bottleneck_where"] = "nothing like the record"  # the verdict does not read the words
    from smoltrain.planner.verdict import sentence

    assert sentence(d) == "edp on 4 ranks cannot run here: link b -> a is down."
    d = make_plan("diloco", get_model("gpt2-124m"), 4, ranks=cluster["meas"][0], lm=cluster["meas"][1])
    rec = d["bottleneck_detail"]
    assert rec["kind"] == "capacity" and rec["with_outer_state"] and rec["needs"] == d["ranks"][3]["memory"]["total"]
