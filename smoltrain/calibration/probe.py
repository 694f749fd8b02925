"""The compute probe, run on the host it measures: `python -m smoltrain.calibration.probe`.

Prints one JSON object (a `hosts` entry of `smoltrain.compute/1`, less its name). Every
figure is a throughput over a window of many CFS periods, never a best-of: under a CPU
quota a short operation runs at full speed until the quota is spent and then waits, so the
fastest sample measures the uncapped machine, while work over a window sees the cap,
as a training rank does. Kernels are timed as the median of three windows after a warm-up
one: on a VM, a capped sim host's first matmul window after the communication test ran at
0.8 of the windows after it, and one slow window must not decide the figure. A training
step is the median of several, in CPU seconds times the host's pace where the host is held
back (train_seconds): its steps are too long for a window to hold many periods.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from smolnet.facts import machine_id
from smoltrain.calibration.comm_probe import COMM_WINDOW, comm_cpu
from smoltrain.calibration.decode_probe import OVERHEAD_CALLS, burst_wake, decode_bw, decode_overhead
from smoltrain.calibration.pace import HELD_BACK, PACE_WINDOW, one_thread
from smoltrain.calibration.pace import measure as measure_pace

WINDOW_MIN = 0.25  # seconds; >= 2.5 CFS periods of 100 ms
TRAIN_BATCHES = (2, 8)
MATMUL_N = 384  # every dtype's matmul at this size, so their rates compare like with like
DTYPES = ("fp32", "bf16", "fp16")


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def rate(fn, window: float) -> float:
    """Calls per second over a window of at least `window` seconds, after one warm-up."""
    fn()
    return _window(fn, window)


def _window(fn, window: float) -> float:
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        el = time.perf_counter() - t0
        if el >= window and n >= 2:
            return n / el


KERNEL_WINDOWS = 3


@dataclass(frozen=True)
class Windows:
    """How long the probe looks at each figure beyond `seconds`: the defaults, or `--quick`'s,
    every window at its shortest (5.4 s of work a host instead of 10.7 here; each figure from one
    window, so noisier: a first look, or a check that every host answers)."""

    kernel: int = KERNEL_WINDOWS  # timed windows per kernel rate, the median kept
    pace_s: float = PACE_WINDOW
    comm_s: float = COMM_WINDOW
    train: float = 2.0  # a batch's training steps over this many windows
    pairs: int = OVERHEAD_CALLS  # decode_overhead's timed pairs


FULL = Windows()
QUICK = Windows(kernel=1, pace_s=WINDOW_MIN, comm_s=WINDOW_MIN, train=1.0, pairs=3)


def steady_rate(fn, window: float, windows: int = KERNEL_WINDOWS) -> float:
    """Calls per second once warm: a half-window run and dropped, then the median of
    `windows` half-windows (each still dozens of CFS periods)."""
    _window(fn, window / 2)
    return sorted(_window(fn, window / 2) for _ in range(windows))[windows // 2]


def matmul_flops(torch, dtype, n: int, window: float, device: str = "cpu", windows: int = KERNEL_WINDOWS) -> float:
    a = torch.randn(n, n).to(device, dtype)
    b = torch.randn(n, n).to(device, dtype)
    if device == "cpu":
        return 2 * n**3 * steady_rate(lambda: torch.mm(a, b), window, windows)

    def mm():  # an accelerator queues work: wait for it, or the rate is the queue's
        torch.mm(a, b)
        torch.cuda.synchronize() if device == "cuda" else torch.mps.synchronize()

    return 2 * n**3 * steady_rate(mm, window, windows)


def dtype_flops(torch, window: float, device: str = "cpu", windows: int = KERNEL_WINDOWS) -> dict:
    """Matmul FLOP/s of fp32, bf16 and fp16, each measured on its own at the same size
    (a CPU with bf16 units may have no fast fp16, and the other way round)."""
    t = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    out = {}
    for name in DTYPES:
        try:
            out[name] = matmul_flops(torch, t[name], MATMUL_N, window, device, windows)
        except (RuntimeError, TypeError):  # this torch cannot multiply in that dtype here
            out[name] = None
    return out


def copy_bw(torch, nbytes: int, window: float, windows: int = KERNEL_WINDOWS) -> float:
    """Bytes/s a copy moves (read + write), at this process's thread count."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes * steady_rate(lambda: dst.copy_(src), window, windows)  # read + write


TRAIN_STEPS_MIN = 3  # timed steps, at least: their median is the figure


def train_seconds(
    torch,
    model_name: str,
    batch: int,
    seq: int,
    window: float,
    optimizer: list | None = None,
    device: str = "cpu",
    paced: bool = False,
) -> float:
    """Seconds per real fwd + bwd + AdamW step of the model, as smoltrain run takes them: the
    median step after a warm-up one. `optimizer` (a list) receives the share of them the
    AdamW update took: paid once per step, not per microbatch, so the plan must not multiply
    it as it does the passes. `paced` (a host held back, one thread): CPU seconds, which the
    probe turns into wall seconds at the host's pace (at_pace). A few steps' wall time there
    turns on where the CFS periods fall and on one-off stalls: a warm-forked probe's first
    full garbage collection took 137 ms of CPU in one step, five times the others, and at a
    0.27-core pace made the window's mean 2.5x the steps'; the plan charged every capped rank
    of the drawn clusters that."""
    import statistics

    from smoltrain import host
    from smoltrain.models.gpt import build_model
    from smoltrain.models.optim import AdamW
    from smoltrain.models.spec import get_model

    host.keep_freed_memory()  # as a training rank does (run.worker)
    spec = get_model(model_name)
    model = build_model(spec, seed=0).to(device)
    params = list(model.parameters())
    opt = AdamW(params, lr=1e-3)
    x = torch.randint(0, spec.vocab, (batch, seq), device=device)
    clock = time.process_time if paced else time.perf_counter
    steps: list[float] = []
    updates: list[float] = []

    def step():
        c0 = clock()
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, spec.vocab), x.reshape(-1))
        loss.backward()
        c1 = clock()
        opt.step([p.grad for p in params])
        for p in params:
            p.grad = None
        if device != "cpu":
            loss.item()  # wait for the device's queue
        c2 = clock()
        steps.append(c2 - c0)
        updates.append(c2 - c1)

    step()  # warm-up
    steps.clear(), updates.clear()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < window or len(steps) < TRAIN_STEPS_MIN:
        step()
    sec = statistics.median(steps)
    if optimizer is not None:
        optimizer.append(min(sec, statistics.median(updates)))
    return sec


def decode_seconds(torch, model_name: str, window: float, device: str = "cpu") -> float:
    """Seconds of one token through the whole model without autograd, as a decode step takes it
    (batch 1, one position): on a small model almost all of it is the per-operation cost
    (dispatch, Python, small kernels) that a training pass's fixed cost overstates, since that
    also records the graph, runs the backward and the optimizer."""
    from smoltrain.models.gpt import build_model
    from smoltrain.models.spec import get_model

    spec = get_model(model_name)
    model = build_model(spec, seed=0).to(device).eval()
    x = torch.randint(0, spec.vocab, (1, 1), device=device)

    def step():
        with torch.no_grad():
            y = model(x)
        if device != "cpu":
            y.sum().item()  # wait for the device's queue

    return 1.0 / rate(step, window)


def usable_memory() -> int:
    import psutil

    avail = psutil.virtual_memory().available
    for p in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            v = Path(p).read_text().strip()
            if v.isdigit():
                avail = min(avail, int(v))
        except OSError:
            pass
    return int(avail)


def probe(
    model: str | None = "tiny",
    seconds: float = 0.5,
    threads: int | None = None,
    seq: int | None = None,
    device: str | None = "cpu",
    windows: Windows = FULL,
) -> dict:
    """This host's figures at the threads a rank runs here (`threads`: the host's smol_threads;
    None: the CPUs it may use) on its smol_device."""
    w, k = max(WINDOW_MIN, seconds), windows.kernel
    import torch

    from smolnet.sim.cgroup import own_quota
    from smoltrain import host

    threads, device = host.setup(threads, device)
    from smoltrain.calibration.engine_probe import engine_step_s
    from smoltrain.models import backends

    pw = max(windows.pace_s, w)
    paces = [measure_pace(pw)]  # three windows, at the start, the middle and the end: their median
    if device == "cpu" and torch.get_num_threads() > 1 and one_thread(paces[0].pace, own_quota() is not None):
        host.set_threads(1)  # a cap it cannot read holds it to half a core: its ranks run one (run/threads)
    flops = dtype_flops(torch, w, device, k)
    mem_bw = copy_bw(torch, host.COPY_BYTES, w, k)
    paces.append(measure_pace(pw))
    # CPU seconds now, times the pace once it is known (at_pace)
    comm = comm_cpu(torch, windows.comm_s, pace=1.0) if hasattr(os, "fork") else None
    layer = decode_overhead(torch, 1.0, windows.pairs) if device == "cpu" else {}
    engine = engine_step_s(torch, 1.0) if device == "cpu" else None
    wake = burst_wake(torch) if device == "cpu" else None
    paced = max(p.pace for p in paces) > HELD_BACK and torch.get_num_threads() == 1 and device == "cpu"
    steps = []
    if model and model != "none":
        from smoltrain.models.spec import get_model

        s = seq or min(64, get_model(model).ctx)
        for b in TRAIN_BATCHES:
            opt: list = []
            sec = train_seconds(torch, model, b, s, windows.train * w, opt, device, paced)
            steps.append({"model": model, "batch": b, "seq": s, "seconds": sec, "optimizer_seconds": opt[0]})
    paces.append(measure_pace(pw))
    held = sorted(paces, key=lambda p: p.pace)[1]
    pace = held.pace
    cap = own_quota()
    doc = {
        "machine_id": machine_id(),
        "cores": cores(),
        "cpu_limit_cores": cap[0] / cap[1] if cap else None,
        "cpu_period_s": cap[1] / 1e6 if cap else None,
        "threads": torch.get_num_threads(),
        "device": device,
        "kernels": backends.report(),  # the decode kernels decode_bw and decode_layer_s ran on
        "torch": torch.__version__,
        "flops": flops,
        "mem_bw_bytes_s": mem_bw,
        "decode_bw_bytes_s": decode_bw(torch, mem_bw, host.COPY_BYTES) if device == "cpu" else {},
        "usable_memory_bytes": usable_memory(),
        "cpu_pace": pace,
        "cpu_cycle": held.cycle(),
        "decode_step": [],
    }
    doc.update(at_pace(pace, comm, layer, engine, steps if paced else [], wake))
    doc["train_step"] = steps
    if model and model != "none":
        doc["decode_step"].append({"model": model, "seconds": decode_seconds(torch, model, w, device)})
    return doc


def at_pace(
    pace: float, comm: dict | None, layer: dict, engine: float | None, cpu_steps: list, wake: float | None = None
) -> dict:
    """The figures measured in CPU seconds, in wall seconds at the host's pace: a message's and a
    byte's CPU (comm_cpu), each layer's cost beyond its products, the decode engine's step, a
    burst's cost after a sleep, and the training steps timed in CPU seconds (scaled in place)."""
    for st in cpu_steps:
        st["seconds"] *= pace
        st["optimizer_seconds"] *= pace
    return {
        "comm_cpu": {"message_s": comm["message_s"] * pace, "bytes_s": comm["bytes_s"] / pace} if comm else comm,
        "decode_layer_s": {dt: {r: v * pace for r, v in rows.items()} for dt, rows in layer.items()},
        "decode_engine_s": engine * pace if engine is not None else None,
        "burst_wake_s": wake * pace if wake is not None else None,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m smoltrain.calibration.probe")
    p.add_argument("--model", default="tiny")
    p.add_argument("--seconds", type=float, default=0.5, help="window per measurement")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the CPUs this host may use)")
    p.add_argument("--device", default="cpu", help="torch device (smol_device: cpu, cuda, mps, auto)")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--kernels", default=None, help="decode kernels: auto, native, kleidiai, torch (models.backends)")
    p.add_argument("--quick", action="store_true", help="every window at its shortest (Windows, QUICK)")
    p.add_argument("--serve", action="store_true", help="one probe per line read on stdin, until it ends (session.py)")
    a = p.parse_args(argv)
    try:
        from smoltrain.models import backends

        backends.select(a.kernels)
        for _ in sys.stdin if a.serve else [None]:
            doc = probe(a.model, a.seconds, a.threads, a.seq, a.device, QUICK if a.quick else FULL)
            print(json.dumps(doc), flush=True)
    except Exception as e:  # one line for the controller, which names the host
        print(f"probe failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
