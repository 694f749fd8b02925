"""The typed run contract and the strategy registry: round trips, refusals, one source of traits."""

import importlib
import json

import pytest

from smolnet.errors import UsageError
from smoltrain import registry
from smoltrain.models.spec import get_model
from smoltrain.run.config import ConfigError, RunConfig


def _cfg(**kw) -> RunConfig:
    base = dict(
        strategy="pp",
        backend="socket",
        model=get_model("tiny"),
        steps=5,
        batch=8,
        seq=32,
        lr=1e-3,
        seed=3,
        names=("a", "b"),
        devices=("cpu", "cpu"),
        shares=(2.0, 1.0),
        addrs=("127.0.0.1", "127.0.0.1"),
    )
    base.update(kw)
    return RunConfig(**base)


def test_round_trip_over_json():
    cfg = _cfg(checkpoint_dir="/tmp/x", data=None)
    back = RunConfig.from_wire(json.loads(json.dumps(cfg.to_wire())))
    assert back == cfg
    assert back.world_size == 2 and back.model.layers == cfg.model.layers and back.shares == (2.0, 1.0)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("steps", "5", "steps must be int"),
        ("lr", "fast", "lr must be float"),
        ("names", "ab", "names must be a list"),
        ("names", [1, 2], "bad entry"),
        ("model", 7, "model shape"),
        ("strategy", None, "must not be null"),
        ("version", 99, "version 99"),
    ],
)
def test_bad_field_is_named(field, value, message):
    doc = _cfg().to_wire()
    doc[field] = value
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_wire(doc)


def test_missing_and_unknown_fields_are_refused():
    doc = _cfg().to_wire()
    del doc["batch"]
    with pytest.raises(ConfigError, match="missing field 'batch'"):
        RunConfig.from_wire(doc)
    doc = dict(_cfg().to_wire(), secret="x")
    with pytest.raises(ConfigError, match="unknown field"):
        RunConfig.from_wire(doc)


def test_int_is_accepted_where_float_is_declared():
    doc = dict(_cfg().to_wire(), lr=1)
    assert RunConfig.from_wire(doc).lr == 1.0 and isinstance(RunConfig.from_wire(doc).lr, float)


def test_report_view_leaves_out_where_ranks_met():
    view = _cfg().report_view()
    assert "addrs" not in view and "port" not in view and view["model"] == "tiny"


def test_every_trainable_strategy_has_its_module_and_traits():
    for name in registry.names(trainable=True):
        info = registry.get(name)
        mod = importlib.import_module(f"smoltrain.strategies.{info.module}")
        assert mod.STRATEGY is not None
        assert info.checkpoint_parts(3) == (["server"] if info.parameter_server else ["rank0", "rank1", "rank2"])
    assert set(registry.names()) - set(registry.names(trainable=True)) == {"ep", "sp"}


def test_planner_models_every_registered_strategy():
    from smoltrain.planner.plan import make_plan
    from smoltrain.planner.traffic import STRATEGIES

    assert tuple(STRATEGIES) == registry.names()
    for name in registry.names():
        model = "mixtral-8x7b" if name == "ep" else "llama-3.2-1b"
        plan = make_plan(strategy=name, model=get_model(model), world=2, seq=64, batch=8)
        assert plan["strategy"] == name and plan["bytes_per_step"] > 0


def test_unknown_or_plan_only_strategy_is_refused_for_training():
    with pytest.raises(UsageError, match="unknown strategy 'zz'"):
        registry.get("zz")
    with pytest.raises(UsageError, match="choose from dp, fsdp"):
        registry.get("sp", trainable=True)
