"""The compute probe, run on the host it measures: `python -m smoltrain.calibration.probe`.

Prints one JSON object (a `hosts` entry of `smoltrain.compute/1`, less its name). Every
figure is a throughput over a window of many CFS periods, never a best-of: under a CPU
quota a short operation runs at full speed until the quota is spent and then waits, so the
fastest sample measures the uncapped machine, while work over a window sees the cap,
as a training rank does. Kernels are timed as the median of three windows after a warm-up
one: on a VM, a capped sim host's first matmul window after the communication test ran at
0.8 of the windows after it, and one slow window must not decide the figure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from smolnet.facts import machine_id

WINDOW_MIN = 0.25  # seconds; >= 2.5 CFS periods of 100 ms
TRAIN_BATCHES = (2, 8)


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


def steady_rate(fn, window: float, windows: int = KERNEL_WINDOWS) -> float:
    """Calls per second once warm: a half-window run and dropped, then the median of
    `windows` half-windows (each still dozens of CFS periods)."""
    _window(fn, window / 2)
    return sorted(_window(fn, window / 2) for _ in range(windows))[windows // 2]


def matmul_flops(torch, dtype, n: int, window: float) -> float:
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    return 2 * n**3 * steady_rate(lambda: torch.mm(a, b), window)


def copy_bw(torch, nbytes: int, window: float) -> float:
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes * steady_rate(lambda: dst.copy_(src), window)  # read + write


def train_seconds(torch, model_name: str, batch: int, seq: int, window: float, optimizer: list | None = None) -> float:
    """Seconds per real fwd + bwd + AdamW step of the model, as smoltrain run takes them.
    `optimizer` (a list) receives the share of them the AdamW update took: paid once per
    step, not per microbatch, so the plan must not multiply it as it does the passes."""
    from smoltrain.models.gpt import build_model
    from smoltrain.models.optim import AdamW
    from smoltrain.models.spec import get_model

    spec = get_model(model_name)
    model = build_model(spec, seed=0)
    params = list(model.parameters())
    opt = AdamW(params, lr=1e-3)
    x = torch.randint(0, spec.vocab, (batch, seq))

    spent = [0.0, 0]

    def step():
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, spec.vocab), x.reshape(-1))
        loss.backward()
        t0 = time.perf_counter()
        opt.step([p.grad for p in params])
        for p in params:
            p.grad = None
        spent[0] += time.perf_counter() - t0
        spent[1] += 1

    sec = 1.0 / rate(step, window)
    if optimizer is not None:
        optimizer.append(min(sec, spent[0] / spent[1]))
    return sec


BIG_FLOATS = 1 << 19
COMM_WINDOW = 1.0  # seconds per measurement: ten CFS periods, so a cap shows


def _loop(c, t, rank: int, window: float) -> tuple[int, float]:
    """All-reduce `t` until rank 0 has spent `window`; element 0 carries rank 0's "go on"."""
    n, t0 = 0, time.perf_counter()
    while True:
        t.zero_()
        if rank == 0:
            t[0] = 1.0 if (time.perf_counter() - t0 < window or n < 3) else 0.0
        c.all_reduce(t)
        if t[0] == 0:
            return n, time.perf_counter() - t0
        n += 1


def comm_cpu(torch, window: float = COMM_WINDOW) -> dict | None:
    """What smoltrain's own communication costs this host's CPU (under its cap): two ranks
    of SocketComm on this host all-reduce a small and a large tensor over a window. Both
    run here, so each round's wall time is twice one rank's cost; a rank on its own host
    pays half. Per-message seconds and per-end bytes/s, or None when it cannot be measured."""
    import random
    import secrets

    from smoltrain.comm import make_comm

    secret = secrets.token_bytes(32)
    port = random.randrange(20000, 60000)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            c = make_comm("socket", 1, 2, "127.0.0.1", port, secret, timeout=60.0)
            _loop(c, torch.zeros(64), 1, window)
            _loop(c, torch.zeros(BIG_FLOATS), 1, window)
            c.close()
            code = 0
        finally:
            os._exit(code)
    try:
        c = make_comm("socket", 0, 2, "127.0.0.1", port, secret, timeout=60.0)
        n, el = _loop(c, torch.zeros(64), 0, window)
        t_small = el / (n + 1)
        n, el = _loop(c, torch.zeros(BIG_FLOATS), 0, window)
        t_big = el / (n + 1)
        c.close()
    except Exception:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        return None
    os.waitpid(pid, 0)
    # a ring all-reduce of 2 ranks is 2 rounds; here both ranks share the CPU: / 2 again
    msg = t_small / 4
    chunk = BIG_FLOATS * 4 / 2
    per_byte = max(1e-12, (t_big / 4 - msg) / chunk)
    return {"message_s": msg, "bytes_s": 1 / per_byte}


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


def probe(model: str | None = "tiny", seconds: float = 0.5, threads: int = 1, seq: int | None = None) -> dict:
    w = max(WINDOW_MIN, seconds)
    import torch

    from smolnet.sim.cgroup import own_quota

    torch.set_num_threads(threads)
    comm = comm_cpu(torch) if hasattr(os, "fork") else None
    flops = {"fp32": matmul_flops(torch, torch.float32, 384, w), "bf16": matmul_flops(torch, torch.bfloat16, 256, w)}
    flops["fp16"] = flops["bf16"]
    cap = own_quota()
    doc = {
        "machine_id": machine_id(),
        "cores": cores(),
        "cpu_limit_cores": cap[0] / cap[1] if cap else None,
        "cpu_period_s": cap[1] / 1e6 if cap else None,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "flops": flops,
        "mem_bw_bytes_s": copy_bw(torch, 32 << 20, w),
        "usable_memory_bytes": usable_memory(),
        "comm_cpu": comm,
        "train_step": [],
    }
    if model and model != "none":
        from smoltrain.models.spec import get_model

        s = seq or min(64, get_model(model).ctx)
        for b in TRAIN_BATCHES:
            opt: list = []
            sec = train_seconds(torch, model, b, s, 2 * w, opt)
            doc["train_step"].append(
                {"model": model, "batch": b, "seq": s, "seconds": sec, "optimizer_seconds": opt[0]}
            )
    return doc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m smoltrain.calibration.probe")
    p.add_argument("--model", default="tiny")
    p.add_argument("--seconds", type=float, default=0.5, help="window per measurement")
    p.add_argument("--threads", type=int, default=1, help="torch threads (a rank runs one)")
    p.add_argument("--seq", type=int, default=None)
    a = p.parse_args(argv)
    try:
        doc = probe(a.model, a.seconds, a.threads, a.seq)
    except Exception as e:  # one line for the controller, which names the host
        print(f"probe failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
