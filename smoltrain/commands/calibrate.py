"""`smoltrain calibrate`: measure this host's matmul FLOP/s and memory bandwidth with torch.

The plan uses the result for `generic` hosts instead of guessed figures. Besides the peak
matmul rate it times real training steps of a model (default `tiny`, batch 8 x 64), because
small models reach a small fraction of the peak and the plan should know which fraction.
"""

from __future__ import annotations

import os
import socket
from datetime import datetime, timezone

from smolnet.errors import UsageError
from smolnet.files import write_json_atomic
from smoltrain import validate

DEFAULT_COMPUTE = "reports/compute.json"


def add_arguments(p) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "-i",
        "--inventory",
        help="measure every cluster host over SSH into a smoltrain.compute/1 report (default reports/compute.json)",
    )
    g.add_argument("--local", action="store_true", help="measure this machine into a smoltrain.compute/1 report")
    p.add_argument("--hosts", help="with -i: only these hosts (comma-separated)")
    p.add_argument(
        "--out",
        help="where to write the profile (default ~/.config/smolcluster/calibration.json; "
        f"with -i or --local the compute report, default {DEFAULT_COMPUTE})",
    )
    p.add_argument("--seconds", type=validate.seconds(60), default=0.3, help="time per measurement (default 0.3)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="with -i or --local: every window at its shortest, about half the time, noisier figures (docs/compute.md)",
    )
    p.add_argument(
        "--repeat",
        type=validate.count(20),
        default=1,
        metavar="N",
        help="with -i or --local: probe every host N times and keep each figure's median (default 1)",
    )
    p.add_argument(
        "--sequential",
        action="store_true",
        help="with -i: measure hosts that share a machine one after another even where their CPU caps "
        "let two or more be measured at once (docs/compute.md)",
    )
    p.add_argument("--model", default="tiny", help="model whose training step sets the achieved fraction (none: skip)")
    p.add_argument("--batch", type=validate.BATCH, default=8)
    p.add_argument("--seq", type=validate.SEQ, default=64)
    p.add_argument(
        "--threads", type=validate.THREADS, help="torch threads (default: the CPUs this host may use, as a rank runs)"
    )
    p.add_argument("--device", default="cpu", help="--local: torch device to measure (cpu, cuda, mps, auto)")
    p.add_argument("--json", metavar="FILE", help="also write the profile here")
    p.add_argument(
        "--kernels",
        choices=("auto", "native", "kleidiai", "torch"),
        help="decode kernels to measure with (default auto: the fastest the host has; docs/machine.md)",
    )


def measure_train(torch, model_name: str, batch: int, seq: int, seconds: float) -> dict:
    """Achieved FLOP/s of real fwd+bwd+update steps (6 FLOPs per param per token + attention),
    timed by the same probe `calibrate -i` runs on every host."""
    from smoltrain.calibration.probe import train_seconds
    from smoltrain.models.spec import get_model

    spec = get_model(model_name)
    sec = train_seconds(torch, model_name, batch, seq, seconds)
    mm = spec.layers * spec.layer_params() + spec.vocab * spec.hidden
    flops = batch * seq * (6 * mm + 12 * spec.layers * spec.hidden * seq)
    return {"model": model_name, "batch": batch, "seq": seq, "step_s": sec, "flops": flops / sec}


def calibrate(
    seconds: float = 0.3, model: str | None = "tiny", batch: int = 8, seq: int = 64, threads: int | None = 1
) -> dict:
    import psutil
    import torch

    from smoltrain import host
    from smoltrain.calibration.probe import copy_bw, matmul_flops
    from smoltrain.models import backends

    host.setup(threads)
    sizes = [256, 512, 1024]
    mm32 = [{"n": n, "flops": matmul_flops(torch, torch.float32, n, seconds / 3)} for n in sizes]
    f32 = max(m["flops"] for m in mm32)
    f16 = matmul_flops(torch, torch.float16, 512, seconds / 3)
    bf16 = matmul_flops(torch, torch.bfloat16, 512, seconds / 3)
    bw = max(copy_bw(torch, nb, seconds / 2) for nb in (16 << 20, 64 << 20))
    doc = {
        "schema": "smoltrain.calibration/1",
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "kernels": backends.report(),
        "cpu_count": os.cpu_count(),
        "flops_fp32": f32,
        "flops_fp16": f16,
        "flops_bf16": bf16,
        "mem_bw": bw,
        "memory_bytes": psutil.virtual_memory().total,
        "matmul_fp32": mm32,
    }
    if model and model != "none":
        tr = measure_train(torch, model, batch, seq, seconds)
        doc["train"] = tr
        doc["train_efficiency"] = min(1.0, tr["flops"] / f32)
    return doc


write_atomic = write_json_atomic


def run(args) -> int:
    from rich.console import Console

    from smoltrain.models import backends
    from smoltrain.models.spec import ModelSpecError, get_model
    from smoltrain.planner.devices import calibration_path

    if not getattr(args, "inventory", None):  # this machine measures: refuse here a backend it cannot run
        backends.select(getattr(args, "kernels", None))
    elif getattr(args, "kernels", None):
        os.environ["SMOL_KERNELS"] = args.kernels  # each host's probe chooses (calibration.cluster.probe_argv)

    if args.quick and not (getattr(args, "inventory", None) or getattr(args, "local", False)):
        raise UsageError("--quick: only with -i INVENTORY or --local (the compute report's probe)")
    if args.model and args.model != "none":
        try:
            get_model(args.model)
        except ModelSpecError as e:
            raise UsageError(str(e)) from None
    if getattr(args, "inventory", None) or getattr(args, "local", False):
        from smoltrain.calibration.command import run_compute

        return run_compute(args, args.out or DEFAULT_COMPUTE)
    con = Console()
    with con.status("measuring matmul FLOP/s, memory bandwidth and a training step ..."):
        doc = calibrate(args.seconds, args.model, args.batch, args.seq, args.threads)
    out = str(calibration_path(args.out))
    write_atomic(out, doc)
    if args.json:
        write_atomic(args.json, doc)
    con.print(
        f"matmul fp32 {doc['flops_fp32'] / 1e9:,.1f} GFLOP/s, bf16 {doc['flops_bf16'] / 1e9:,.1f}, "
        f"fp16 {doc['flops_fp16'] / 1e9:,.1f} GFLOP/s, "
        f"memory {doc['mem_bw'] / 1e9:,.1f} GB/s, {doc['threads']} threads"
    )
    if "train" in doc:
        t = doc["train"]
        con.print(
            f"{t['model']} training step {t['step_s'] * 1e3:.1f} ms at batch {t['batch']} x {t['seq']}: "
            f"{t['flops'] / 1e9:,.1f} GFLOP/s, {doc['train_efficiency']:.0%} of the matmul peak"
        )
    con.print(f"wrote {out}; `smoltrain plan` uses it for generic hosts")
    return 0
