"""`smoltrain`: planning and training on top of smolnet."""

from __future__ import annotations

from smolnet.cli_dispatch import dispatch

COMMANDS = {
    "plan": ("smoltrain.commands.plan", "predict bytes per token, step time and the bottleneck of a strategy"),
    "run": ("smoltrain.commands.run", "train a small GPT with a parallelism strategy"),
    "bench": ("smoltrain.commands.bench", "benchmark collectives (allreduce) on the transport"),
    "calibrate": ("smoltrain.commands.calibrate", "measure this host's matmul FLOP/s and memory bandwidth"),
    "worker": ("smoltrain.commands.worker", "internal: one rank of a run, started by `smoltrain run`"),
    "generate": ("smoltrain.commands.generate", "generate text with a Hugging Face model split over ranks (pp/tp)"),
    "serve": ("smoltrain.commands.serve", "serve a split Hugging Face model behind the OpenAI HTTP API"),
    "export": ("smoltrain.commands.export", "a `smoltrain run` checkpoint as a Hugging Face folder or LoRA adapter"),
    "demo": ("smoltrain.commands.demo", "walk the whole flow on the built-in cluster"),
}


def main(argv=None) -> int:
    return dispatch("smoltrain", "Plan and train across a small cluster.", COMMANDS, argv)
