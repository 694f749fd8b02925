"""Training runs: the controller, its workers and what they share."""

# what a rank imports (torch with them): `python -m smoltrain worker` and the inference ranks
# (smoltrain.infer.worker) fork from a warm server per host that imported them once
# (smolnet.warm), not ~1.5 s of CPU each. calibrate's probes start through the same list, so the
# runs and generates after a calibrate find each host's server warm: one list, one server (a
# second list cost the demo's 0.15-core host another import of torch, ~10 s, before its first
# generate; the inference modules add 0.01 s of CPU to the import).
WORKER_IMPORTS = [
    "smoltrain.cli",
    "smoltrain.commands.worker",
    "smoltrain.run.worker",
    "smoltrain.infer.batching",
    "smoltrain.infer.engine",
    "smoltrain.infer.runner",
]
