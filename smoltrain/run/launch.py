"""Launch a training run (`smoltrain run`): check the arguments against the model and the
strategy, plan and place the ranks, start the controller and its workers, and report.

commands/run.py parses the arguments and calls `launch`; nothing here defines an option.
"""

from __future__ import annotations

import os
import tempfile

from smolnet.errors import UsageError
from smoltrain import registry
from smoltrain.planner.tuning import LORA_STRATEGIES  # the plan's list: the others move frozen parameters too


def _shares(text: str | None, hosts) -> list[float] | None:
    if not text:
        return None
    if text == "auto":
        raise UsageError("--shares auto is gone: use --placement auto (split by measured speed)")
    try:
        out = [float(x) for x in text.split(",")]
    except ValueError:
        raise UsageError(f"--shares {text}: expected numbers like 2,1,1") from None
    if any(x <= 0 for x in out):
        raise UsageError("--shares must all be positive")
    return out


def machine_settings(args, hosts, world: int) -> dict[str, int]:
    """Threads per rank name, --dtype and the devices checked here before any worker starts (contract §9)."""
    from smoltrain import host
    from smoltrain.run.threads import inventory_threads, local_threads

    if args.dtype not in ("fp32", "bf16"):
        raise UsageError(f"--dtype {args.dtype}: choose from fp32, bf16 (bf16 keeps fp32 master weights)")
    if hosts is None:
        if args.threads is not None and args.threads < 1:
            raise UsageError(f"--threads must be at least 1, got {args.threads}")
        host.check_dtype(args.dtype, host.resolve_device(args.device))
        return {f"rank{r}": n for r, n in enumerate(local_threads(args.threads, world))}
    for h in hosts:
        if h.local and h.torch_device != "auto":
            host.check_dtype(args.dtype, host.resolve_device(h.torch_device))
    from smoltrain.run.threads import cap_threads

    return {h.name: n for h, n in zip(hosts, inventory_threads(hosts, cap_threads(hosts, args.compute)))}


def check_outer(args, outer: bool) -> None:
    """The outer-step flags (diloco, or a mesh's diloco axis: `outer`) against the strategy and the
    backend: one line before anything starts."""
    from smoltrain.comm import SYNC_DTYPES
    from smoltrain.planner.diloco import check_args

    check_args(args, outer)
    if outer and args.sync_dtype not in SYNC_DTYPES[args.backend]:
        raise UsageError(
            f"--sync-dtype {args.sync_dtype}: the {args.backend} backend cannot carry it "
            f"(it carries {', '.join(SYNC_DTYPES[args.backend])}; int8 needs --backend socket)"
        )


def outer_settings(cfg, args, plan: dict | None, console):
    """H (the plan's without --inner-steps) and the outer optimizer for this run's length."""
    from smoltrain.planner.diloco import FALLBACK_INNER_STEPS, outer_optimizer

    h = cfg.inner_steps
    if not h:
        h = (plan or {}).get("inner_steps") or FALLBACK_INNER_STEPS
        why = f"the plan's, {plan['inner_steps_source']}" if plan else "no plan to pick it from"
        console.print(f"diloco: {h} inner steps per outer step ({why})")
    lr, mu, why = outer_optimizer(args.outer_lr, args.outer_momentum, cfg.steps, h)
    console.print(f"diloco: outer lr {lr:g}, momentum {mu:g} ({why})")
    if cfg.placement is not None:  # the run report's placement says how unequal hosts meet at the sync
        cfg.placement["sync"] = OUTER_SYNC + (OUTER_PACED if cfg.placement.get("mode") == "auto" else "")
    return cfg.replace(inner_steps=h, outer_lr=lr, outer_momentum=mu)


OUTER_SYNC = (
    "batch shares by measured speed, so every rank ends its H inner steps together; "
    "each pseudo-gradient weighted by the tokens its rank trained on"
)


OUTER_PACED = (
    "; re-balanced at every outer step from each rank's measured pace (tokens per second of its "
    "inner steps; outer_steps[].ranks[].tokens)"
)


def lora_settings(args, spec) -> dict | None:
    """The checkpoint checked (tensors as config.json says, a tokenizer) and the LoRA settings,
    checked against the model's layers: a wrong target or rank exits 2 before anything starts."""
    import os

    if not spec.source:
        if args.lora_rank is not None:
            raise UsageError("--lora-rank needs a Hugging Face checkpoint folder as --model")
        return None
    from smoltrain.models.hf import Checkpoint, CheckpointError

    if not os.path.isfile(os.path.join(spec.source, "tokenizer.json")):
        raise UsageError(f"--model {spec.source}: no tokenizer.json (the run tokenizes --data with it)")
    try:
        Checkpoint(spec.source).check()
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    if args.lora_rank is None:
        return None
    if args.strategy not in LORA_STRATEGIES:
        raise UsageError(f"--lora-rank with --strategy {args.strategy}: LoRA trains with {', '.join(LORA_STRATEGIES)}")
    from smoltrain.finetune.lora import LoraConfig, parse_targets
    from smoltrain.models.causal import trainable_params

    cfg = LoraConfig(args.lora_rank, args.lora_alpha, args.lora_dropout, parse_targets(args.lora_targets))
    trainable_params(spec, cfg.to_dict())  # LoraError (exit 2) names a missing target or a rank too large
    return cfg.to_dict()


def training_data(spec, data: str | None, cfg) -> tuple[bytes, str]:
    """What the controller sends every rank, and its digest: the corpus bytes for a built-in model;
    for a checkpoint, finetune.data's examples (the default corpus tokenized like any folder)."""
    from smoltrain.models.data import corpus_digest, load_corpus

    if not spec.source:
        corpus = load_corpus(data, cfg.data_cap)
        return corpus, corpus_digest(corpus)
    import sysconfig

    from smoltrain.finetune import data as finetune_data

    ds = finetune_data.load(data or sysconfig.get_paths()["stdlib"], spec.source, cfg.seq, cfg.data_cap)
    finetune_data.Batches(ds, cfg.batch, cfg.seq, cfg.seed, cfg.eval_every > 0)  # too few examples: exit 2 here
    return ds.to_bytes(), ds.digest()


def launch(args, early, mesh: str | None) -> int:
    """Check, plan, place and start the run `args` describe, then report it (`early` reports a
    run that fails before its controller takes over). `mesh`: a 2-D mesh's text (commands.run)."""
    from rich.console import Console

    from smolnet.secret import ensure_secret
    from smoltrain.models.spec import ModelSpecError, get_model

    console = Console(stderr=False)
    info = registry.get(args.strategy, trainable=True)
    from smoltrain.mesh import parse
    from smoltrain.run import preflight

    outer = info.outer_steps or bool(mesh and parse(mesh, None).size("diloco") > 1)  # diloco, or its mesh axis
    check_outer(args, outer)
    if args.local is None and not args.inventory:
        raise UsageError("give --local N or -i INVENTORY")
    try:
        spec = get_model(args.model)
    except ModelSpecError as e:
        raise UsageError(str(e)) from None
    lora = lora_settings(args, spec)
    from smoltrain.finetune.tuning import check_quantize

    check_quantize(args.quantize, spec, lora, args.strategy, mesh)

    from smoltrain.run.config import RunConfig
    from smoltrain.run.controller import Controller, rank_placements, route_source
    from smoltrain.run.preflight import check_usage
    from smoltrain.run.report import plot_losses, write_json

    placements, hosts = rank_placements(args.local, args.inventory)
    if getattr(args, "mesh_hosts", None):  # run --mesh auto: rank r on the plan's r-th host
        placements = [next(p for p in placements if p.name == n) for n in args.mesh_hosts]
        hosts = [p.host for p in placements]
    threads = machine_settings(args, hosts, len(placements))
    want = getattr(args, "kernels", None) or os.environ.get("SMOL_KERNELS")
    if not args.inventory and want not in (None, "auto"):  # ranks on this machine: refuse here a
        from smoltrain.models import backends  # backend it cannot run (auto always runs one)

        backends.select(want)
    early.world, early.names = len(placements), [p.name for p in placements]
    data = os.path.abspath(args.data) if args.data else None

    def config(placements, placed=None):
        return RunConfig(
            strategy=args.strategy,
            backend=args.backend,
            model=spec,
            data=data,
            data_cap=int(args.data_cap_mb * (1 << 20)),
            steps=args.steps,
            batch=args.batch,
            seq=args.seq,
            lr=args.lr,
            seed=args.seed,
            microbatches=args.microbatches,
            schedule=args.schedule,
            shares=_shares(args.shares, hosts),
            checkpoint_every=args.checkpoint_every,
            barrier_timeout=args.barrier_timeout,
            # workers give up on a silent peer first, so the error names the link, not just "silence"
            timeout=max(10.0, args.timeout / 2),
            pace=args.pace,
            names=tuple(p.name for p in placements),
            devices=tuple(p.host.torch_device if p.host else args.device for p in placements),
            control_port=args.control_port,
            heartbeat_s=args.heartbeat,
            keep_checkpoints=args.keep_checkpoints,
            integrity=args.integrity,
            placement=placed,
            dtype=args.dtype,
            threads=tuple(threads.get(p.name, 0) for p in placements),
            optimizer=args.optimizer,
            eval_every=args.eval_every,
            inner_steps=args.inner_steps or 0,
            sync_dtype=args.sync_dtype,
            kernels=getattr(args, "kernels", None) or "auto",
            lora=lora,
            mesh=mesh,
            checkpoint_activations=args.checkpoint_activations,
            quantize=args.quantize,
        )

    check_usage(config(placements))  # what the strategy or the model cannot take, before the planner looks
    from smoltrain.run.planning import RunPlan, plan_run

    if mesh:  # a mesh runs `plan --mesh`'s uneven cuts where it finds them (docs/mesh.md), else even splits
        from smoltrain.planner.mesh_search import run_placement

        placed, _ = run_placement(args, mesh)
        planned = RunPlan(placed, None)
        cuts = ", ".join(f"{k} {placed[k]}" for k in ("layers", "rows") if k in placed) if placed else "even splits"
        console.print(f"mesh {mesh}: {args.strategy} along its axis, {cuts} (its plan: smoltrain plan --mesh)")
    else:
        planned = plan_run(args, spec, [p.name for p in placements], hosts, console)
    placed = planned.placement
    if placed is not None:  # rank r runs on placed["order"][r]; hosts the placement leaves out get no rank
        by_name = {p.name: p for p in placements}
        placements = [by_name[n] for n in placed["order"]]
        hosts = [p.host for p in placements] if hosts is not None else None
    world = len(placements)
    early.world, early.names = world, [p.name for p in placements]
    cfg = config(placements, placed)
    check_usage(cfg)

    corpus, digest = training_data(spec, data, cfg)
    cfg = cfg.replace(data_bytes=len(corpus), data_digest=digest)
    early.cfg = cfg

    if args.checkpoint_dir:
        cfg = cfg.replace(checkpoint_dir=os.path.abspath(args.checkpoint_dir))
    if args.resume:
        if not args.checkpoint_dir:
            raise UsageError("--resume needs --checkpoint-dir")
        from smoltrain.run import checkpoint

        parts = None if info.elastic else info.checkpoint_parts(world)  # elastic: the members' parts, as marked
        resume = checkpoint.latest(cfg.checkpoint_dir, checkpoint.identity(cfg), parts, all_here=hosts is None)
        if resume.skipped:
            console.print(resume.skipped_line(), style="bold yellow", markup=False, soft_wrap=True)
        if resume.step >= cfg.steps:
            raise UsageError(f"checkpoint is at step {resume.step}, not before --steps {cfg.steps}")
        cfg = early.cfg = cfg.replace(start_step=resume.step, resume_sha256=resume.sha256 or None)
        early.events = [{"step": resume.step, "kind": "resume", "who": "all", "skipped": resume.skipped}]

    # where ranks meet
    if hosts is None:
        from smoltrain.comm.group import free_port_base

        cfg = cfg.replace(coord_addr="127.0.0.1", port=free_port_base(world), addrs=("127.0.0.1",) * world)
        bind = control_addr = "127.0.0.1"
    else:
        from smoltrain.comm.group import inventory_group

        coord, port, addrs = inventory_group(hosts)
        cfg = cfg.replace(coord_addr=coord, port=port, addrs=tuple(addrs))
        control_addr = route_source(hosts[0].cluster_ip)
        bind = control_addr

    if args.print_torchrun:
        sfile = args.secret_file or (hosts[0].secret_file if hosts else "~/.config/smolcluster/secret")
        for r, p in enumerate(placements):
            print(f"# on {p.name} (the worker reads the cluster secret on stdin):")
            print(
                f"torchrun --nnodes {world} --node-rank {r} --nproc-per-node 1 --master-addr {cfg.coord_addr} "
                f"--master-port 29500 -m smoltrain worker --control {control_addr}:7799 --rank {r} < {sfile}"
            )
        where_ = f"--local {world}" if hosts is None else f"-i {args.inventory}"
        print(
            f"# first, on this machine: smoltrain run {f'--mesh {mesh}' if mesh else f'--strategy {args.strategy}'} "
            f"{where_} --backend {args.backend} "
            f"--external --control-port 7799 --secret-file {sfile}"
        )
        return 0

    plan = planned.plan
    if outer:
        cfg = outer_settings(cfg, args, plan, console)
    if args.secret_file or hosts is not None or info.joiners or args.external:
        secret = ensure_secret(
            args.secret_file or (hosts[0].secret_file if hosts else None)
        )  # others (joiners, remote hosts) must know it too
    else:
        import secrets

        secret = secrets.token_hex(32).encode()  # loopback run: a fresh secret for this run only
    preflight.check_outputs(args)
    log_dir = tempfile.mkdtemp(prefix="smoltrain-logs-")
    ctl = Controller(cfg, placements, secret, console, log_dir, external=args.external, corpus=corpus)
    early.handover()  # from here the controller's report (below) says how the run ended
    console.print(
        f"{args.strategy} on {world} rank(s) ({args.backend}), model {spec.name}, "
        f"batch {args.batch}x{args.seq}, steps {cfg.start_step}..{args.steps}, logs {log_dir}"
    )
    ctl.events.extend(early.events)  # resume, with the checkpoints it skipped
    try:
        doc = ctl.run(bind, control_addr, connect_timeout=max(60.0, args.timeout), idle_timeout=args.timeout)
    except (Exception, KeyboardInterrupt) as e:  # the report survives failure and Ctrl-C (exit 1, 130)
        preflight.write_report(args.json, ctl, e, plan, plan_error=planned.error)
        raise
    doc = preflight.write_report(None, ctl, None, doc=doc, plan_error=planned.error)
    import shutil

    shutil.rmtree(log_dir, ignore_errors=True)  # kept only when the run failed
    if placed is not None:
        doc["placement"] = placed
    if plan is not None:
        doc["plan"] = plan
    if args.json:
        write_json(args.json, doc)
    png = os.path.join(args.out, f"run-{args.strategy}-{args.backend}-{world}.png")
    # SMOL_CHARTS=0: no picture (scripts, the test suite): matplotlib's import and one drawing
    # cost a controller about 0.6 s of CPU, most of what it spends
    drawn = os.environ.get("SMOL_CHARTS", "1") != "0"
    if drawn:
        plot_losses(doc, png)
    total = sum(b["bytes"] for b in doc["bytes"])
    console.print(
        f"final loss {doc['final_loss']:.4f}, {doc['tokens_per_s'] or 0:,.0f} tokens/s, "
        f"{total / 1e6:.2f} MB sent in all"
        + (f"; loss curve {png}" if drawn else "")
        + (f"; report {args.json}" if args.json else "")
    )
    return 0
