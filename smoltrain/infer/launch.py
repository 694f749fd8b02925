"""From command-line options to something that generates: the one-process reference or a Cluster.

Everything that can be checked before a rank starts is checked here: the checkpoint's
architecture and every tensor's name, shape and dtype, the split (pp stages per layer,
tp heads per rank), the world size.
"""

from __future__ import annotations

import os
import secrets
import tempfile
import threading
from dataclasses import dataclass

from smolnet.errors import UsageError
from smoltrain import validate
from smoltrain.finetune.adapter import open_checkpoint
from smoltrain.infer.config import InferConfig
from smoltrain.infer.mesh_layout import decode_plan, layout
from smoltrain.infer.runner import RankDied, Runner
from smoltrain.models.hf import Checkpoint, CheckpointError, load_tokenizer
from smoltrain.models.split import DTYPES, check_tp, even_layers


class LocalRunner(Runner):
    """`--local 1` / `--strategy local`: one process, no network; the reference."""

    def __init__(self, ckpt: Checkpoint, cfg: InferConfig):
        from smoltrain import host
        from smoltrain.infer.batching import Batcher, lead
        from smoltrain.infer.engine import Engine
        from smoltrain.models.stage import Stage

        super().__init__()
        threads, device = host.setup(cfg.rank_threads(0), cfg.rank_device(0), cfg.dtype)
        stage = Stage(
            ckpt,
            0,
            ckpt.config.layers,
            True,
            True,
            dtype=cfg.dtype,
            quantize=cfg.quantize,
            device=device,
            batched=cfg.max_batch > 1,
        )
        self.engine = Engine(stage)
        self.machine = host.rank_facts(stage, threads, device)
        self.batcher = Batcher(cfg.max_batch, 1, self._tokens, self._done)

        def loop():
            try:
                lead(self.engine, self.batcher)
            except Exception as e:  # a bug, not a peer: say so to every open request
                self._fail(f"the model failed: {type(e).__name__}: {e}")

        self.thread = threading.Thread(target=loop, daemon=True)
        self.thread.start()

    def _admit(self, req) -> None:
        self.batcher.submit(req)

    def cancel(self, rid: int) -> None:
        self.batcher.cancel(rid)

    def stats(self) -> list[dict]:
        return [{"stats": dict(self.engine.counters), "links": [], "machine": self.machine}]

    def health(self) -> None:
        if not self.thread.is_alive() and not self.batcher.stopped:
            self._fail(self.dead or "the model's step loop ended")
        if self.dead:
            raise RankDied(self.dead)

    def close(self) -> None:
        self.batcher.stop()
        self.thread.join(30)


@dataclass
class Setup:
    runner: object
    cfg: InferConfig
    ckpt: Checkpoint
    tokenizer: object
    hosts: list | None
    log_dir: str | None
    plan: dict | None = None  # the infer plan whose placement the ranks run


def resolve(args):
    """(strategy, placements, hosts) from --strategy, --local N / -i INVENTORY."""
    from smoltrain.run.controller import rank_placements

    strategy = args.strategy
    placements, hosts = rank_placements(args.local, args.inventory)
    if strategy == "local" and len(placements) > 1:
        placements, hosts = placements[:1], hosts[:1] if hosts else None
    return strategy, placements, hosts


def placed(args, mc, placements, hosts, seq: int):
    """(plan, placements, hosts, layers): the decode placement of planner.request, the ranks
    in its order, each pp stage's [first, last)."""
    from smoltrain.infer.report import decode_plan

    world = len(placements)
    plan = decode_plan(args, mc, world, hosts, seq)
    sec = plan.get("placement") or {}
    if sec.get("order"):
        by = {p.name: p for p in placements}
        placements = [by[n] for n in sec["order"]]
        hosts = [p.host for p in placements] if hosts is not None else None
    if args.strategy == "pp" and sec.get("layers"):
        return plan, placements, hosts, [tuple(x) for x in sec["layers"]]
    return plan, placements, hosts, None


def open_model(args, timeout: float = 120.0, seq: int | None = None, group=None, share: int | None = None) -> Setup:
    """Start the model on --local N / -i INVENTORY, or on `group` (placements, hosts): one replica of
    `serve --replicas`, which always runs as ranks of its own (never in this process); `share`:
    how many --local ranks share this machine's CPUs in all (every replica's); `seq`: the
    longest sequence a request may reach, for the decode plan."""
    model_dir = os.path.abspath(args.model)
    if not os.path.isdir(model_dir):
        raise UsageError(
            f"--model {args.model}: not a folder (a Hugging Face checkpoint: config.json, "
            "*.safetensors, optional tokenizer.json)"
        )
    check_choices(args)
    adapter_dir = os.path.abspath(args.adapter) if getattr(args, "adapter", None) else None
    kernels = getattr(args, "kernels", None) or os.environ.get("SMOL_KERNELS") or "auto"
    if getattr(args, "inventory", None) is None and kernels != "auto":  # ranks on this machine: refuse
        from smoltrain.models import backends  # here what they would (auto always finds one)

        backends.select(kernels)
    strategy, placements, hosts = resolve(args) if group is None else (args.strategy, *group)
    world = len(placements)
    plan = None
    try:
        ckpt = open_checkpoint(model_dir, adapter_dir)
        ckpt.check()
        mc = ckpt.config
        mesh = None
        if getattr(args, "mesh", None):  # pp x tp (infer.meshed); one wide axis: that strategy
            strategy, mesh, layers = layout(args.mesh, world, mc)
            args.strategy = strategy  # the plan and the placement read it
            if mesh:  # its bytes per link, no time (docs/mesh.md)
                plan = decode_plan(mesh, mc, [p.name for p in placements], args.dtype or mc.dtype, args.wire_dtype)
        elif strategy == "tp" and world > 1:
            check_tp(mc, world)
            layers = [(0, mc.layers)] * world
        elif strategy == "pp":
            layers = even_layers(mc.layers, world)
        else:
            layers = [(0, mc.layers)] * world
        if world > 1 and mesh is None:  # where each rank runs, and what the plan says of it
            plan, placements, hosts, cut = placed(args, mc, placements, hosts, seq or min(mc.ctx, 2048))
            layers = cut or layers
        tok = load_tokenizer(model_dir)
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    threads, devices = machine_settings(args, hosts, world, share)  # per rank, in the placement's order
    cfg = InferConfig(
        strategy=strategy if world > 1 else "local",
        backend=args.backend,
        model_dir=model_dir,
        adapter_dir=adapter_dir,
        dtype=args.dtype,
        names=tuple(p.name for p in placements),
        layers=tuple(layers),
        timeout=args.timeout,
        max_batch=getattr(args, "max_batch", 1),  # generate: one request
        quantize=getattr(args, "quantize", None),  # callers that build their own args may leave these out
        wire_dtype=getattr(args, "wire_dtype", None),
        threads=tuple(threads),
        devices=tuple(devices),
        kernels=kernels,
        mesh=mesh,
    )
    if world == 1 and group is None:
        return Setup(LocalRunner(ckpt, cfg), cfg, ckpt, tok, hosts, None, plan)
    from smoltrain.infer.cluster import Cluster
    from smoltrain.run.controller import route_source

    if hosts is None:
        from smoltrain.comm.group import free_port_base

        cfg = _replace(cfg, coord_addr="127.0.0.1", port=free_port_base(world), addrs=("127.0.0.1",) * world)
        bind = control_addr = "127.0.0.1"
        secret = secrets.token_hex(32).encode()  # loopback: a fresh secret for these ranks only
    else:
        from smolnet.secret import ensure_secret
        from smoltrain.comm.group import inventory_group

        coord, port, addrs = inventory_group(hosts)
        cfg = _replace(cfg, coord_addr=coord, port=port, addrs=tuple(addrs))
        bind = control_addr = route_source(hosts[0].cluster_ip)
        secret = ensure_secret(getattr(args, "secret_file", None) or hosts[0].secret_file)
    log_dir = tempfile.mkdtemp(prefix="smoltrain-infer-")
    cluster = Cluster(cfg, placements, secret, log_dir, bind=bind, control_addr=control_addr, own_logs=True)
    try:
        cluster.start(timeout)
        cluster.warm_up(ckpt.config.ctx)
    except BaseException:
        cluster.close()
        raise
    return Setup(cluster, cfg, ckpt, tok, hosts, log_dir, plan)


def check_choices(args) -> None:
    """--dtype, --quantize, --wire-dtype: one line and exit 2 for a name not on the list."""
    from smoltrain.planner.widths import QUANTIZE, WIRE_DTYPES

    for opt, value, ok in (
        ("--dtype", args.dtype, DTYPES),
        ("--quantize", getattr(args, "quantize", None), QUANTIZE),
        ("--wire-dtype", getattr(args, "wire_dtype", None), WIRE_DTYPES),
    ):
        if value is not None and value not in ok:
            raise UsageError(f"{opt} {value}: choose from {', '.join(ok)}")


def machine_settings(args, hosts, world: int, share: int | None = None) -> tuple[list[int], list[str]]:
    """Threads and torch device per rank, checked before any rank starts (contract §9):
    `--threads`/`--device` for --local ranks (which share this machine's CPUs), the
    inventory's smol_threads/smol_device for hosts. 0 threads: the host's usable CPUs,
    settled by the rank itself."""
    from smoltrain import host
    from smoltrain.run.threads import inventory_threads, local_threads

    if hosts is None:
        threads = local_threads(getattr(args, "threads", None), share or world)[:world]
        devices = [getattr(args, "device", None) or "cpu"] * world
        dev = host.resolve_device(devices[0])
        if args.dtype:
            host.check_dtype(args.dtype, dev)
        return threads, devices
    from smoltrain.run.threads import cap_threads

    threads = inventory_threads(hosts[:world], cap_threads(hosts[:world], getattr(args, "compute", None)))
    devices = [h.torch_device for h in hosts[:world]]
    for h, d in zip(hosts[:world], devices):
        if h.local and d != "auto":  # a host on this machine: check here what its rank would refuse
            dev = host.resolve_device(d)
            if args.dtype:
                host.check_dtype(args.dtype, dev)
    return threads, devices


def _replace(cfg: InferConfig, **kw) -> InferConfig:
    from dataclasses import replace

    return replace(cfg, **kw)


def add_placement_arguments(p) -> None:
    """Options `generate` and `serve` share (contract §7)."""
    p.add_argument("--strategy", default="pp", choices=("local", "pp", "tp"))
    p.add_argument(
        "--mesh", metavar="pp=P,tp=T", help="pp stages whose layers are tp-split (replaces --strategy; docs/mesh.md)"
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--local", type=validate.RANKS, metavar="N", help="N ranks on loopback (1: one process, the reference)"
    )
    where.add_argument("-i", "--inventory", help="one rank per `cluster` host of this inventory")
    p.add_argument("--model", required=True, help="Hugging Face checkpoint folder (same path on every host)")
    p.add_argument("--adapter", help="PEFT LoRA adapter folder applied to --model as it loads (same path everywhere)")
    p.add_argument("--backend", default="socket", choices=("socket", "torch"))
    p.add_argument("--dtype", help="fp32, bf16 or fp16 (default: the checkpoint's dtype)")
    p.add_argument("--quantize", help="weights of every layer: int8 (per channel) or q4 (Q4_0, groups of 32)")
    p.add_argument("--wire-dtype", help="hidden states between ranks: fp32, bf16, fp16 or int8 (default: --dtype)")
    p.add_argument(
        "--threads",
        type=validate.THREADS,
        help="--local: torch threads per rank (default: this machine's CPUs / ranks)",
    )
    p.add_argument("--device", help="--local: torch device of every rank (cpu, cuda, mps, auto; default cpu)")
    p.add_argument(
        "--kernels",
        choices=("auto", "native", "kleidiai", "torch"),
        help="decode kernels of every rank (default auto: the fastest the host has; docs/machine.md)",
    )
    p.add_argument(
        "--placement",
        choices=("even", "auto"),
        help="pp layer split and rank order: even, or auto (least sum of stage compute and hops, by measured "
        "speed; the default when a compute report is available); both route around down links",
    )
    p.add_argument("--compute", help="compute report, smoltrain.compute/1 (default reports/compute.json if present)")
    p.add_argument(
        "--links", help="links report the plan and placement read (default reports/links.json when it covers the hosts)"
    )
    p.add_argument("--timeout", type=validate.SECONDS, default=120.0, help="give up on a silent rank after this long")
    p.add_argument("--secret-file", help="cluster secret (default: the inventory's smol_secret_file)")
