"""The device mesh: parsing and layout (fast, no processes), and 2-D runs that reproduce `--local 1`.

The runs are real: `smoltrain run --local 4 --mesh ...` with worker processes on loopback,
beside one `--local 1` reference. Each composed run must give the reference's loss at every
step and its weights after the run (gathered from the checkpoint parts: tp's slices
concatenated back, pp's stages laid end to end), and every replica must end bit-identical.
diloco runs as dp does there with one inner step of sgd and plain averaging (H=1, outer lr 1,
momentum 0, as tests/test_diloco.py checks 1-D diloco against dp); one more diloco run (H=2,
int8 on the wire) checks only its bytes against the plan.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from smoltrain.mesh import Mesh, MeshError, parse
from smoltrain.models.spec import get_model

BATCH, SEQ, STEPS, REL_TOL = 6, 32, 4, 1e-5
PLAIN = ["--inner-steps", "1", "--outer-lr", "1", "--outer-momentum", "0"]  # diloco H=1 with sgd: dp
RUNS = {
    "ref": ("--strategy", "dp", 1, "socket", []),
    "dp2xtp2": ("--mesh", "dp=2,tp=2", 4, "socket", []),
    "pp2xdp2-torch": ("--mesh", "pp=2,dp=2", 4, "torch", ["--microbatches", "3"]),
    "pp2xtp2": ("--mesh", "pp=2,tp=2", 4, "socket", ["--microbatches", "2"]),
    "fsdp2xtp2": ("--mesh", "fsdp=2,tp=2", 4, "socket", []),
    "diloco2xpp2": ("--mesh", "diloco=2,pp=2", 4, "socket", ["--microbatches", "3", *PLAIN]),
    "diloco2xtp2": ("--mesh", "diloco=2,tp=2", 4, "socket", PLAIN),
}
H2_INT8 = ["--inner-steps", "2", "--sync-dtype", "int8"]
BYTES_ONLY = {"diloco2xtp2-h2-int8": ("--mesh", "diloco=2,tp=2", 4, "socket", H2_INT8)}


# ----------------------------------------------------------------- the layout
def test_coordinates_and_groups_innermost_last():
    m = parse("dp=2,tp=2", 4)
    assert [m.coords(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert m.groups("tp") == [[0, 1], [2, 3]] and m.groups("dp") == [[0, 2], [1, 3]]
    m3 = parse("pp=2,dp=3,tp=2", 12)
    assert all(m3.rank_of(m3.coords(r)) == r for r in range(12))
    assert m3.groups("dp")[0] == [0, 2, 4] and m3.groups("pp")[0] == [0, 6]
    assert m.report() == {
        "axes": [{"name": "dp", "size": 2}, {"name": "tp", "size": 2}],
        "hosts": [[0, 0], [0, 1], [1, 0], [1, 1]],
    }
    assert m.roles() == ("tp", "dp", None) and parse("pp=2,dp=2", 4).roles() == ("pp", "dp", None)
    assert parse("dp=2,pp=2,tp=2", 8).roles() == ("pp", "dp", "tp")
    assert parse("fsdp=2,tp=2", 4).roles() == ("fsdp", None, "tp")
    assert parse("diloco=2,pp=2", 4).roles() == ("pp", "diloco", None)
    assert parse("diloco=2,pp=2,tp=2", 8).roles() == ("pp", "diloco", "tp")
    assert Mesh((("tp", 4),)).roles() == ("tp", None, None)


@pytest.mark.parametrize(
    "text, world, why",
    [
        ("dp=3,tp=2", 4, "multiply to 6 ranks, the world has 4"),
        ("dp=2,xx=2", 4, "unknown axis 'xx'"),
        ("dp=2,dp=2", 4, "axis dp is given twice"),
        ("dp=2,tp", 4, "is not AXIS=N"),
        ("dp=0,tp=2", 0, "is not AXIS=N"),
        ("dp=1,tp=8", 8, "tp=8 is wider than tiny's 6 KV head groups"),
        ("pp=8", 8, "pp=8 is deeper than tiny's 6 layers"),
    ],
)
def test_bad_meshes_name_why(text, world, why):
    with pytest.raises(MeshError, match=why):
        parse(text, world, get_model("tiny"))


def test_pairs_that_do_not_compose_yet_are_refused():
    for text in ("diloco=2,fsdp=2", "dp=2,fsdp=2", "fsdp=2,pp=2"):
        with pytest.raises(MeshError, match="does not run yet"):
            parse(text, 4).roles()
    for text in ("pp=2,diloco=2", "tp=2,diloco=2", "dp=2,diloco=2"):  # its replicas are whole inner meshes
        with pytest.raises(MeshError, match="diloco must be the outermost axis"):
            parse(text, 4).roles()


def test_cli_refuses_a_bad_mesh_in_one_line():
    p = cli(["run", "--mesh", "dp=3,tp=2", "--local", "4", "--steps", "1"])
    assert p.returncode == 2 and "multiply to 6 ranks, the world has 4" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    p = cli(["run", "--mesh", "dp=2,fsdp=2", "--local", "4", "--steps", "1"])
    assert p.returncode == 2 and "dp x fsdp does not run yet" in p.stderr


@pytest.mark.parametrize(
    "args, why",
    [
        (["--mesh", "pp=2,diloco=2"], "diloco must be the outermost axis"),
        (["--mesh", "dp=2,tp=2", "--inner-steps", "2"], "--inner-steps: only for a low-communication strategy"),
        (["--mesh", "diloco=2,tp=2", "--backend", "torch", "--sync-dtype", "int8"], "torch backend cannot carry it"),
        (["--mesh", "diloco=2,pp=2", "--batch", "1"], "--batch 1 is smaller than the 2 diloco replicas"),
    ],
)
def test_a_diloco_mesh_that_cannot_run_is_one_line(capsys, tmp_path, args, why):
    from smoltrain.cli import main

    rc = main(["run", *args, "--local", "4", "--steps", "1", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and why in err and err.count("\n") == 0, err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------- the runs
def cli(args, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "smoltrain", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("mesh")
    secret = d / "secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)

    def one(name):
        flag, what, world, backend, extra = {**RUNS, **BYTES_ONLY}[name]
        out, ck = d / f"{name}.json", d / f"ck-{name}"
        args = [flag, what, "--local", str(world), "--backend", backend, "--steps", str(STEPS)]
        args += ["--batch", str(BATCH), "--seq", str(SEQ), "--seed", "7", "--optimizer", "sgd", "--lr", "0.05"]
        args += ["--eval-every", str(STEPS), "--checkpoint-dir", str(ck), "--checkpoint-every", str(STEPS)]
        p = cli(["run", *args, "--secret-file", str(secret), "--out", str(d), "--json", str(out), *extra])
        if p.returncode != 0:
            return RuntimeError(f"{name}: exit {p.returncode}: {p.stdout[-800:]} {p.stderr[-800:]}")
        return json.loads(out.read_text()), ck / f"step-{STEPS:06d}"

    with ThreadPoolExecutor(max_workers=2) as pool:
        names = [*RUNS, *BYTES_ONLY]
        return dict(zip(names, pool.map(one, names)))


def got(runs, name):
    if isinstance(runs[name], Exception):
        raise runs[name]
    return runs[name]


def parts(folder, world: int, keep=("param.", "shard.")) -> list[dict]:
    """Each rank's parameters by name (param.NAME), or its fsdp shards (shard.I); with
    keep=("outer.",) a diloco axis's anchor and outer momentum instead."""
    from safetensors.torch import load_file

    return [
        {k.removeprefix("param."): v for k, v in load_file(path).items() if k.startswith(keep)}
        for path in (folder / f"rank{r}.safetensors" for r in range(world))
    ]


def unsharded(mesh, ranks: list[dict]) -> list[dict]:
    """fsdp x tp: each tp rank's units from its fsdp group's shards (shard.I: flat, padded),
    named as tp names them (the slices' shapes from tp's own ParallelBlock)."""
    from smoltrain.models.gpt import build_model
    from smoltrain.strategies.tp import ParallelBlock

    spec, tp, fsdp = get_model("tiny"), mesh.size("tp"), mesh.size("fsdp")
    full = list(build_model(spec, 0).units)
    out = []
    for t in range(tp):
        heads, ffn = (spec.heads * t // tp, spec.heads * (t + 1) // tp), (spec.ffn * t // tp, spec.ffn * (t + 1) // tp)
        named = {}
        for i, u in enumerate(full):
            mod = u if i in (0, len(full) - 1) else ParallelBlock(u, heads, ffn, None)
            flat = torch.cat([ranks[mesh.rank_of([f, t])][f"shard.{i}"] for f in range(fsdp)])
            off = 0
            for n, p in mod.named_parameters():
                named[f"{i}.{n}"] = flat[off : off + p.numel()].view(p.shape)
                off += p.numel()
        out.append(named)
    return out


def whole_from_tp(shards: list[dict]) -> dict:
    """tp slices back into whole units: q, k, v and fc by rows, out and proj by columns."""
    out = {}
    for name in shards[0]:
        ts = [s[name] for s in shards]
        if name.endswith(("attn.q.weight", "attn.k.weight", "attn.v.weight", "mlp.fc.weight")):
            out[name] = torch.cat(ts, 0)
        elif name.endswith(("attn.out.weight", "mlp.proj.weight")):
            out[name] = torch.cat(ts, 1)
        else:
            assert all(torch.equal(t, ts[0]) for t in ts), name  # replicated: identical on every rank
            out[name] = ts[0]
    return out


def whole_from_pp(stages: list[dict]) -> dict:
    """pp stages laid end to end: stage s's unit j is the whole model's unit (units before it) + j."""
    out, base = {}, 0
    for st in stages:
        for name, t in st.items():
            j, rest = name.split(".", 1)
            out[f"units.{base + int(j)}.{rest}"] = t
        base += len({n.split(".", 1)[0] for n in st})
    return out


def gathered(mesh, ranks: list[dict]) -> dict:
    """Replica 0's whole model: each stage's tp slices joined, the stages laid end to end."""

    def at(**c) -> dict:
        return ranks[mesh.rank_of([c.get(a, 0) for a in mesh.names])]

    tp = mesh.size("tp")
    if "fsdp" in mesh.names:
        return {f"units.{k}": v for k, v in whole_from_tp(unsharded(mesh, ranks)).items()}
    stages = [whole_from_tp([at(pp=s, tp=t) for t in range(tp)]) for s in range(mesh.size("pp"))]
    if mesh.size("pp") > 1:
        return whole_from_pp(stages)
    return {f"units.{k}": v for k, v in stages[0].items()}


@pytest.mark.parametrize("name", [n for n in RUNS if n != "ref"])
def test_mesh_run_reproduces_the_single_process_run(runs, name):
    (ref, ref_ck), (doc, ck) = got(runs, "ref"), got(runs, name)
    mesh = parse(RUNS[name][1], 4)
    assert doc["mesh"] == mesh.report() and ref["mesh"] == {"axes": [{"name": "dp", "size": 1}], "hosts": [[0]]}
    worst = max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(ref["steps"], doc["steps"], strict=True))
    assert worst < REL_TOL, f"{name}: loss differs from --local 1 by {worst:.2e} relative"
    assert abs(doc["evals"][-1]["loss"] - ref["evals"][-1]["loss"]) < REL_TOL * ref["evals"][-1]["loss"]
    ranks = parts(ck, 4)
    model, data, _ = mesh.roles()
    for g in mesh.groups(data) if data else []:  # every replica ends with the same weights, bit for bit
        assert all(ranks[r].keys() == ranks[g[0]].keys() for r in g)
        assert all(torch.equal(ranks[r][k], ranks[g[0]][k]) for r in g for k in ranks[r])
    whole = gathered(mesh, ranks)
    want = parts(ref_ck, 1)[0]
    assert whole.keys() == want.keys()
    for k, t in want.items():
        assert torch.allclose(whole[k], t, rtol=REL_TOL, atol=1e-6), f"{name}: {k} differs after the run"
    if data == "diloco":  # the last step ends an outer step: each group's anchor is shared, and its weights
        outer = parts(ck, 4, keep=("outer.",))
        for g in mesh.groups(data):
            assert all(torch.equal(outer[r]["outer.anchor"], outer[g[0]]["outer.anchor"]) for r in g)
            held = torch.cat([t.reshape(-1) for t in ranks[g[0]].values()])  # (in name order, not the anchor's)
            assert torch.equal(held.sort().values, outer[g[0]]["outer.anchor"].sort().values)
        assert doc["config"]["inner_steps"] == 1 and len(doc["outer_steps"]) == STEPS


@pytest.mark.parametrize("name", ["dp2xtp2", "pp2xdp2-torch", "pp2xtp2", "diloco2xpp2", "diloco2xtp2-h2-int8"])
def test_mesh_bytes_per_link_equal_the_plan(runs, name):
    """Each axis's bytes on its own groups' links, nothing across two axes, and every link's
    bytes exactly the plan's (planner.mesh_traffic: each axis's 1-D traffic over its groups;
    diloco's outer all-reduce amortised over its H inner steps, H dividing the run's steps)."""
    from smoltrain.planner.mesh_traffic import mesh_link_bytes

    doc, _ = got(runs, name)
    flag, text, world, _, extra = {**RUNS, **BYTES_ONLY}[name]
    mesh = parse(text, world)
    m = int(extra[extra.index("--microbatches") + 1]) if "--microbatches" in extra else 1
    links = {(int(b["src"][4:]), int(b["dst"][4:])): b["bytes"] for b in doc["bytes"]}
    for a, b in links:
        assert sum(x != y for x, y in zip(mesh.coords(a), mesh.coords(b))) == 1, f"{name}: {a}->{b} crosses two axes"
    cfg = doc["config"]
    outer = dict(inner_steps=cfg["inner_steps"], sync_dtype=cfg["sync_dtype"]) if "diloco" in text else {}
    plan = mesh_link_bytes(mesh, get_model("tiny"), BATCH, SEQ, m, **outer)
    assert links == {k: STEPS * v for k, v in plan.items()}
    if outer:  # each outer step's bytes, and the same weights on every rank of a diloco group after it
        assert [o["step"] for o in doc["outer_steps"]] == list(range(cfg["inner_steps"] - 1, STEPS, cfg["inner_steps"]))
        for o in doc["outer_steps"]:
            by = {int(r["name"][4:]): r for r in o["ranks"]}
            for g in mesh.groups("diloco"):
                assert len({by[r]["digest"] for r in g}) == 1, (o["step"], g)
                assert [by[r]["bytes"] for r in g] == [
                    sum(v for (s, d), v in plan.items() if s == r and d in g) * cfg["inner_steps"] for r in g
                ]


def test_plan_mesh_prints_bytes_per_link():
    p = cli(["plan", "--mesh", "dp=2,tp=2", "--batch", str(BATCH), "--seq", str(SEQ)])
    assert p.returncode == 0, p.stderr
    assert "rank 0 -> rank 1" in p.stdout and "tp" in p.stdout and "dp" in p.stdout
    p = cli(["plan", "--mesh", "dp=2,tp=2", "--world", "8"])
    assert p.returncode == 2 and "multiply to 4 ranks, the world has 8" in p.stderr
