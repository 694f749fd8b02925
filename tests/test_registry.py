"""The strategy registry: each strategy's traits are declared once, and the planner finds a
strategy's traffic model (and everything else it plans) through them, never by its name."""

import dataclasses
import json
import re
from pathlib import Path

import pytest

from smolnet.errors import UsageError
from smoltrain import registry
from smoltrain.demo.flow import runnable
from smoltrain.models.spec import get_model
from smoltrain.planner import traffic as traffic_mod
from smoltrain.planner.plan import make_plan
from smoltrain.planner.ranks import busy_ranks
from smoltrain.planner.split import MODES

ROOT = Path(__file__).resolve().parents[1]
TINY = get_model("tiny")
MOE = get_model("mixtral-8x7b")
NAME_TEST = re.compile(r"""strategy\s*(==|!=|\bin\b|\bnot in\b)\s*[("']""")
_NAMES = "|".join(registry.names())
NAME_TUPLE = re.compile(rf"""[(\[{{]\s*["']({_NAMES})["']\s*,\s*["']({_NAMES})["']""")  # ("dp", "syncps", ...)


def _model_for(info):
    return MOE if info.splits == "experts" else TINY


@pytest.mark.parametrize("name", registry.names())
def test_every_strategy_names_a_traffic_model_the_planner_finds(name):
    info = registry.get(name)
    assert info.traffic in traffic_mod.MODELS, f"{name}: traffic model {info.traffic!r} is not in MODELS"
    for mode in MODES:
        assert callable(traffic_mod.model_for(info, mode))
        doc = make_plan(name, _model_for(info), 2, mode=mode)
        assert doc["strategy"] == name and doc["step_s"] > 0


def test_replicas_decode_alone_and_the_rest_put_bytes_on_the_links():
    for name in registry.names():
        info = registry.get(name)
        tr = traffic_mod.traffic(name, "infer", _model_for(info), 2)
        assert (sum(tr.rank_bytes()) == 0) == info.replicated_infer, name


def test_an_unknown_traffic_model_is_a_one_line_error(monkeypatch):
    bad = dataclasses.replace(registry.get("dp"), name="dp-x", traffic="carrier-pigeon")
    monkeypatch.setitem(registry.REGISTRY, "dp-x", bad)
    with pytest.raises(UsageError, match="no traffic model 'carrier-pigeon'"):
        make_plan("dp-x", TINY, 2)


def _renamed(doc: dict, new: str, old: str) -> str:
    return json.dumps(doc).replace(new, old)


@pytest.mark.parametrize(
    ("old", "model", "kw"),
    [
        ("pp", TINY, {"world": 3, "microbatches": 2}),
        ("mp", TINY, {"world": 3}),
        ("syncps", TINY, {"world": 3}),
        ("edp", TINY, {"world": 3}),
        ("fsdp", TINY, {"world": 2}),
        ("tp", TINY, {"world": 2}),
        ("sp", TINY, {"world": 2}),
        ("ep", MOE, {"world": 4, "dtype": "bf16", "batch": 4, "seq": 256}),
    ],
)
@pytest.mark.parametrize("mode", ["train", "infer"])
def test_a_new_name_with_existing_traits_is_planned_without_touching_the_planner(monkeypatch, old, model, kw, mode):
    new = f"{old}-clone"
    monkeypatch.setitem(registry.REGISTRY, new, dataclasses.replace(registry.get(old), name=new))
    want = make_plan(old, model, mode=mode, **kw)
    got = make_plan(new, model, mode=mode, **kw)
    assert got["strategy"] == new
    assert _renamed(got, new, old) == json.dumps(want)


def test_traits_not_names_set_the_plan(monkeypatch):
    """A chain that is not microbatched plans as mp does, whatever it is called."""
    pp = registry.get("pp")
    monkeypatch.setitem(registry.REGISTRY, "chain", dataclasses.replace(pp, name="chain", microbatched=False))
    got = make_plan("chain", TINY, 3, microbatches=4)
    want = make_plan("mp", TINY, 3, microbatches=4)
    assert got["microbatches"] == 1 and _renamed(got, "chain", "mp") == json.dumps(want)
    assert busy_ranks("chain", 3, 4) == busy_ranks("mp", 3, 4) == 1
    assert busy_ranks("pp", 3, 4) == 3 and busy_ranks("pp", 3, 4, "infer") == 1 and busy_ranks("dp", 3) == 3


def _demo_runs(world: int, layers: int = 6, heads: int = 6) -> set[str]:
    return set(runnable(world, layers, heads))


def test_the_demo_runs_synchronous_trainers_that_split_tiny_evenly():
    assert _demo_runs(3) == {"dp", "fsdp", "syncps", "mp", "pp", "tp"}  # 6 layers, 6 heads over 3
    assert _demo_runs(4) == {"dp", "fsdp", "syncps", "mp"}  # edp is asynchronous; ep, sp do not train
    assert _demo_runs(4, layers=8) == {"dp", "fsdp", "syncps", "mp", "pp"}
    assert _demo_runs(4, layers=8, heads=4) == {"dp", "fsdp", "syncps", "mp", "pp", "tp"}  # tiny8, the demo's


def test_the_name_scan_catches_a_literal():
    assert NAME_TEST.search('if strategy == "pp":')
    assert NAME_TEST.search("if tr.strategy in ('pp', 'mp'):")
    assert NAME_TEST.search('if strategy != "pp":')
    assert not NAME_TEST.search('if info.splits == "layers":')
    assert NAME_TUPLE.search('REPLICATED = ("dp", "syncps", "edp")')
    assert not NAME_TUPLE.search('if info.splits in ("batch", "sequence"):')


def test_the_planner_dispatches_on_traits_not_strategy_names():
    files = sorted((ROOT / "smoltrain" / "planner").glob("*.py")) + [ROOT / "smoltrain/strategies/__init__.py"]
    hits = [
        f"{f.relative_to(ROOT)}:{i}: {line.strip()}"
        for f in files
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if NAME_TEST.search(line) or NAME_TUPLE.search(line)
    ]
    assert not hits, "strategy-name literals (use a registry trait):\n" + "\n".join(hits)
