"""Every document the project writes has a JSON Schema in its package; each one rejects a
document missing any field it requires, and readers refuse bad documents in one line."""

from __future__ import annotations

import copy
import json
from importlib import resources

import pytest

from smolnet import report
from smolnet.errors import UsageError
from smolnet.files import read_json
from smolnet.schema import SchemaError, check, load_schema, schema_errors
from smoltrain import schema as ts

LINK = {
    "src": "a",
    "dst": "b",
    "status": "ok",
    "throughput_mbit": 941.2,
    "retransmits": 0,
    "rtt_us": {"min": 80.0, "p50": 95.0, "p90": 120.0, "p99": 180.0, "max": 400.0},
    "mtu_effective": 1500,
    "mtu_configured": 1500,
    "ceiling_mbit": 941.5,
    "method": "iperf3",
    "warnings": [],
    "error": None,
}
HOST = {
    "name": "a",
    "address": "10.45.0.1",
    "iface": "eth0",
    "mtu_configured": 1500,
    "link_rate_mbit": 1000,
    "device": "pi5",
    "status": "ok",
    "error": None,
}
PLACEMENT = {"mode": "auto", "order": ["a", "b"], "layers": [[0, 4], [4, 6]]}
EXAMPLES = {
    "smolnet.links/1": {
        "schema": "smolnet.links/1",
        "created": "2026-12-02T10:00:00Z",
        "settings": {"duration_s": 3.0, "backend": "iperf3"},
        "hosts": [HOST, dict(HOST, name="b")],
        "links": [LINK, dict(LINK, src="b", dst="a")],
    },
    "smolnet.facts/1": {
        "schema": "smolnet.facts/1",
        "hosts": [
            dict(
                HOST,
                facts={
                    "hostname": "a",
                    "cpus_logical": 4,
                    "memory_bytes": 1 << 30,
                    "interfaces": [{"name": "eth0", "mtu": 1500}],
                },
            )
        ],
    },
    ts.BENCH: {
        "schema": ts.BENCH,
        "op": "allreduce",
        "backend": "socket",
        "world_size": 2,
        "bytes": 4096,
        "iters": 5,
        "seconds_p50": 0.001,
        "algbw_gbps": 0.004,
        "busbw_gbps": 0.004,
    },
    ts.RUN: {
        "schema": ts.RUN,
        "strategy": "dp",
        "backend": "socket",
        "world_size": 2,
        "config": {},
        "steps": [
            {
                "step": 0,
                "loss": 5.5,
                "step_s": 0.1,
                "comm_s": 0.01,
                "tokens": 512,
                "ranks": [{"rank": 0, "compute_s": 0.05, "comm_s": 0.01, "wait_s": 0.0}],
            }
        ],
        "bytes": [{"src": "a", "dst": "b", "bytes": 100}],
        "events": [{"step": 0, "kind": "join", "who": "b"}],
        "final_loss": 5.5,
        "tokens_per_s": 5120.0,
        "status": "complete",
        "error": None,
    },
    ts.CALIBRATION: {
        "schema": ts.CALIBRATION,
        "created": "2026-12-02T10:00:00Z",
        "host": "a",
        "flops_fp32": 1e10,
        "mem_bw": 1e9,
        "train": {"model": "tiny", "batch": 8, "seq": 64, "step_s": 0.1, "flops": 1e9},
    },
    ts.COMPUTE: {
        "schema": ts.COMPUTE,
        "created": "2026-12-02T10:00:00Z",
        "hosts": [
            {
                "name": "a",
                "machine_id": "m1",
                "cores": 4,
                "cpu_limit_cores": None,
                "flops": {"fp32": 1e10, "bf16": 2e10},
                "mem_bw_bytes_s": 1e9,
                "train_step": [{"model": "tiny", "batch": 8, "seq": 64, "seconds": 0.1}],
                "usable_memory_bytes": 1 << 30,
            }
        ],
    },
    ts.GENERATE: {
        "schema": ts.GENERATE,
        "strategy": "pp",
        "world_size": 2,
        "model": "tiny",
        "placement": PLACEMENT,
        "prompt_ids": [1, 2, 3],
        "output_ids": [4, 5],
        "text": None,
        "prefill": {"tokens": 3, "seconds": 0.01, "tokens_per_s": 300.0},
        "decode": {"tokens": 2, "seconds": 0.02, "tokens_per_s": 100.0, "bytes_per_token": 512},
        "ttft_s": 0.01,
        "links": [{"src": "a", "dst": "b", "bytes": 1024}],
        "plan": {},
    },
}


def _serveplan():
    from smoltrain.models.spec import get_model
    from smoltrain.planner import serve
    from smoltrain.planner.links import from_class
    from smoltrain.planner.ranks import resolve_ranks

    return serve.plan(get_model("tiny"), resolve_ranks(2), from_class("1gbe"), concurrency=4)


def _plan():
    from smoltrain.models.spec import get_model
    from smoltrain.planner.request import PlanRequest, build_plan

    return build_plan(PlanRequest("dp", get_model("tiny"), world=2, placement="even", calibration=False, local=True))


def _meshplan():
    from smoltrain.planner import mesh_search
    from smoltrain.planner.request import PlanRequest, resolve

    req = mesh_search.mesh_request(PlanRequest("tp", "tiny", world=4, calibration=False, compute=False, local=True))
    return mesh_search.explicit(req, resolve(req), "dp=2,tp=2", "even")


def _examples() -> dict:
    ex = copy.deepcopy(EXAMPLES)
    plan = _plan()  # the real writer's output
    ex[ts.MESHPLAN] = _meshplan()  # the real writer's output
    ex[ts.PLAN] = plan
    ex[ts.SERVEPLAN] = _serveplan()  # the real writer's output
    ex[ts.PLANS] = {"schema": ts.PLANS, "ranking": ["dp"], "plans": [plan], "skipped": []}
    pair = {"predicted": 1.0, "measured": 1.1}
    ex[ts.COMPARE] = {
        "schema": ts.COMPARE,
        "strategy": "dp",
        "world_size": 2,
        "steps": 3,
        "links": [
            {
                "src": "a",
                "dst": "b",
                "predicted_bytes_per_step": 10.0,
                "measured_bytes_per_step": 10.0,
                "ratio": 1.0,
                "within_2pct": True,
            }
        ],
        "bytes_within_2pct": True,
        "step_s": pair,
        "comm_s": pair,
        "tokens_per_s": pair,
        "plan": plan,
    }
    return ex


def _resolve(schema: dict, node: dict) -> dict:
    while "$ref" in node:
        node = schema["$defs"][node["$ref"].rsplit("/", 1)[1]]
    return node


def _required_paths(schema: dict, node: dict, doc, path=()):
    """Every (path to a required key) that is present in doc, at any depth."""
    node = _resolve(schema, node)
    if isinstance(doc, dict):
        for key in node.get("required", []):
            if key in doc:
                yield path + (key,)
        for key, sub in node.get("properties", {}).items():
            if key in doc:
                yield from _required_paths(schema, sub, doc[key], path + (key,))
    elif isinstance(doc, list) and isinstance(node.get("items"), dict):
        for i, item in enumerate(doc[:1]):
            yield from _required_paths(schema, node["items"], item, path + (i,))


def _drop(doc, path):
    d = copy.deepcopy(doc)
    cur = d
    for p in path[:-1]:
        cur = cur[p]
    del cur[path[-1]]
    return d


SCHEMAS = ["smolnet.links/1", "smolnet.facts/1", *ts.ALL]


def test_every_shipped_schema_file_is_named_and_valid():
    from jsonschema import Draft202012Validator

    files = {
        f"{pkg}/{p.name}"
        for pkg in ("smolnet", "smoltrain")
        for p in (resources.files(pkg) / "schemas").iterdir()
        if p.name.endswith(".json")
    }
    names = {f"{n.split('.')[0]}/{n.split('.', 1)[1].replace('/', '-')}.json" for n in SCHEMAS}
    assert files == names
    for name in SCHEMAS:
        s = load_schema(name)
        Draft202012Validator.check_schema(s)
        assert s["$id"] == name and s["properties"]["schema"] == {"const": name}


@pytest.mark.parametrize("name", SCHEMAS)
def test_schema_accepts_the_example_and_rejects_each_missing_required_field(name):
    doc = _examples()[name]
    assert schema_errors(doc, name) == []
    paths = list(_required_paths(load_schema(name), load_schema(name), doc))
    assert len(paths) >= 3, paths
    for path in paths:
        bad = _drop(doc, path)
        errs = schema_errors(bad, name)
        assert errs, f"{name}: dropping {'/'.join(map(str, path))} still validates"
        with pytest.raises(SchemaError) as e:
            check(bad, name, "x.json")
        assert "\n" not in str(e.value) and str(e.value).startswith("x.json: ")


def test_wrong_types_and_values_are_rejected():
    ex = _examples()
    bad = copy.deepcopy(ex["smolnet.links/1"])
    bad["links"][0]["status"] = "ok"
    bad["links"][0]["warnings"] = ["asymmetric"]  # ok with a warning
    assert schema_errors(bad, "smolnet.links/1")
    bad = copy.deepcopy(ex[ts.RUN])
    bad["events"][0]["kind"] = "explode"
    assert schema_errors(bad, ts.RUN)
    bad = copy.deepcopy(ex[ts.PLAN])
    bad["bottleneck"] = "vibes"
    assert schema_errors(bad, ts.PLAN)
    bad = copy.deepcopy(ex[ts.BENCH])
    bad["schema"] = "smoltrain.bench/2"
    with pytest.raises(SchemaError, match="not a smoltrain.bench/1 document"):
        check(bad, ts.BENCH, "b.json")


def test_links_validator_keeps_the_checks_a_schema_cannot_say():
    good = EXAMPLES["smolnet.links/1"]
    assert report.validate_report(good) == []
    d = copy.deepcopy(good)
    d["links"].pop()
    assert any("missing links" in e for e in report.validate_report(d))
    d = copy.deepcopy(good)
    d["links"][0]["dst"] = "a"
    assert report.validate_report(d)


def test_readers_refuse_a_bad_document_in_one_line(tmp_path):
    p = tmp_path / "links.json"
    doc = copy.deepcopy(EXAMPLES["smolnet.links/1"])
    del doc["links"][0]["rtt_us"]
    p.write_text(json.dumps(doc))
    with pytest.raises(UsageError) as e:
        read_json(p, "links report", schema="smolnet.links/1")
    msg = str(e.value)
    assert "\n" not in msg and str(p) in msg and "rtt_us" in msg and e.value.code == 2
    assert read_json(p, "links report") == doc  # no schema: parsed only


def test_plan_cli_rejects_a_links_report_that_breaks_the_schema(tmp_path, capsys):
    from smoltrain.cli import main

    doc = copy.deepcopy(EXAMPLES["smolnet.links/1"])
    doc["links"][0]["status"] = "fine"
    p = tmp_path / "links.json"
    p.write_text(json.dumps(doc))
    rc = main(["plan", "--strategy", "dp", "--links", str(p), "--world", "2"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "smolnet.links/1" in err and "status" in err


def test_unknown_schema_name_is_one_line():
    with pytest.raises(SchemaError, match="no known 'schema' field"):
        ts.check_any({"schema": "nobody.thing/1"})
    with pytest.raises(SchemaError, match="no schema"):
        load_schema("smolnet.nothing/9")
