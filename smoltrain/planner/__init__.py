"""Predict, before anything runs, the bytes each strategy puts on each link, the time per
step and what limits it (capacity, memory bandwidth, compute, link bandwidth or latency)."""

from smoltrain.planner.plan import PLAN_SCHEMA, make_plan
from smoltrain.planner.traffic import MODES, STRATEGIES

__all__ = ["PLAN_SCHEMA", "MODES", "STRATEGIES", "make_plan"]
