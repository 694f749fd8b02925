"""q4_0.c built for this machine and called through ctypes: llama.cpp's Q4_0 x Q8_0 product.

Why our own kernel: torch's int4 CPU kernel (`_weight_int4pack_mm_for_cpu`) widens every
weight to float and multiplies in float, 53-57 ns per thousand multiply-adds on the x86
machine of BENCHMARKS.md, which held q4 decode under half of llama.cpp's speed whatever
else was cut. Multiplying the bytes as integers (activations quantised to int8 per group of
32, as llama.cpp does) is what the CPU's byte dot-product instructions are for.

The C file is compiled once per machine (-march=native: the cache key holds the CPU's
flags, so hosts sharing a home directory over NFS each get their own) into
~/.cache/smolcluster, atomically, so ranks starting together do not trip over each other.
Where no C compiler is found the build fails quietly and `models.quant` keeps torch's kernel.
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

SOURCE = Path(__file__).with_name("q4_0.c")
GROUP = 32


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


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The built kernel, or None: no C compiler, no x86 vector instructions (AVX2 at least), or
    SMOL_Q4_NATIVE=0."""
    if os.environ.get("SMOL_Q4_NATIVE", "1") == "0":
        return None
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        return None
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + platform.machine().encode() + _cpu_flags().encode()).hexdigest()[:16]
    lib = _cache_dir() / f"q4_0-{key}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=lib.parent, suffix=".so")
        os.close(fd)
        cmd = [cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(SOURCE), "-o", tmp, "-lm"]
        try:
            r = subprocess.run(cmd, capture_output=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            r = None
        if r is None or r.returncode != 0:
            os.unlink(tmp)
            return None
        os.replace(tmp, lib)
    try:
        so = ctypes.CDLL(str(lib))
    except OSError:
        return None
    f, p = so.q4_0_mm, ctypes.c_void_p
    f.argtypes = [p, ctypes.c_int, ctypes.c_int, p, p, ctypes.c_int, p, ctypes.c_int]
    f.restype = ctypes.c_int
    so.q4_0_simd.restype = ctypes.c_int
    return so if so.q4_0_simd() > 0 else None  # plain C would be slower than torch's kernel


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


def mm(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x fp32 [M, K] times the Q4_0 weight (qs [N, K/2], d fp32 [N, K/32]) transposed: [M, N]."""
    so = library()
    x = x.float().contiguous()
    m, k = x.shape
    n = qs.shape[0]
    y = torch.empty(m, n)
    rc = so.q4_0_mm(x.data_ptr(), m, k, qs.data_ptr(), d.data_ptr(), n, y.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise MemoryError(f"q4_0_mm failed on a [{m}, {k}] x [{n}, {k}] product")
    return y
