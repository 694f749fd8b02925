"""What a rank runs on, settled on the host itself: torch threads, device, dtype.

Each process that computes (training rank, inference rank, calibration probe) calls
`setup` first, so all of them run at the host's `smol_threads` (default: the CPUs it may
use, smolnet.cpus) on its `smol_device`, and refuse a dtype its torch cannot run with one
line rather than a traceback.
"""

from __future__ import annotations

from smolnet.cpus import usable_cpus
from smolnet.errors import UsageError

TORCH_DTYPES = ("fp32", "bf16", "fp16")


def check_threads(n: int | None, where: str = "this host", cpus: int | None = None) -> int:
    """The thread count to run at: `n`, or the usable CPUs when n is None or 0 means default."""
    cpus = usable_cpus() if cpus is None else cpus
    if n is None:
        return cpus
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise UsageError(f"threads must be a whole number of at least 1, got {n!r}")
    if n > cpus:
        raise UsageError(f"{n} threads, but {where} may use {cpus} CPU(s) (affinity, cpuset and CPU quota)")
    return n


def spare_core(threads: int) -> bool:
    """Whether this process may use a CPU beside its `threads` torch threads: where a
    transport thread can send while they compute (the plan's `comm_core`, from the same
    affinity, cpuset and quota)."""
    return usable_cpus() - threads >= 1


def resolve_device(want: str | None) -> str:
    """`smol_device`: auto picks cuda, then mps, then cpu; an explicit device must exist. The
    CPU always does, and a controller that asks about it need not import torch (a second
    of start-up for every run)."""
    if want == "cpu":
        return want
    import torch

    if want in (None, "", "auto"):
        if torch.cuda.is_available():
            return "cuda"
        mps = getattr(torch.backends, "mps", None)
        return "mps" if mps is not None and mps.is_available() else "cpu"
    if want == "cuda" and not torch.cuda.is_available():
        raise UsageError("smol_device cuda, but torch sees no CUDA device on this host")
    if want == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise UsageError("smol_device mps, but torch sees no MPS device on this host")
    return want


def check_dtype(dtype: str, device: str) -> None:
    """Refuse a compute dtype this torch cannot multiply in on `device` (a tiny matmul tells;
    fp32 on a CPU always multiplies, so that needs no torch here)."""
    if dtype == "fp32" and device == "cpu":
        return
    import torch

    t = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    try:
        a = torch.ones(4, 4, dtype=t, device=device)
        (a @ a).sum().item()
    except (RuntimeError, TypeError, AssertionError) as e:
        line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UsageError(f"--dtype {dtype}: torch on this host cannot compute in it on {device} ({line})") from None


def set_threads(n: int) -> None:
    """torch's threads and those of the BLAS numpy links (a one-row decode product runs there,
    models.quant), which would otherwise start one per core whatever `smol_threads` says."""
    import numpy  # noqa: F401  (threadpoolctl finds the BLAS of the libraries already loaded)
    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(n)
    threadpool_limits(n, user_api="blas")


def setup(threads: int | None, device: str | None = "cpu", dtype: str | None = None) -> tuple[int, str]:
    """Set the thread count (torch's and numpy's BLAS), settle the device and check the dtype:
    (threads, device)."""
    n = check_threads(threads or None)
    set_threads(n)
    dev = resolve_device(device)
    if dtype:
        check_dtype(dtype, dev)
    return n, dev


def keep_freed_memory() -> bool:
    """A training process keeps the memory it frees for its next step (True where it could).

    Every step frees and allocates again its gradients and activations (~0.5 GB a step on a
    135M model). glibc returns blocks over its mmap threshold (32 MB at most: the embedding's
    gradient, the logits) to the kernel, and trims the heap's top, so the next step faults
    each page in again, zeroed by the kernel: 70-130 thousand faults and ~0.1-0.3 s a step of
    a 135M model on one thread (BENCHMARKS.md, fine-tuning). No mmap and no trimming keep
    them in the heap, as torch's GPU allocators keep theirs. Without glibc's mallopt (macOS,
    musl): nothing changes. Calibration's timed training step calls it too, so the plan
    measures what the run does."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # malloc.h
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


COPY_BYTES = 64 << 20  # per buffer: beyond the last-level cache of the machines people own


def copy_bandwidth(window: float = 0.05) -> float:
    """Bytes/s this process moves through memory (read + write of a copy), at its thread count."""
    import torch

    from smoltrain.calibration.probe import copy_bw

    return copy_bw(torch, COPY_BYTES, window)


def rank_facts(stage, threads: int, device: str) -> dict:
    """What an inference rank tells the report about its machine: threads, device, the decode
    kernels (models.backends), the weight bytes one decode step reads here, and the memory
    bandwidth they are read at."""
    from smoltrain.models import backends

    return {
        "threads": threads,
        "kernels": backends.report(),
        "device": device,
        "weight_bytes_per_token": stage.weight_bytes_per_token(),
        "mem_bw_bytes_s": copy_bandwidth() if device == "cpu" else None,
    }
