"""`smoltrain demo`: the orchestration (flow), its stages, the report and its pictures."""
