"""kernels.c built for this machine and called through ctypes: the decode kernels we write ourselves.

Why our own kernels (BENCHMARKS.md, the x86 machine there, one thread):
- q4: torch's int4 CPU kernel (`_weight_int4pack_mm_for_cpu`) widens every weight to float and
  multiplies in float, 53-57 ns per thousand multiply-adds, which held q4 decode under half of
  llama.cpp's speed whatever else was cut. Multiplying the bytes as integers (activations
  quantised to int8 per group of 32, llama.cpp's Q4_0 x Q8_0) is what the CPU's byte
  dot-product instructions are for: 28-36 ns.
- fp32 at one row (`generate`): a dot product per weight row streamed the decode shapes at
  28 GB/s where the BLAS numpy links (OpenBLAS) made 25 and oneDNN less.
- the rest of a one-row fp32 decode step (`_one_token` of llama.LlamaBlock and gpt2.GPT2Block):
  the norms, RoPE with the cache writes and attention, the MLP's activation, each one call
  where torch ran several operations at a few microseconds of dispatch each (on a q4 step
  0.7 ms left where there were 1.7).

The C file is compiled once per machine (-march=native: the cache key holds the CPU's flags,
so hosts sharing a home directory over NFS each get their own) into ~/.cache/smolcluster,
atomically, so ranks starting together do not trip over each other. Where no C compiler is
found, or the CPU has no AVX2, `library()` is None and `models.quant` keeps torch's kernels
(and numpy's BLAS). SMOL_NATIVE=0 asks for those too (an A/B switch for benchmarks).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("kernels.c")
GROUP = 32  # Q4_0's group along the input dimension


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "smolcluster"


def build(lib: Path, march: str = "native") -> bool:
    """Compile kernels.c into `lib` for `march` (the tests build each instruction path)."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        return False
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=lib.parent, suffix=".so")
    os.close(fd)
    cmd = [cc, "-O3", f"-march={march}", "-fopenmp", "-shared", "-fPIC", str(SOURCE), "-o", tmp, "-lm"]
    try:
        ok = subprocess.run(cmd, capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if ok:
        os.replace(tmp, lib)
    else:
        os.unlink(tmp)
    return ok


def load(lib: Path) -> ctypes.CDLL | None:
    try:
        so = ctypes.CDLL(str(lib))
    except OSError:
        return None
    p, i = ctypes.c_void_p, ctypes.c_int
    so.q4_0_mm.argtypes = [p, i, i, p, p, i, p, i]
    so.f32_gemv.argtypes = [p, i, p, i, p, i]
    f = ctypes.c_float
    so.rms_norm_row.argtypes = [p, p, i, f, p]
    so.attend_row.argtypes = [p, i, i, i, p, p, p, p, i, i, p, i]
    so.swiglu_row.argtypes = [p, i, p]
    so.layer_norm_row.argtypes = [p, p, p, i, f, p]
    so.gelu_row.argtypes = [p, i, i, p]
    so.q4_0_mm.restype = so.f32_gemv.restype = so.simd.restype = so.attend_row.restype = i
    so.rms_norm_row.restype = so.swiglu_row.restype = so.layer_norm_row.restype = so.gelu_row.restype = None
    return so


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The built kernels, or None: no C compiler, no x86 vector instructions (AVX2 at least),
    or SMOL_NATIVE=0."""
    if os.environ.get("SMOL_NATIVE", "1") == "0":
        return None
    key = hashlib.sha256(SOURCE.read_bytes() + platform.machine().encode() + _cpu_flags().encode()).hexdigest()
    lib = _cache_dir() / f"kernels-{key[:16]}.so"
    if not lib.exists() and not build(lib):
        return None
    so = load(lib)
    return so if so is not None and so.simd() > 0 else None  # plain C would be slower than torch's kernels


def pack(q: torch.Tensor) -> torch.Tensor:
    """q int [N, K] in 0..15 -> Q4_0's bytes [N, K/2]: in each group of 32, byte j holds q[j]
    (low nibble) and q[j+16] (high)."""
    n, k = q.shape
    g = q.to(torch.uint8).reshape(n, k // GROUP, 2, GROUP // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack(qs: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack`: q int32 [N, K]."""
    n, half = qs.shape
    g = qs.reshape(n, half // (GROUP // 2), GROUP // 2)
    return torch.stack([g & 0x0F, g >> 4], dim=2).reshape(n, half * 2).to(torch.int32)


def q4_mm(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, so: ctypes.CDLL | None = None) -> torch.Tensor:
    """x fp32 [M, K] times the Q4_0 weight (qs [N, K/2], d fp32 [N, K/32]) transposed: [M, N]."""
    x = x.float().contiguous()
    m, k = x.shape
    y = torch.empty(m, qs.shape[0])
    so = so or library()
    rc = so.q4_0_mm(x.data_ptr(), m, k, qs.data_ptr(), d.data_ptr(), qs.shape[0], y.data_ptr(), _threads())
    if rc != 0:
        raise MemoryError(f"q4_0_mm failed on a [{m}, {k}] x [{qs.shape[0]}, {k}] product")
    return y


def gemv(x: torch.Tensor, w: torch.Tensor, so: ctypes.CDLL | None = None) -> torch.Tensor:
    """One fp32 row x [K] times W [N, K] transposed: [N]."""
    x = x.float().contiguous()
    y = torch.empty(w.shape[0])
    (so or library()).f32_gemv(x.data_ptr(), w.shape[1], w.data_ptr(), w.shape[0], y.data_ptr(), _threads())
    return y


def row_path(one_row: bool, dtype, device) -> bool:
    """Whether an inference block runs one sequence's decode steps through the row kernels
    below (`_one_token` of llama.LlamaBlock and gpt2.GPT2Block): a one-row (`generate`)
    block at fp32 on the CPU, where the kernels built."""
    return one_row and dtype == torch.float32 and torch.device(device).type == "cpu" and library() is not None


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm of one fp32 row (x [..., k], one row in all)."""
    x = x.contiguous()
    y = torch.empty_like(x)
    library().rms_norm_row(x.data_ptr(), w.data_ptr(), x.shape[-1], eps, y.data_ptr())
    return y


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    """torch's LayerNorm of one fp32 row (GPT-2)."""
    x = x.contiguous()
    y = torch.empty_like(x)
    library().layer_norm_row(x.data_ptr(), w.data_ptr(), b.data_ptr(), x.shape[-1], eps, y.data_ptr())
    return y


def gelu(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """F.gelu of one fp32 row; `approximate` "tanh" or "none", as F.gelu takes it."""
    x = x.contiguous()
    y = torch.empty_like(x)
    library().gelu_row(x.data_ptr(), x.numel(), approximate == "tanh", y.data_ptr())
    return y


def attend(qkv: torch.Tensor, heads: int, kv_heads: int, k: torch.Tensor, v: torch.Tensor, rope, pos: int):
    """One new position of one sequence at fp32: qkv [..., (heads + 2 kv_heads) hd] (one row);
    RoPE from `rope` = (cos, sin) [max_len, hd] at row `pos` (None: none, GPT-2); the rotated
    keys and the values written into the cache k, v [1, kv_heads, max_len, hd] at `pos`; each
    query head attends over positions 0..pos of its kv head. Returns [..., heads hd]."""
    max_len, hd = k.shape[2], k.shape[3]
    if not 0 <= pos < max_len:  # torch's slice assignment refuses this; C would write past the cache
        raise IndexError(f"position {pos} outside a KV cache of {max_len} positions")
    qkv = qkv.contiguous()
    out = torch.empty(*qkv.shape[:-1], heads * hd)
    at = 4 * pos * hd  # bytes into the tables' row `pos`
    cos, sin = (None, None) if rope is None else (rope[0].data_ptr() + at, rope[1].data_ptr() + at)
    rc = library().attend_row(
        qkv.data_ptr(),
        heads,
        kv_heads,
        hd,
        cos,
        sin,
        k.data_ptr(),
        v.data_ptr(),
        max_len,
        pos,
        out.data_ptr(),
        _threads(),
    )
    if rc != 0:
        raise MemoryError(f"attend_row: no scratch memory for {heads} heads over {pos + 1} positions")
    return out


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    """silu(g) * u for one fp32 row gu = [g | u]: [..., 2f] -> [..., f]."""
    gu = gu.contiguous()
    f = gu.shape[-1] // 2
    y = torch.empty(*gu.shape[:-1], f)
    library().swiglu_row(gu.data_ptr(), f, y.data_ptr())
    return y


def _threads() -> int:
    return torch.get_num_threads()
