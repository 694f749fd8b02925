"""Training runs: the controller, its workers and what they share."""

# what `python -m smoltrain worker` imports (torch with them): workers fork from a warm server
# per host that imported them once (smolnet.warm), not ~1.5 s of CPU each. calibrate's probes
# start through the same list, so the runs after a calibrate find each host's server warm.
WORKER_IMPORTS = ["smoltrain.cli", "smoltrain.commands.worker", "smoltrain.run.worker"]
