"""What a decode step costs a host beyond a training step's figures: the weight bytes per second
its layers' own kernel streams at 1, 4 and 8 rows (decode_bw), and what a real inference block
spends beyond its four products (decode_overhead). Both are timed in CPU seconds, so a call cut
by a CFS quota or by another process costs what it computed; the probe turns them into wall
time at the host's pace. Run by probe.probe, and cpu_seconds by engine_probe.
"""

from __future__ import annotations

import time

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


def cpu_seconds_more(fn, than, calls: int, warm: bool = True, pause: float = 0.0) -> float:
    """CPU seconds one call of `fn` takes beyond one of `than`: the median over `calls` pairs,
    each timed back to back (after `pause` seconds asleep, when given; after one untimed pair,
    when `warm`). The layer overhead is a tenth of its block's time: two medians taken apart
    left it at 0.03-0.94 ms a layer on one drawn cluster's hosts (one CPU, every host the same;
    a run's stages cost 0.17 ms a layer, issue 36), as a throttle or a busy neighbour moved one
    median and not the other; a pair sees the same host."""
    if warm:
        fn(), than()
    diffs = []
    for _ in range(calls):
        if pause:
            time.sleep(pause)
        t0 = time.process_time()
        fn()
        t1 = time.process_time()
        than()
        diffs.append((t1 - t0) - (time.process_time() - t1))
    return sorted(diffs)[len(diffs) // 2]


WAKE_IDLE_S = 0.02  # asleep this long before the timed burst: past the ~8-20 ms where the cost levels off
WAKE_CALLS = 9  # bursts timed after a sleep, each beside one right after it; the median difference kept
WAKE_LAYERS = 6  # small layers of tiny8's width per burst: about a decode stage's or a microbatch's work


def burst_wake(torch) -> float:
    """CPU seconds a burst costs when it starts after the host slept, beyond the same burst
    run right after another: the median over WAKE_CALLS pairs (cpu_seconds_more's pairing), at
    one thread. On the 2-vCPU VM of issue 36, six such layers took 0.29-0.71 ms warm and
    1.0-1.27 ms after 20 ms or more asleep, on every sim host, capped or not (a few ms asleep:
    part of it); a chain's stages sleep between their bursts, so a burst after a wait pays it
    (the plan charges it to training chains on quota hosts: planner/cfs.Cpu)."""
    from smoltrain import host

    threads = torch.get_num_threads()
    host.set_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        w = [torch.randn(96, 384, generator=g) * 0.05, torch.randn(384, 96, generator=g) * 0.05]
        x = torch.randn(1, 96, generator=g)

        def burst():
            h = x
            with torch.no_grad():
                for _ in range(WAKE_LAYERS):
                    h = torch.nn.functional.layer_norm(h + torch.nn.functional.gelu(h @ w[0]) @ w[1], (96,))

        for _ in range(20):
            burst()
        return max(0.0, cpu_seconds_more(burst, burst, WAKE_CALLS, warm=False, pause=WAKE_IDLE_S))
    finally:
        host.set_threads(threads)


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


def decode_overhead(torch, pace: float, calls: int = OVERHEAD_CALLS) -> dict:
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
        return _overhead(torch, pace, calls)
    finally:
        host.set_threads(threads)


def _overhead(torch, pace: float, calls: int) -> dict:
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
            for rows in DECODE_ROWS:
                layer = LlamaBlock(cfg, cfg.heads, cfg.kv_heads, cfg.ffn).requires_grad_(False)
                for key, p in layer.named_parameters():
                    if "norm" not in key:
                        p.normal_(0, 0.02)
                block = LlamaDecode(layer.to(dt), one_row=rows == 1)
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

                extra = cpu_seconds_more(_repeat(layer, OVERHEAD_LAYERS), _repeat(products, OVERHEAD_LAYERS), calls)
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
