"""Batch-1 decode on one process, side by side in one run: smolcluster fp32, int8 and q4 against the
memory-bandwidth bound and against llama.cpp (llama-cpp-python) at Q8_0 and Q4_0, same threads.

The model is a random-weight Llama built here (bench/llama_checkpoint.py: 152M parameters,
606 MB fp32, SentencePiece tokenizer), converted to GGUF by the converter in the
llama-cpp-python sdist (vendor/llama.cpp/convert_hf_to_gguf.py) and quantised by llama.cpp
itself with `pure` (every matrix, head included, at Q8_0 or Q4_0, as smolcluster does). A
round decodes --tokens greedy tokens with each engine one after another and measures the memory
bandwidth beside them three ways, at the same threads: a 64 MB copy (read + write) in torch's
4 KB pages, as calibrate times it; the same copy in huge pages, the memory the decode weights are
held in; and a read (torch's sum) of as many bytes as an fp32 decode step reads, in huge pages.
The bound is the highest of the three (BENCHMARKS.md: which one that is depends on the load).
Figures are medians over rounds, so a slow spell of a shared machine hits every engine alike. Both wall-clock and CPU-time rates are kept: on a machine
other programs share, tokens per CPU-second is the steadier of the two. Beside our engines
run the A/Bs: fp32 on numpy's BLAS and torch's operations instead of our kernels, fp32 with
its weights in 4 KB pages instead of huge pages, q4 on torch's int4 kernel; and a second
copy, in huge pages.

Checks on the way: llama.cpp's f32 logits of the first decode step against ours (the
converted model is the same model); each quantised engine's logits against our fp32 ones
(ours and llama.cpp's at the same width should err alike); and greedy-token agreement. A
random-weight model's top logits nearly tie, so any quantisation flips its greedy tokens
early: the logit error is the comparison that means something here (tests/test_machine.py
checks token equality on a model whose choices win by clear margins).

`--threads 1,2,4,8` makes the thread-scaling table (decode per engine and a training step of
`tiny`) on a machine that has the cores.

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON" \
      pip install -c constraints.txt '.[bench]'   # llama-cpp-python, built from source (7-30 minutes)
    # GGML_NATIVE=ON also enables AMX on an Intel CPU that has it, and that build crashes in its first
    # decode (issue 39); these flags run on any x86-64 with AVX512 (drop the AVX512 ones for AVX2 only)
    flock /tmp/smol-sim.lock .venv/bin/python bench/bench_decode.py --rounds 5 --json bench/out/decode.json
    flock /tmp/smol-sim.lock .venv/bin/python bench/bench_decode.py --threads 1,2,4,8 --rounds 3   # 16-core machine
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

PROMPT = [1, 450, 1270, 310, 2706, 892, 322, 278, 5828, 1058]  # ids of the 8000-token vocabulary
BOUNDS = ("64 MB copy", "64 MB copy in huge pages", "read of the weights' size in huge pages")


# --- llama.cpp ---
def converter() -> str:
    """convert_hf_to_gguf.py from the sdist of the installed llama-cpp-python (pip downloads it once)."""
    import llama_cpp

    cache = os.path.expanduser(f"~/.cache/smolcluster/llama-cpp-python-{llama_cpp.__version__}")
    script = os.path.join(cache, f"llama_cpp_python-{llama_cpp.__version__}", "vendor/llama.cpp/convert_hf_to_gguf.py")
    if not os.path.isfile(script):
        os.makedirs(cache, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", cache]
            + [f"llama-cpp-python=={llama_cpp.__version__}"],
            check=True,
        )
        subprocess.run(["tar", "xzf", f"llama_cpp_python-{llama_cpp.__version__}.tar.gz"], cwd=cache, check=True)
    return script


def gguf_files(model: str) -> dict:
    """f32, q8_0 and q4_0 GGUF files of the checkpoint (made once)."""
    import ctypes

    import llama_cpp

    out = {k: os.path.join(model, f"{k}.gguf") for k in ("f32", "q8_0", "q4_0")}
    if not os.path.isfile(out["f32"]):
        subprocess.run([sys.executable, converter(), model, "--outtype", "f32", "--outfile", out["f32"]], check=True)
    for k, ftype in (("q8_0", llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0), ("q4_0", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0)):
        if not os.path.isfile(out[k]):
            p = llama_cpp.llama_model_quantize_default_params()
            p.ftype, p.nthread, p.pure = ftype, 1, True
            if llama_cpp.llama_model_quantize(out["f32"].encode(), out[k].encode(), ctypes.byref(p)) != 0:
                raise RuntimeError(f"llama.cpp could not quantise to {k}")
    return out


class LlamaCpp:
    def __init__(self, path: str, threads: int):
        from llama_cpp import Llama

        self.llm = Llama(path, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)

    def logits(self):
        """The last position's logits (llama-cpp-python keeps them only with logits_all; read them in place)."""
        import llama_cpp
        import numpy as np

        ptr = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.llm.n_vocab(),))

    def first_logits(self, prompt):
        self.llm.reset()
        self.llm.eval(prompt)
        return self.logits().copy()

    def decode(self, prompt, n: int) -> tuple[list[int], float, float]:
        llm = self.llm
        llm.reset()
        llm.eval(prompt)
        out = [int(self.logits().argmax())]
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n - 1):
            llm.eval([out[-1]])
            out.append(int(self.logits().argmax()))
        return out, time.perf_counter() - t0, time.process_time() - c0


# --- ours ---
class Ours:
    def __init__(self, model: str, quantize: str | None, native: bool = True, huge: bool = True):
        """For the A/Bs: `native` False: torch's kernels and operations (and numpy's BLAS) instead of
        ours (models.native); `huge` False: the weights in 4 KB pages (models.hugepages)."""
        from smoltrain.models import backends, hugepages
        from smoltrain.models.hf import Checkpoint
        from smoltrain.models.stage import Stage

        ck = Checkpoint(model)
        saved = hugepages.available
        if not huge:
            hugepages.available = lambda: False
        try:
            with backends.using("auto" if native else "torch"):
                self.stage = Stage(
                    ck, 0, ck.config.layers, True, True, quantize=quantize, batched=False
                )  # as `generate`
        finally:
            hugepages.available = saved
        self.kernel = self.stage.blocks[0].qkv.kernel

    def first_logits(self, prompt):
        import torch

        self.stage.open(0, len(prompt) + 1)
        return self.stage(torch.tensor([prompt]), [0])[0].numpy()

    def decode(self, prompt, n: int) -> tuple[list[int], float, float]:
        """Greedy batch-1 decode in slot 0: the prefill, then n - 1 timed steps."""
        import torch

        st = self.stage
        st.open(0, len(prompt) + n)
        out = [int(st(torch.tensor([prompt]), [0])[0].argmax())]
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n - 1):
            out.append(int(st(torch.tensor([[out[-1]]]), [0])[0].argmax()))
        return out, time.perf_counter() - t0, time.process_time() - c0


def matmul_share(stage, steps: int = 8) -> float:
    """Share of a decode step's CPU time spent in the matmul kernels (torch profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from smoltrain.models.quant import Linear

    stage.open(0, len(PROMPT) + steps + 4)
    stage(torch.tensor([PROMPT]), [0])
    tok = torch.tensor([[7]])
    call = Linear.__call__

    def named(self, x):  # numpy's product and ours are no torch operations: a range of their own
        if self.kernel not in ("blas", "gemv", "q4_0", "q8_0"):
            return call(self, x)
        with record_function(self.kernel):
            return call(self, x)

    Linear.__call__ = named
    try:
        with profile(activities=[ProfilerActivity.CPU]) as p:
            for _ in range(steps):
                stage(tok, [0])
    finally:
        Linear.__call__ = call
    kernels = (
        "aten::mm",
        "aten::addmm",
        "aten::mkldnn_linear",
        "blas",  # numpy's one-row product (models.quant), a range of its own (above)
        "gemv",  # ours (models.native), likewise
        "q4_0",
        "q8_0",
        "quantized::linear_dynamic",
        "aten::_weight_int8pack_mm",
        "aten::_weight_int4pack_mm_for_cpu",
    )
    rows = p.key_averages()
    total = sum(r.self_cpu_time_total for r in rows)
    return sum(r.self_cpu_time_total for r in rows if r.key in kernels) / total if total else 0.0


def _rate(fn, nbytes: int, seconds: float) -> tuple[float, float]:
    """(wall, CPU-time) bytes/s of fn, which moves `nbytes`, run for `seconds` (3 calls at least)."""
    fn()
    n, t0, c0 = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < seconds or n < 3:
        fn()
        n += 1
    return nbytes * n / (time.perf_counter() - t0), nbytes * n / (time.process_time() - c0)


def copy_bw(seconds: float = 0.5, huge: bool = False) -> tuple[float, float]:
    """(wall, CPU-time) bytes/s of a 64 MB copy (read + write), past any last-level cache: in
    torch's memory as calibrate times it, or (`huge`) in huge pages as the decode weights are held."""
    import torch

    from smoltrain.host import COPY_BYTES
    from smoltrain.models import hugepages

    src = torch.ones(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    if huge:
        src, dst = hugepages.hold(src), hugepages.hold(dst)
    return _rate(lambda: dst.copy_(src), 2 * COPY_BYTES, seconds)


def read_buffer(nbytes: int):
    """fp32 values of `nbytes`, in huge pages as the decode weights are held (made once a bench)."""
    import torch

    from smoltrain.models import hugepages

    return hugepages.hold(torch.full((nbytes // 4,), 0.5))


def read_bw(buf, seconds: float = 0.5) -> tuple[float, float]:
    """(wall, CPU-time) bytes/s of a read of `buf` (torch's sum): what a decode step does to its
    weights, over as many bytes and in the same memory, with no writes beside it."""
    return _rate(lambda: buf.sum(), buf.numel() * 4, seconds)


def agree(a: list[int], b: list[int]) -> int:
    """Tokens equal before the first difference (greedy runs diverge for good after one)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def bench(args, threads: int) -> dict:
    from smoltrain.host import set_threads
    from smoltrain.models import backends, hugepages

    set_threads(threads)
    engines = {"fp32": Ours(args.model, None), "int8": Ours(args.model, "int8"), "q4": Ours(args.model, "q4")}
    if engines["fp32"].kernel == "gemv":  # ours; numpy's BLAS and torch's operations beside it
        engines["fp32 numpy BLAS"] = Ours(args.model, None, native=False)
    if hugepages.available():  # the same engine with its weights in 4 KB pages
        engines["fp32 4K pages"] = Ours(args.model, None, huge=False)
    if engines["q4"].kernel == "q4_0":  # ours; torch's int4 kernel beside it
        engines["q4 torch int4"] = Ours(args.model, "q4", native=False)
    if engines["int8"].kernel == "q8_0":  # ours (Q8_0 x Q8_0); fbgemm's per-tensor dynamic int8 beside it
        engines["int8 torch fbgemm"] = Ours(args.model, "int8", native=False)
    wbytes = {k: e.stage.weight_bytes_per_token() for k, e in engines.items()}
    files = None
    if not args.no_llama:
        files = gguf_files(args.model)
        engines["llama.cpp Q8_0"] = LlamaCpp(files["q8_0"], threads)
        engines["llama.cpp Q4_0"] = LlamaCpp(files["q4_0"], threads)
    rows = {k: {"wall": [], "cpu": []} for k in engines}
    measures = {  # the bound's candidates: the highest median is the bound
        BOUNDS[0]: copy_bw,
        BOUNDS[1]: lambda: copy_bw(huge=True),
        BOUNDS[2]: functools.partial(read_bw, read_buffer(wbytes["fp32"])),
    }
    bws = {k: {"wall": [], "cpu": []} for k in measures}
    tokens: dict[str, list[int]] = {}
    for r in range(args.rounds):
        for k, fn in measures.items():
            wall, cpu = fn()
            bws[k]["wall"].append(wall)
            bws[k]["cpu"].append(cpu)
        for k, e in engines.items():
            ids, wall, cpu = e.decode(PROMPT, args.tokens)
            rows[k]["wall"].append((args.tokens - 1) / wall)
            rows[k]["cpu"].append((args.tokens - 1) / cpu)
            tokens[k] = ids
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v['wall'][-1]:.1f}" for k, v in rows.items()))
    del measures  # and the read's buffer
    med = {k: {m: statistics.median(v[m]) for m in ("wall", "cpu")} for k, v in rows.items()}
    bw = {k: {m: statistics.median(v[m]) for m in ("wall", "cpu")} for k, v in bws.items()}
    source = max(bw, key=lambda k: bw[k]["wall"])
    mem_bw, mem_bw_cpu = bw[source]["wall"], bw[source]["cpu"]
    out = {
        "threads": threads,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "bound_source": source,
        "bounds_bytes_s": {k: v["wall"] for k, v in bw.items()},
        "bound_bytes_s": mem_bw,
        "bound_bytes_per_cpu_s": mem_bw_cpu,
        "mem_bw_bytes_s": bw[BOUNDS[0]]["wall"],
        "mem_bw_bytes_per_cpu_s": bw[BOUNDS[0]]["cpu"],
        "mem_bw_huge_pages_bytes_s": bw[BOUNDS[1]]["wall"],
        "mem_read_bw_bytes_s": bw[BOUNDS[2]]["wall"],
        "weight_bytes_per_token": wbytes,
        "tokens_per_s": {k: v["wall"] for k, v in med.items()},
        "tokens_per_cpu_s": {k: v["cpu"] for k, v in med.items()},
        "roofline_tokens_per_s": {k: mem_bw / b for k, b in wbytes.items()},
        "roofline_tokens_per_cpu_s": {k: mem_bw_cpu / b for k, b in wbytes.items()},
        "kernels": {k: e.kernel for k, e in engines.items() if isinstance(e, Ours)},
        "backend": backends.report(),
        "matmul_share": {k: matmul_share(engines[k].stage) for k in engines if isinstance(engines[k], Ours)},
        "agreement": {
            "int8 vs fp32": agree(tokens["int8"], tokens["fp32"]),
            "q4 vs fp32": agree(tokens["q4"], tokens["fp32"]),
        },
    }
    if files:
        f32 = LlamaCpp(files["f32"], threads)
        import numpy as np

        ref = engines["fp32"].first_logits(PROMPT)
        out["llama_f32_logit_max_abs_diff"] = float(np.abs(f32.first_logits(PROMPT) - ref).max())
        out["logit_rms_error_vs_fp32"] = {
            k: float(np.sqrt(((engines[k].first_logits(PROMPT) - ref) ** 2).mean()))
            for k in ("int8", "int8 torch fbgemm", "q4", "q4 torch int4", "llama.cpp Q8_0", "llama.cpp Q4_0")
            if k in engines
        }
        out["logit_std"] = float(ref.std())
        out["agreement"].update(
            {
                "llama.cpp Q8_0 vs fp32": agree(tokens["llama.cpp Q8_0"], tokens["fp32"]),
                "llama.cpp Q4_0 vs fp32": agree(tokens["llama.cpp Q4_0"], tokens["fp32"]),
                "int8 vs llama.cpp Q8_0": agree(tokens["int8"], tokens["llama.cpp Q8_0"]),
                "q4 vs llama.cpp Q4_0": agree(tokens["q4"], tokens["llama.cpp Q4_0"]),
            }
        )
        if "int8 torch fbgemm" in tokens:
            out["agreement"]["int8 torch fbgemm vs fp32"] = agree(tokens["int8 torch fbgemm"], tokens["fp32"])
        if "q4 torch int4" in tokens:
            out["agreement"]["q4 torch int4 vs llama.cpp Q4_0"] = agree(
                tokens["q4 torch int4"], tokens["llama.cpp Q4_0"]
            )
    return out


def train_step_s(threads: int) -> float:
    import torch

    from smoltrain.calibration.probe import train_seconds
    from smoltrain.host import set_threads

    set_threads(threads)
    return train_seconds(torch, "tiny", 8, 64, 1.0)


def report(d: dict) -> None:
    t, tc, rf, rfc = (
        d["tokens_per_s"],
        d["tokens_per_cpu_s"],
        d["roofline_tokens_per_s"],
        d["roofline_tokens_per_cpu_s"],
    )
    bounds = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in d["bounds_bytes_s"].items())
    print(
        f"\n{d['threads']} thread(s), memory bandwidth GB/s: {bounds}; the bound: {d['bound_source']}, "
        f"{d['bound_bytes_s'] / 1e9:.1f} GB/s, {d['bound_bytes_per_cpu_s'] / 1e9:.1f} GB per CPU-s; "
        f"medians of {d['rounds']} rounds"
    )
    print(
        f"{'engine':<16}{'tok/s':>8}{'tok/CPU-s':>11}{'weights MB':>12}{'of roofline':>13}{'(CPU time)':>12}{'matmul share':>14}"
    )
    for k in t:
        wb = d["weight_bytes_per_token"].get(k)
        line = f"{k:<16}{t[k]:>8.1f}{tc[k]:>11.1f}"
        if wb:
            line += f"{wb / 1e6:>12.0f}{t[k] / rf[k]:>13.0%}{tc[k] / rfc[k]:>12.0%}{d['matmul_share'][k]:>14.0%}"
        print(line)
    print(
        f"int8/fp32 {t['int8'] / t['fp32']:.2f}x, q4/fp32 {t['q4'] / t['fp32']:.2f}x (CPU time: "
        f"{tc['int8'] / tc['fp32']:.2f}x, {tc['q4'] / tc['fp32']:.2f}x)"
    )
    if "fp32 numpy BLAS" in t:
        print(
            f"fp32 on our one-row kernels / on numpy's BLAS and torch's operations: {t['fp32'] / t['fp32 numpy BLAS']:.2f}x"
        )
    if "fp32 4K pages" in t:
        print(f"fp32 in huge pages / in 4 KB pages: {t['fp32'] / t['fp32 4K pages']:.2f}x")
    if "q4 torch int4" in t:
        print(f"q4 on our Q4_0 kernel / on torch's int4 kernel: {t['q4'] / t['q4 torch int4']:.2f}x")
    if "llama.cpp Q8_0" in t:
        print(
            f"int8 / llama.cpp Q8_0 {t['int8'] / t['llama.cpp Q8_0']:.2f}x, q4 / llama.cpp Q4_0 "
            f"{t['q4'] / t['llama.cpp Q4_0']:.2f}x (CPU time: {tc['int8'] / tc['llama.cpp Q8_0']:.2f}x, "
            f"{tc['q4'] / tc['llama.cpp Q4_0']:.2f}x); llama.cpp f32 logits vs ours: "
            f"max |diff| {d['llama_f32_logit_max_abs_diff']:.2e}"
        )
        err = d["logit_rms_error_vs_fp32"]
        errs = ", ".join(f"{k} {v:.4f}" for k, v in err.items())
        print(f"logit RMS error vs our fp32 (logit std {d['logit_std']:.3f}): {errs}")
        print(
            f"int8 logit error / llama.cpp Q8_0's {err['int8'] / err['llama.cpp Q8_0']:.2f}x (bar: at most 1.1x), "
            f"q4 / Q4_0's {err['q4'] / err['llama.cpp Q4_0']:.2f}x"
        )
    print(
        "greedy tokens agreeing before the first difference: "
        + ", ".join(f"{k} {v}/{d['tokens']}" for k, v in d["agreement"].items())
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="/tmp/smol-bench-llama152", help="checkpoint folder (built there if missing)")
    p.add_argument("--threads", default="1", help="thread count, or a list (1,2,4,8) for the scaling table")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--no-llama", action="store_true", help="leave llama.cpp out")
    p.add_argument("--json")
    args = p.parse_args()
    from llama_checkpoint import build, params

    build(args.model)
    print(f"{args.model}: {params(args.model) / 1e6:.0f}M parameters")
    counts = [int(x) for x in args.threads.split(",")]
    runs = [bench(args, n) for n in counts]
    for d in runs:
        report(d)
    if len(counts) > 1:
        print("\nthreads  " + "  ".join(f"{k:>14}" for k in runs[0]["tokens_per_s"]) + "  tiny train step ms")
        for d in runs:
            cols = "  ".join(f"{v:>14.1f}" for v in d["tokens_per_s"].values())
            d["train_step_s"] = train_step_s(d["threads"])
            print(f"{d['threads']:>7}  {cols}  {d['train_step_s'] * 1e3:>18.1f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    from common import exit_code, write_result
    from decode_bars import BAR, verdict

    met, headline = verdict(runs[0])
    kept = write_result("decode", BAR, met, headline, {"runs": runs})
    print(f"{headline}: {'met' if met else 'MISSED'} ({kept})")
    return exit_code(met)


if __name__ == "__main__":
    sys.exit(main())
