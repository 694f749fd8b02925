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
from pathlib import Path

from smolnet.facts import machine_id
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


def steady_rate(fn, window: float, windows: int = KERNEL_WINDOWS) -> float:
    """Calls per second once warm: a half-window run and dropped, then the median of
    `windows` half-windows (each still dozens of CFS periods)."""
    _window(fn, window / 2)
    return sorted(_window(fn, window / 2) for _ in range(windows))[windows // 2]


def matmul_flops(torch, dtype, n: int, window: float, device: str = "cpu") -> float:
    a = torch.randn(n, n).to(device, dtype)
    b = torch.randn(n, n).to(device, dtype)
    if device == "cpu":
        return 2 * n**3 * steady_rate(lambda: torch.mm(a, b), window)

    def mm():  # an accelerator queues work: wait for it, or the rate is the queue's
        torch.mm(a, b)
        torch.cuda.synchronize() if device == "cuda" else torch.mps.synchronize()

    return 2 * n**3 * steady_rate(mm, window)


def dtype_flops(torch, window: float, device: str = "cpu") -> dict:
    """Matmul FLOP/s of fp32, bf16 and fp16, each measured on its own at the same size
    (a CPU with bf16 units may have no fast fp16, and the other way round)."""
    t = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    out = {}
    for name in DTYPES:
        try:
            out[name] = matmul_flops(torch, t[name], MATMUL_N, window, device)
        except (RuntimeError, TypeError):  # this torch cannot multiply in that dtype here
            out[name] = None
    return out


def copy_bw(torch, nbytes: int, window: float) -> float:
    """Bytes/s a copy moves (read + write), at this process's thread count."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes * steady_rate(lambda: dst.copy_(src), window)  # read + write


DECODE_BYTES = 64 << 20  # weights per dtype: twice the L3 of the machines measured, so every call reads memory
DECODE_TILE = 2048  # square matrices of a small model's layer width (1-2k): oneDNN's batch-1 fp32
# product read 17 GB/s from 2048-wide matrices and 23 from one 4096x4096 on the machine of BENCHMARKS.md
DECODE_ROWS = (1, 4, 8)  # generate decodes 1 row; serve pads a step to 4 and batches up to 8
DECODE_DTYPES = ("fp32", "bf16")
DECODE_CALLS = 3


def cpu_seconds(fn, calls: int = DECODE_CALLS, warm: bool = True) -> float:
    """CPU seconds of one call of fn (all threads), the median of `calls` (after a warm-up
    call): CPU time, so a call cut by a CFS quota or by another process costs what it computed."""
    if warm:
        fn()
    spent = []
    for _ in range(calls):
        t0 = time.process_time()
        fn()
        spent.append(time.process_time() - t0)
    return sorted(spent)[len(spent) // 2]


def cpu_seconds_more(fn, than, calls: int) -> float:
    """CPU seconds one call of `fn` takes beyond one of `than`: the median over `calls` pairs,
    each timed back to back. The layer overhead is a tenth of its block's time: two medians
    taken apart left it at 0.03-0.94 ms a layer on one drawn cluster's hosts (one CPU, every
    host the same; a run's stages cost 0.17 ms a layer, issue 36), as a throttle or a busy
    neighbour moved one median and not the other; a pair sees the same host."""
    fn(), than()
    diffs = []
    for _ in range(calls):
        t0 = time.process_time()
        fn()
        t1 = time.process_time()
        than()
        diffs.append((t1 - t0) - (time.process_time() - t1))
    return sorted(diffs)[len(diffs) // 2]


def decode_layers(torch, dtype: str, one_row: bool) -> list:
    """DECODE_BYTES of weights as the layers' own kernel holds them, each layer its own memory
    (a kernel that keeps the tensor it is given would otherwise read one tile from cache)."""
    from smoltrain.models.quant import Linear

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    k = max(1, DECODE_BYTES // (DECODE_TILE * DECODE_TILE * torch.empty(0, dtype=dt).element_size()))
    # zeros: values do not change the time (no denormals)
    return [Linear(torch.zeros(DECODE_TILE, DECODE_TILE), None, dt, one_row=one_row) for _ in range(k)]


def decode_bw(torch, mem_bw: float, copy_bytes: int) -> dict:
    """Weight bytes per second a decode step reads, per dtype and rows: what the layers'
    own kernel (models.quant.Linear: for fp32 the one-row product at one row, as `generate` holds
    its layers, oneDNN for serve's batches) makes of DECODE_BYTES of weights times 1, 4 and
    8 rows. Few-row products stream weights slower than a copy moves them (1-row
    fp32 at 0.6-0.8 of the copy here, 8 rows at 0.35), so the plan reads them at this rate.

    A few calls only (well under a second): each is timed in CPU seconds, as a ratio to
    the copy timed the same way, and that ratio scales `mem_bw`, the copy measured over
    whole windows: the windows see the host's cap, and the ratio does not need to."""
    copy_rate = 2 * copy_bytes / cpu_seconds(_copy(torch, copy_bytes))
    out: dict = {}
    for name in DECODE_DTYPES:
        try:
            held = {one: decode_layers(torch, name, one) for one in (True, False)}
            rates: dict = {}
            for rows in DECODE_ROWS:
                layers = held[rows == 1]  # as a one-row stage (generate) or a batched one (serve) holds them
                x = torch.ones(rows, DECODE_TILE, dtype=layers[0].dtype)
                cpu = cpu_seconds(_products(layers, x))
                rates[str(rows)] = sum(lin.nbytes for lin in layers) / cpu / copy_rate * mem_bw
            out[name] = rates
        except (RuntimeError, TypeError):  # this torch cannot run the product in that dtype here
            continue
    return out


# A small Llama layer (SmolLM2-135M's: grouped-query attention, 64-wide heads): what a served
# layer does beyond its matrix products (norms, rotary tables, each row's attention over its
# own KV cache, activations) is mostly per-operation cost, about the same whatever the width.
OVERHEAD_LAYER = dict(hidden=576, heads=9, kv_heads=3, head_dim=64, ffn=1536)
OVERHEAD_POS = 48  # positions already in each row's KV cache
OVERHEAD_LAYERS = 5  # layers per timed call: the rest is some hundred microseconds a layer
OVERHEAD_CALLS = 7  # pairs timed, the median difference kept


def decode_overhead(torch, pace: float) -> dict:
    """Seconds per layer a decode step of 1, 4 and 8 rows spends beyond its matrix products,
    per dtype: a real inference block (models.llama.LlamaDecode) of OVERHEAD_LAYER's shape, each row with
    its own KV cache, as `generate` (1 row) and `serve` (batched) run it, less the same
    block's products timed alone. At one thread: these operations gain nothing from more,
    and CPU time counts every thread, a BLAS pool's spinning ones too. CPU seconds, times
    the host's `pace`."""
    from smoltrain import host

    threads = torch.get_num_threads()
    host.set_threads(1)
    try:
        return _overhead(torch, pace)
    finally:
        host.set_threads(threads)


def _overhead(torch, pace: float) -> dict:
    from smoltrain.models.blocks import LlamaBlock
    from smoltrain.models.hf import HFConfig
    from smoltrain.models.llama import LlamaDecode
    from smoltrain.models.stage import Rows

    L = OVERHEAD_LAYER
    cfg = HFConfig("llama", 256, L["hidden"], 1, L["heads"], L["kv_heads"], L["head_dim"], L["ffn"], 256, 1e-5)
    H = cfg.hidden
    out: dict = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        try:
            per: dict = {}
            # one block per dtype, viewed per row count: building and initialising one for each
            # row count was a quarter of this probe's CPU (profiled; wall time at a host's pace)
            base = LlamaBlock(cfg, cfg.heads, cfg.kv_heads, cfg.ffn).requires_grad_(False)
            for key, p in base.named_parameters():
                if "norm" not in key:
                    p.normal_(0, 0.02)
            base = base.to(dt)
            for rows in DECODE_ROWS:
                block = LlamaDecode(base, one_row=rows == 1)
                for slot in range(rows):
                    block.open(slot, OVERHEAD_POS + 8, dt)
                x = torch.randn(rows, 1, H).to(dt)
                lins = (block.qkv, block.o, block.gate_up, block.down)
                ins = [torch.randn(rows, lin.in_features).to(dt) for lin in lins]

                def layer(rows=rows, block=block, x=x):
                    with torch.no_grad():
                        block(x, Rows(list(range(rows)), [OVERHEAD_POS] * rows), lambda t: t)

                def products(lins=lins, ins=ins):
                    with torch.no_grad():
                        for lin, a in zip(lins, ins):
                            lin(a)

                extra = cpu_seconds_more(
                    _repeat(layer, OVERHEAD_LAYERS), _repeat(products, OVERHEAD_LAYERS), OVERHEAD_CALLS
                )
                # more rows never cost a layer less: a noisy pair (a capped host's cold slices)
                # keeps the fewer rows' figure
                per[str(rows)] = max([max(0.0, extra) / OVERHEAD_LAYERS * pace] + list(per.values()))
            out[name] = per
        except (RuntimeError, TypeError):  # this torch cannot run the block in that dtype here
            continue
    return out


def _repeat(fn, n: int):
    return lambda: [fn() for _ in range(n)]


def _copy(torch, nbytes: int):
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _products(layers: list, x):
    return lambda: [lin(x) for lin in layers]


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


BIG_FLOATS = 1 << 19
COMM_WINDOW = 1.0  # seconds per measurement: ten CFS periods, so a cap shows


def ring_rounds(c, t, rank: int, window: float, work=None, clock=time.thread_time) -> tuple[float, int]:
    """(CPU seconds by `clock`, rounds) of `work` (if any) then an all-reduce of `t`, until rank
    0 has spent `window`; element 0 carries rank 0's "go on"."""
    n, t0, c0 = 0, time.perf_counter(), clock()
    while True:
        if work is not None:
            work()
        t.zero_()
        if rank == 0:
            t[0] = 1.0 if (time.perf_counter() - t0 < window or n < 3) else 0.0
        c.all_reduce(t)
        n += 1
        if t[0] == 0:
            return clock() - c0, n


def _loop(c, t, rank: int, window: float) -> float:
    """This thread's CPU seconds per all-reduce of `t`, back to back."""
    cpu, n = ring_rounds(c, t, rank, window)
    return cpu / n


RING = 3  # probe ranks: a ring of three, so each rank has a distinct next and previous peer


def comm_cpu(torch, window: float = COMM_WINDOW, pace: float = 1.0) -> dict | None:
    """What smoltrain's own communication costs this host's CPU: a ring of RING ranks of
    SocketComm all-reduce a small and a large tensor over a window, on ports checked free
    (a clash would lose the measurement), and rank 0 counts its own CPU seconds. Three
    ranks, not two: in every ring of three or more hosts a rank sends to one peer and
    waits on another (two sockets, a wake-up for each), about 1.7x the CPU per step of a
    pair that trades on one socket (103 against 60 us on loopback).

    The ranks share one CPU and take turns, so a rank's CPU time is its own work: spread
    over two vCPUs that are hyperthreads of one core, each ran at half speed while charged
    in full, and on the 0.15-core sim host the same probe read 98-196 us of CPU a message
    from run to run (wall time, which the quota's periods chop, 0.7-1.9 ms); on one CPU,
    95-102 us. CPU seconds times the host's `pace` (a capped host's CPU second is 1/cap
    seconds of wall time): per-message seconds and per-end bytes/s, or None."""
    import secrets

    from smoltrain.comm import make_comm
    from smoltrain.comm.group import free_port_base

    secret = secrets.token_bytes(32)
    port = free_port_base(RING)
    # a warm-up (first messages, buffers, caches), then a small and a large all-reduce; rank 0
    # decides when each ends, the others follow
    loops = ((64, window / 4), (64, window), (BIG_FLOATS, window))
    pinned = hasattr(os, "sched_setaffinity")
    if pinned:  # the calling thread's CPUs; the forked ranks inherit them
        allowed = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {min(allowed)})
    pids = []
    try:
        for rank in range(1, RING):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    # a forked child must not enter the OpenMP pool its parent started (it is
                    # not there: a crash); one thread runs every operation inline
                    torch.set_num_threads(1)
                    c = make_comm("socket", rank, RING, "127.0.0.1", port, secret, timeout=60.0)
                    for n, w in loops:
                        _loop(c, torch.zeros(n), rank, w)
                    c.close()
                    code = 0
                finally:
                    os._exit(code)
            pids.append(pid)
        try:
            c = make_comm("socket", 0, RING, "127.0.0.1", port, secret, timeout=60.0)
            _, cpu_small, cpu_big = (_loop(c, torch.zeros(n), 0, w) for n, w in loops)
            c.close()
        except Exception:
            for pid in pids:
                os.kill(pid, 9)
            return None
        finally:
            for pid in pids:
                os.waitpid(pid, 0)
    finally:
        if pinned:
            os.sched_setaffinity(0, allowed)
    return per_message(cpu_small, cpu_big, BIG_FLOATS * 4, pace=pace)


def per_message(cpu_small: float, cpu_big: float, big_bytes: int, ranks: int = RING, pace: float = 1.0) -> dict:
    """One rank's cost per message and bytes/s per end, from one rank's CPU seconds per
    all-reduce of a small and of a `big_bytes` buffer among `ranks` ranks: a ring all-reduce
    is 2(N-1) steps, each one message of 1/N of the buffer per rank. Wall time on this
    host: CPU seconds times `pace`."""
    steps = 2 * (ranks - 1)
    msg = cpu_small / steps
    chunk = big_bytes / ranks
    per_byte = max(1e-12, (cpu_big / steps - msg) / chunk)
    return {"message_s": msg * pace, "bytes_s": 1 / (per_byte * pace)}


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
) -> dict:
    """This host's figures at the threads a rank runs here (`threads`: the host's smol_threads;
    None: the CPUs it may use) on its smol_device."""
    w = max(WINDOW_MIN, seconds)
    import torch

    from smolnet.sim.cgroup import own_quota
    from smoltrain import host

    threads, device = host.setup(threads, device)
    from smoltrain.calibration.engine_probe import engine_step_s
    from smoltrain.models import backends

    pw = max(PACE_WINDOW, w)
    paces = [measure_pace(pw)]  # three windows, at the start, the middle and the end: their median
    if device == "cpu" and torch.get_num_threads() > 1 and one_thread(paces[0].pace, own_quota() is not None):
        host.set_threads(1)  # a cap it cannot read holds it to half a core: its ranks run one (run/threads)
    flops = dtype_flops(torch, w, device)
    mem_bw = copy_bw(torch, host.COPY_BYTES, w)
    paces.append(measure_pace(pw))
    # CPU seconds now, times the pace once it is known (at_pace)
    comm = comm_cpu(torch, pace=1.0) if hasattr(os, "fork") else None
    layer = decode_overhead(torch, 1.0) if device == "cpu" else {}
    engine = engine_step_s(torch, 1.0) if device == "cpu" else None
    paced = max(p.pace for p in paces) > HELD_BACK and torch.get_num_threads() == 1 and device == "cpu"
    steps = []
    if model and model != "none":
        from smoltrain.models.spec import get_model

        s = seq or min(64, get_model(model).ctx)
        for b in TRAIN_BATCHES:
            opt: list = []
            sec = train_seconds(torch, model, b, s, 2 * w, opt, device, paced)
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
    doc.update(at_pace(pace, comm, layer, engine, steps if paced else []))
    doc["train_step"] = steps
    if model and model != "none":
        doc["decode_step"].append({"model": model, "seconds": decode_seconds(torch, model, w, device)})
    return doc


def at_pace(pace: float, comm: dict | None, layer: dict, engine: float | None, cpu_steps: list) -> dict:
    """The figures measured in CPU seconds, in wall seconds at the host's pace: a message's and a
    byte's CPU (comm_cpu), each layer's cost beyond its products, the decode engine's step, and
    the training steps timed in CPU seconds (scaled in place)."""
    for st in cpu_steps:
        st["seconds"] *= pace
        st["optimizer_seconds"] *= pace
    return {
        "comm_cpu": {"message_s": comm["message_s"] * pace, "bytes_s": comm["bytes_s"] / pace} if comm else comm,
        "decode_layer_s": {dt: {r: v * pace for r, v in rows.items()} for dt, rows in layer.items()},
        "decode_engine_s": engine * pace if engine is not None else None,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m smoltrain.calibration.probe")
    p.add_argument("--model", default="tiny")
    p.add_argument("--seconds", type=float, default=0.5, help="window per measurement")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the CPUs this host may use)")
    p.add_argument("--device", default="cpu", help="torch device (smol_device: cpu, cuda, mps, auto)")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--kernels", default=None, help="decode kernels: auto, native, kleidiai, torch (models.backends)")
    p.add_argument("--serve", action="store_true", help="one probe per line read on stdin, until it ends (session.py)")
    a = p.parse_args(argv)
    try:
        from smoltrain.models import backends

        backends.select(a.kernels)
        for _ in sys.stdin if a.serve else [None]:
            print(json.dumps(probe(a.model, a.seconds, a.threads, a.seq, a.device)), flush=True)
    except Exception as e:  # one line for the controller, which names the host
        print(f"probe failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
