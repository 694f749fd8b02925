"""The mesh in the planner: step time per layout from measured links and compute, host
assignment onto the mesh, `plan --mesh auto`'s search and ranking, and its one-line refusals.

The cluster is the `fastpair` sim scenario written as reports (smolnet/sim: fast1 and fast2 on
10 Gbit, gbe on 1 GbE, slowup with a 300 Mbit uplink, CPUs alike), its hosts listed with the
fast pair apart (fast1, gbe, fast2, slowup) so that inventory order does not place tp for us.
"""

from __future__ import annotations

import io
import json

import pytest

from smoltrain import schema
from smoltrain.cli import main
from smoltrain.mesh import Mesh, parse
from smoltrain.models.spec import get_model
from smoltrain.planner import mesh_search
from smoltrain.planner.bottleneck import Bottleneck
from smoltrain.planner.links import read_report
from smoltrain.planner.mesh_plan import place
from smoltrain.planner.mesh_render import words
from smoltrain.planner.mesh_traffic import held_params, mesh_link_bytes
from smoltrain.planner.request import PlanRequest, build_plan, resolve
from smoltrain.planner.selection import hosts as report_hosts

NAMES = ["fast1", "gbe", "fast2", "slowup"]  # inventory order: the fast pair apart
FAST = {"fast1", "fast2"}
TWO_PAIRS = ["a1", "b1", "a2", "b2"]  # two fast pairs (a1-a2, b1-b2), apart in inventory order
BATCH, SEQ, MB = 8, 64, 4


def fast(s: str, d: str) -> bool:
    return {s, d} == FAST or (s[0] == d[0] and s[0] in "ab")


def rate(s: str, d: str) -> float:
    if fast(s, d):
        return 9400.0
    return 280.0 if s == "slowup" else 940.0


def _link(s, d, down=()):
    r, rtt = rate(s, d), 60.0 if fast(s, d) else 200.0
    off = (s, d) in down
    return {
        "src": s,
        "dst": d,
        "status": "down" if off else "ok",
        "throughput_mbit": None if off else r,
        "retransmits": 0,
        "rtt_us": {k: rtt for k in ("min", "p50", "p90", "p99", "max")},
        "mtu_effective": 1500,
        "mtu_configured": 1500,
        "ceiling_mbit": r,
        "method": "iperf3",
        "warnings": [],
        "error": "no route" if off else None,
    }


def write_links(path, down=(), names=NAMES) -> str:
    hosts = [
        {
            "name": n,
            "address": f"10.0.0.{i + 1}",
            "iface": "eth0",
            "mtu_configured": 1500,
            "link_rate_mbit": 10000 if n in FAST or n[0] in "ab" else 1000,
            "device": "generic",
            "status": "ok",
            "error": None,
        }
        for i, n in enumerate(names)
    ]
    links = [_link(s, d, down) for s in names for d in names if s != d]
    doc = {
        "schema": "smolnet.links/1",
        "created": "2026-12-02T10:00:00Z",
        "settings": {"duration_s": 1.0, "backend": "iperf3"},
        "hosts": hosts,
        "links": links,
    }
    path.write_text(json.dumps(doc))
    return str(path)


def write_compute(path, names=NAMES, slow=()) -> str:
    def host(n):
        k = 4 if n in slow else 1
        steps = [{"model": "tiny", "batch": b, "seq": 64, "seconds": k * (0.005 + 2e-5 * b * 64)} for b in (2, 8)]
        return {
            "name": n,
            "status": "ok",
            "error": None,
            "machine_id": n,
            "cores": 4,
            "cpu_limit_cores": None,
            "flops": {"fp32": 20e9, "bf16": 40e9},
            "mem_bw_bytes_s": 10e9,
            "usable_memory_bytes": 8e9,
            "train_step": steps,
        }

    path.write_text(json.dumps({"schema": "smoltrain.compute/1", "created": "x", "hosts": [host(n) for n in names]}))
    return str(path)


@pytest.fixture
def files(tmp_path):
    return write_links(tmp_path / "links.json"), write_compute(tmp_path / "compute.json")


def setting_of(files, placement="auto"):
    links, compute = files
    doc = read_report(links)
    req = PlanRequest("tp", "tiny", batch=BATCH, seq=SEQ, microbatches=MB, hosts=report_hosts(None, doc), links=doc)
    req = mesh_search.mesh_request(PlanRequest(**{**req.__dict__, "compute": compute}))
    return req, resolve(req)


def by_layout(doc) -> dict:
    return {e["layout"]: e for e in doc["meshes"]}


def tp_groups(e) -> list[set]:
    mesh = parse(e["layout"], len(e["order"]))
    return [{e["order"][r] for r in g} for g in mesh.groups("tp")]


def test_auto_lays_tp_on_the_fast_pair_and_even_keeps_inventory_order(files):
    req, st = setting_of(files)
    auto = by_layout(mesh_search.search(req, st, "auto"))
    even = by_layout(mesh_search.search(req, st, "even"))
    for text in ("pp=2,tp=2", "dp=2,tp=2"):
        assert FAST in tp_groups(auto[text]), (text, auto[text]["order"])
        assert even[text]["order"] == NAMES and FAST not in tp_groups(even[text])
        assert auto[text]["step_s"] <= even[text]["step_s"]
    # slowup's uplink is in some tp group either way; pp x tp still gains a stage on the pair
    assert auto["pp=2,tp=2"]["step_s"] < even["pp=2,tp=2"]["step_s"]
    e = auto["pp=2,tp=2"]
    assert e["mesh"] == parse("pp=2,tp=2", 4).report()
    assert e["placement"] == "auto" and e["fits"] and all(r["fits"] for r in e["ranks"])


def test_two_fast_pairs_carry_the_tp_groups(tmp_path):
    files = write_links(tmp_path / "l.json", names=TWO_PAIRS), write_compute(tmp_path / "c.json", TWO_PAIRS)
    req, st = setting_of(files)
    auto = by_layout(mesh_search.search(req, st, "auto"))
    even = by_layout(mesh_search.search(req, st, "even"))
    for text in ("pp=2,tp=2", "dp=2,tp=2"):
        assert sorted(map(sorted, tp_groups(auto[text]))) == [["a1", "a2"], ["b1", "b2"]]
        assert auto[text]["seconds"]["tp"] < even[text]["seconds"]["tp"] / 5  # 10x the goodput
        assert auto[text]["step_s"] < even[text]["step_s"]


def test_pp_x_tp_ranks_above_1d_tp_and_the_ranking_is_by_tokens_per_s(files):
    req, st = setting_of(files)
    doc = mesh_search.search(req, st, "auto")
    tps = [e["tokens_per_s"] for e in doc["meshes"]]
    assert tps == sorted(tps, reverse=True) and doc["best"] == doc["meshes"][0]["layout"]
    one_d = build_plan(PlanRequest(**{**req.__dict__, "strategy": "tp", "placement": "even"}), st)
    mesh = by_layout(doc)["pp=2,tp=2"]
    assert mesh["tokens_per_s"] > 1.3 * one_d["tokens_per_s"]
    assert one_d["mesh"] == {"axes": [{"name": "tp", "size": 4}], "hosts": [[0], [1], [2], [3]]}  # tp=4
    # the parts of the step add up to it, and the bottleneck is the largest part
    assert sum(mesh["seconds"].values()) == pytest.approx(mesh["step_s"])
    top = max(mesh["seconds"], key=mesh["seconds"].get)
    assert mesh["bottleneck_axis"] == (None if top == "compute" else top)
    assert {
        (a, b) for a, b in (("dp", "pp"), ("pp", "dp"), ("pp", "tp"), ("tp", "pp"), ("dp", "tp"), ("tp", "dp"))
    } == {tuple(n for n, _ in parse(e["layout"], 4).axes) for e in doc["meshes"]}


def test_a_slow_host_is_the_bottleneck_on_fast_links(tmp_path):
    """On 100 GbE the step is compute: every layout names the slow host's rank, and its parts
    (the slowest rank's compute, then each axis) add up to the step."""
    doc = read_report(write_links(tmp_path / "l.json"))
    req = PlanRequest("tp", "tiny", batch=BATCH, seq=SEQ, microbatches=MB, hosts=report_hosts(None, doc))
    req.link_class, req.compute = "100gbe", write_compute(tmp_path / "c.json", slow={"gbe"})
    req = mesh_search.mesh_request(req)
    for e in mesh_search.search(req, resolve(req), "even")["meshes"]:
        assert e["bottleneck"] in ("compute", "memory-bandwidth") and "(gbe," in e["bottleneck_where"], e["layout"]
        d = e["bottleneck_detail"]
        assert d["host"] == "gbe" and d["cause"] == ("stages" if "pp" in e["layout"] else "rank"), e["layout"]
        assert sum(e["seconds"].values()) == pytest.approx(e["step_s"]), e["layout"]


def test_bytes_in_meshes_equal_mesh_link_bytes_exactly(files):
    req, st = setting_of(files)
    doc = mesh_search.search(req, st, "auto")
    assert len(doc["meshes"]) == 6
    for e in doc["meshes"]:
        want = mesh_link_bytes(parse(e["layout"], 4), get_model("tiny"), BATCH, SEQ, MB)
        got = {(ln["src_rank"], ln["dst_rank"]): ln["bytes_per_step"] for ln in e["links"]}
        assert got == want, e["layout"]
        assert all(
            (ln["src"], ln["dst"]) == (e["order"][ln["src_rank"]], e["order"][ln["dst_rank"]]) for ln in e["links"]
        )
    schema.check(doc, schema.MESHPLAN, "doc")


def test_a_data_axis_splits_the_batch_and_pp_the_layers():
    """Per-rank work: a dp replica computes half the tokens, a pp stage half the layers, a tp
    rank half the block's matrices; the memory each holds follows."""
    from smoltrain.planner.mesh_plan import Shape, rank_work

    sh = Shape(get_model("tiny"), BATCH, SEQ, MB)
    whole = rank_work(Mesh((("dp", 1),)), sh, 0)
    dp = rank_work(parse("dp=2,tp=2", 4), sh, 0)
    pp = rank_work(parse("pp=2,tp=2", 4), sh, 0)
    assert dp.tokens == whole.tokens / 2 and pp.tokens == whole.tokens and pp.layers == whole.layers / 2
    spec = get_model("tiny")
    blocks = spec.layers * spec.layer_params()
    assert whole.matmul_params - dp.matmul_params == pytest.approx(blocks / 2, rel=0.01)


def test_search_avoids_a_down_link_and_explicit_refuses_one(files, tmp_path):
    links = write_links(tmp_path / "down.json", down={("fast1", "gbe"), ("gbe", "fast1")})
    req, st = setting_of((links, files[1]))
    doc = mesh_search.search(req, st, "auto")
    for e in doc["meshes"]:
        assert not any({ln["src"], ln["dst"]} == {"fast1", "gbe"} for ln in e["links"]), e["layout"]
    with pytest.raises(Exception, match="fast1 -> gbe is down|gbe -> fast1 is down"):
        mesh_search.explicit(req, st, "dp=2,tp=2", "even")  # inventory order: fast1 and gbe share tp


def test_the_bottleneck_is_a_record_and_its_words_are_rendered_from_it(files, tmp_path):
    """Each layout's bottleneck_detail is planner.bottleneck's record (compute, an axis's link, a
    down link, a rank short of memory); bottleneck_where is mesh_render.words of it."""
    req, st = setting_of(files)
    entries = mesh_search.search(req, st, "auto")["meshes"]
    req, st = setting_of((write_links(tmp_path / "down.json", down={("fast1", "gbe")}), files[1]))
    sh = mesh_search.shape_of(req, st.model)
    entries.append(mesh_search.lay_out(parse("dp=2,tp=2", 4), sh, st.ranks, st.lm, "even"))
    c = json.loads((tmp_path / "compute.json").read_text())
    for h in c["hosts"]:
        h["usable_memory_bytes"] = 2e6
    (tmp_path / "small.json").write_text(json.dumps(c))
    req, st = setting_of((files[0], str(tmp_path / "small.json")))
    doc = mesh_search.explicit(req, st, "pp=2,tp=2", "even")
    entries.append(doc["meshes"][0])
    causes = set()
    for e in entries:
        rec = Bottleneck.from_dict(e["bottleneck_detail"])
        assert (rec.kind, rec.axis) == (e["bottleneck"], e["bottleneck_axis"]), e["layout"]
        assert words(rec) == e["bottleneck_where"], e["layout"]
        causes.add(rec.cause)
    down, small = (Bottleneck.from_dict(e["bottleneck_detail"]) for e in entries[-2:])
    assert (down.cause, down.axis, {down.src, down.dst}) == ("down", "tp", {"fast1", "gbe"})
    assert small.cause == "memory" and small.needs > small.usable and not entries[-1]["fits"]
    assert {"bandwidth", "down", "memory"} <= causes
    schema.check(doc, schema.MESHPLAN, "doc")


def test_with_inner_steps_diloco_is_an_outer_axis_with_its_bytes_and_state(files):
    req, st = setting_of(files)
    plain = by_layout(mesh_search.search(req, st, "auto"))
    req = PlanRequest(**{**req.__dict__, "outer": {"inner_steps": 4, "sync_dtype": "int8"}})
    doc = mesh_search.search(req, st, "auto")
    got = by_layout(doc)
    dil = [t for t in got if t.startswith("diloco")]
    assert sorted(dil) == ["diloco=2,pp=2", "diloco=2,tp=2"] and not any("diloco" in t[1:] for t in plain)
    for text in dil:
        e = got[text]
        want = mesh_link_bytes(parse(text, 4), get_model("tiny"), BATCH, SEQ, MB, inner_steps=4, sync_dtype="int8")
        assert {(ln["src_rank"], ln["dst_rank"]): ln["bytes_per_step"] for ln in e["links"]} == want
        # each rank also keeps an anchor and a momentum (fp32) of what it holds: 8 bytes a parameter
        same = plain[text.replace("diloco", "dp")]
        for r, (a, b) in enumerate(zip(e["ranks"], same["ranks"])):
            held = held_params(get_model("tiny"), place(parse(text, 4), r))
            assert a["memory_bytes"] - b["memory_bytes"] == 8 * held
        assert e["seconds"]["diloco"] < same["seconds"]["dp"] / 4  # int8 every 4 steps, not fp32 every step
    with pytest.raises(Exception, match="planned with --inner-steps H"):
        mesh_search.explicit(PlanRequest(**{**req.__dict__, "outer": None}), st, "diloco=2,pp=2", "auto")


def cli(capsys, *argv):
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--mesh", "dp=3,tp=2", "--world", "4"], "multiply to 6 ranks, the world has 4"),
        (["--mesh", "dp=1,tp=8", "--world", "8"], "tp=8 is wider than tiny's 6 KV head groups"),
        (["--mesh", "auto", "--world", "4", "--model", "llama-3.1-8b", "--link-class", "1gbe"], "no layout of 4"),
        (["--mesh", "auto", "--world", "3"], "no layout of 3 ranks"),
        (["--mesh", "fsdp=2,tp=2"], "fsdp x tp runs, but the plan does not time it yet"),
        (["--mesh", "dp=4"], "dp alone is `plan --strategy dp`"),
        (["--mesh", "pp=2,tp=2", "--mode", "infer"], "a training step's layouts"),
    ],
)
def test_cli_refusals_are_one_line_exit_2(capsys, argv, needle):
    rc, _, err = cli(capsys, *argv)
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_cli_down_link_is_one_line_exit_2(capsys, files, tmp_path):
    links = write_links(tmp_path / "down.json", down={("fast1", "gbe")})
    argv = ["--links", links, "--compute", files[1], "--placement", "even", "--microbatches", "2"]
    rc, _, err = cli(capsys, "--mesh", "dp=2,tp=2", *argv)
    assert rc == 2 and "tp link fast1 -> gbe is down" in err and len(err.strip().splitlines()) == 1


def test_cli_auto_json_and_strategy_all_name_the_best_mesh(capsys, files, tmp_path):
    links, compute = files
    common = ["--links", links, "--compute", compute, "--batch", str(BATCH), "--seq", str(SEQ)]
    common += ["--microbatches", str(MB)]
    out = tmp_path / "auto.json"
    rc, text, _ = cli(capsys, "--mesh", "auto", *common, "--json", str(out))
    doc = json.loads(out.read_text())
    assert rc == 0 and doc["schema"] == schema.MESHPLAN and f"best mesh: {doc['best']}" in " ".join(text.split())
    rc, text, _ = cli(capsys, "--mesh", "pp=2,tp=2", *common)
    assert rc == 0 and "rank 0 -> rank 1" in text and "tokens/s" in text and "bottleneck" in text
    allj = tmp_path / "all.json"
    rc, text, _ = cli(capsys, "--strategy", "all", *common, "--json", str(allj))
    plans = json.loads(allj.read_text())
    schema.check(plans, schema.PLANS, "all.json")
    assert rc == 0 and plans["best_mesh"] == doc["best"] and plans["meshes"][0]["layout"] == doc["best"]
    assert "meshes of 4 ranks" in text and "verdict:" in text
    best_1d = max(p["tokens_per_s"] for p in plans["plans"])
    if plans["meshes"][0]["tokens_per_s"] > best_1d:
        assert f"the mesh {doc['best']}" in " ".join(text.split())


def test_plan_leaves_its_arguments_as_parsed(capsys, files):
    import argparse

    from smoltrain.commands import plan as command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    links, compute = files
    for argv in (["--mesh", "auto"], ["--mesh", "pp=2,tp=2"], ["--strategy", "all", "--no-what-if"]):
        args = parser.parse_args([*argv, "--links", links, "--compute", compute, "--microbatches", "2"])
        before = dict(vars(args))
        assert command.run(args) == 0
        assert vars(args) == before, argv
    capsys.readouterr()


def test_run_mesh_auto_takes_the_plans_layout_and_host_order(tmp_path, files):
    """`run -i INVENTORY --mesh auto` asks mesh_search.for_run, which plans as `plan --mesh auto`
    does for the inventory's hosts and links: the same layout, rank r on the plan's r-th host."""
    import argparse

    from smoltrain.commands import run as run_command

    inv = tmp_path / "inv.yml"
    rows = "".join(
        f"        {n}: {{ansible_connection: local, cluster_ip: 127.0.0.{21 + i}, device: generic}}\n"
        for i, n in enumerate(NAMES)
    )
    inv.write_text("all:\n  children:\n    cluster:\n      hosts:\n" + rows)
    parser = argparse.ArgumentParser()
    run_command.add_arguments(parser)
    links, compute = files
    args = parser.parse_args(["-i", str(inv), "--mesh", "auto", "--links", links, "--compute", compute])
    text, order, line = mesh_search.for_run(args)
    out = tmp_path / "plan.json"
    argv = ["--mesh", "auto", "-i", str(inv), "--links", links, "--compute", compute, "--json", str(out)]
    argv += ["--batch", str(args.batch), "--seq", str(args.seq), "--microbatches", str(args.microbatches)]
    assert main(["plan", *argv]) == 0
    best = json.loads(out.read_text())["meshes"][0]
    assert (text, order) == (best["layout"], best["order"]) and line.startswith(f"mesh auto: {text} on ")
    assert sorted(order) == sorted(NAMES) and order != NAMES  # the plan's order, not the inventory's


def test_the_verdict_names_the_mesh_only_when_it_beats_the_best_strategy(files):
    from rich.console import Console

    from smoltrain.planner import mesh_render

    req, st = setting_of(files)
    doc = mesh_search.search(req, st, "auto")
    best = doc["meshes"][0]
    con = Console(file=io.StringIO())
    slower = {"strategy": "pp", "tokens_per_s": best["tokens_per_s"] / 2}
    faster = {"strategy": "diloco", "tokens_per_s": best["tokens_per_s"] * 2}
    assert mesh_render.beside(con, doc, slower).startswith(f"the mesh {best['layout']} on ")
    assert "2.00x the best single strategy (pp)" in mesh_render.beside(con, doc, slower)
    assert mesh_render.beside(con, doc, faster).startswith(f"diloco alone beats every mesh (the best, {best['layout']}")
