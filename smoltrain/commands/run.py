"""`smoltrain run`: train the small GPT with one strategy, locally or across the inventory.

This module parses the arguments (and resolves --mesh); smoltrain.run.launch runs them."""

from __future__ import annotations

from smolnet.errors import UsageError
from smoltrain import registry, validate


def add_arguments(p) -> None:
    p.add_argument("--strategy", help=", ".join(registry.names(trainable=True)))
    p.add_argument(
        "--mesh", metavar="AXIS=N,...|auto", help="strategies along mesh axes, e.g. dp=2,tp=2; auto: the plan's pick"
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--local", type=validate.RANKS, metavar="N", help="run N worker processes on loopback")
    where.add_argument("-i", "--inventory", help="run one worker per `cluster` host of this inventory")
    p.add_argument("--backend", default="socket", choices=("socket", "torch"))
    p.add_argument(
        "--model", default="tiny", help="built-in model name, a .json shape or a Hugging Face folder (default tiny)"
    )
    p.add_argument(
        "--data",
        help="text file or folder (default: this Python's standard library sources); with a Hugging Face "
        "--model also .jsonl chats or prompt/completion pairs",
    )
    lora = p.add_argument_group("LoRA (a Hugging Face --model): adapters train, the base stays frozen")
    lora.add_argument("--lora-rank", type=validate.LORA_RANK, metavar="R", help="adapter rank (off by default)")
    lora.add_argument("--lora-alpha", type=validate.LORA_ALPHA, default=16.0, help="scale alpha/R (default 16)")
    lora.add_argument(
        "--lora-dropout", type=validate.DROPOUT, default=0.0, help="dropout on the adapters' input (default 0)"
    )
    lora.add_argument("--lora-targets", help="layers to adapt, e.g. q_proj,v_proj (default: q_proj,v_proj; c_attn)")
    lora.add_argument("--quantize", choices=("int8", "q4"), help="a frozen base held int8 or q4 (QLoRA; needs LoRA)")
    p.add_argument(
        "--checkpoint-activations",
        action="store_true",
        help="activation checkpointing: each block keeps its input only and reruns its forward in backward",
    )
    p.add_argument("--steps", type=validate.STEPS, default=20)
    p.add_argument("--batch", type=validate.BATCH, default=8, help="global batch, in sequences")
    p.add_argument("--seq", type=validate.SEQ, default=64, help="sequence length in bytes (tokens)")
    p.add_argument("--lr", type=validate.LR, default=1e-3)
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"), help="(diloco: the inner one)")
    p.add_argument(
        "--eval-every", type=validate.count(10**9, lo=0), default=0, metavar="K", help="held-out loss every K steps"
    )
    from smoltrain.planner.diloco import add_arguments as outer_arguments

    outer_arguments(p, run=True)
    p.add_argument("--seed", type=validate.SEED, default=0)
    p.add_argument("--microbatches", type=validate.MICROBATCHES, default=4, help="pp microbatches (default 4)")
    p.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b"), help="pp schedule")
    p.add_argument("--shares", help="dp/fsdp per-rank batch shares by hand, e.g. 2,1,1 (see --placement)")
    p.add_argument(
        "--placement",
        help="even, auto (split by measured speed; the default when a compute report "
        "is available), or a placement / plan JSON to run exactly",
    )
    p.add_argument("--compute", help="compute report, smoltrain.compute/1 (default reports/compute.json if present)")
    p.add_argument("--checkpoint-dir", help="write checkpoints here (state dicts, safetensors)")
    p.add_argument(
        "--checkpoint-every", type=validate.count(10**9, lo=0), default=0, help="also checkpoint every K steps"
    )
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    p.add_argument("--json", help="write the run report (smoltrain.run/1) here")
    p.add_argument("--out", default="reports", help="folder for the loss-curve PNG (default reports/)")
    p.add_argument("--links", help="links.json for the plan shown before the run")
    p.add_argument("--secret-file", help="cluster secret (default ~/.config/smolcluster/secret, created if missing)")
    p.add_argument(
        "--barrier-timeout",
        type=validate.SECONDS,
        default=30.0,
        help="syncps/edp/diloco: drop a worker this late (diloco: or half the round, if longer)",
    )
    p.add_argument(
        "--timeout",
        type=validate.SECONDS,
        default=120.0,
        help="give up after this long without word from workers (a silent peer: half of it)",
    )
    p.add_argument(
        "--pace",
        type=validate.seconds(3600, zero=True),
        default=0.0,
        help="make each step last at least this many seconds (demos)",
    )
    p.add_argument("--print-torchrun", action="store_true", help="print torchrun command lines and exit")
    p.add_argument("--external", action="store_true", help="start no workers; wait for them (e.g. from torchrun)")
    p.add_argument(
        "--control-port", type=validate.PORT, default=0, help="port of the control channel (default: any free)"
    )
    p.add_argument("--device", default="cpu", help="--local: torch device of every worker (cpu, cuda, mps, auto)")
    p.add_argument(
        "--dtype", default="fp32", help="fp32, or bf16: bf16 matmuls with fp32 master weights and optimizer state"
    )
    p.add_argument(
        "--threads",
        type=validate.THREADS,
        help="--local: torch threads per rank (default: this machine's CPUs / ranks)",
    )
    p.add_argument(
        "--kernels",
        choices=("auto", "native", "kleidiai", "torch"),
        help="kernels of quantised layers on every rank (default auto: the fastest the host has; docs/machine.md)",
    )
    p.add_argument(
        "--data-cap-mb",
        type=validate.real(0, 256, lo_open=True),
        default=2.0,
        help="use at most this much of the corpus",
    )
    p.add_argument(
        "--heartbeat",
        type=validate.seconds(600),
        default=1.0,
        help="seconds between controller<->worker heartbeats; 5 missed = stopped or cut off",
    )
    p.add_argument(
        "--keep-checkpoints", type=validate.count(10**4), default=3, help="keep the newest N complete checkpoints"
    )
    p.add_argument(
        "--integrity",
        default="header",
        choices=("header", "full"),
        help="rank frames: MAC over every header (default) or over whole frames",
    )


def mesh_argument(args) -> str | None:
    """--mesh: sets args.strategy to the strategy along its model axis; returns the mesh text for
    a 2-D mesh, None for --strategy or a 1-D mesh (which is that strategy)."""
    if args.mesh is None:
        if not args.strategy:
            raise UsageError("give --strategy S or --mesh AXIS=N[,AXIS=N...]")
        return None
    if args.strategy:
        raise UsageError("give --strategy or --mesh, not both (--strategy S is the mesh S=world)")
    from smoltrain.mesh import parse

    if getattr(args, "lora_rank", None) is not None:  # what a mesh's plan counts under LoRA
        from smoltrain.finetune.tuning import from_options
        from smoltrain.planner.request import model_of

        args.tuning = from_options(model_of(args.model), vars(args))
    if args.mesh == "auto":  # the plan's pick (planner.mesh_search.for_run), and its hosts in rank order
        from smoltrain.planner.mesh_search import for_run

        args.mesh, args.mesh_hosts, line = for_run(args)
        print(line, flush=True)
    m = parse(args.mesh, args.local)
    args.strategy, data, inner = m.roles()
    return m.text() if data or inner else None


def run(args) -> int:
    from smoltrain.run.launch import launch
    from smoltrain.run.preflight import EarlyReport

    with EarlyReport(args) as early:  # a run that fails before its controller takes over still reports
        return launch(args, early, mesh_argument(args))
