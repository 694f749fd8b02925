"""smoltrain's documents (plan, run, bench, compare, calibration, compute, generate, serve plan) checked
against the JSON Schemas in smoltrain/schemas/, with smolnet's checker."""

from __future__ import annotations

from smolnet.schema import SchemaError, check, load_schema, schema_errors
from smolnet.schema import check_any as _check_any

PLAN = "smoltrain.plan/1"
PLANS = "smoltrain.plans/1"
RUN = "smoltrain.run/1"
BENCH = "smoltrain.bench/1"
COMPARE = "smoltrain.compare/1"
CALIBRATION = "smoltrain.calibration/1"
COMPUTE = "smoltrain.compute/1"
GENERATE = "smoltrain.generate/1"
SERVEPLAN = "smoltrain.serveplan/1"
MESHPLAN = "smoltrain.meshplan/1"
ALL = (PLAN, PLANS, RUN, BENCH, COMPARE, CALIBRATION, COMPUTE, GENERATE, SERVEPLAN, MESHPLAN)

__all__ = [
    "SchemaError",
    "check",
    "check_any",
    "load_schema",
    "schema_errors",
    *["PLAN", "PLANS", "RUN", "BENCH", "COMPARE", "CALIBRATION", "COMPUTE", "GENERATE", "SERVEPLAN", "MESHPLAN", "ALL"],
]


def check_any(doc, origin: str = "document"):
    """Validate a smolnet or smoltrain document against the schema its `schema` field names."""
    return _check_any(doc, origin, ("smolnet", "smoltrain"))
