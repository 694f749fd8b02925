"""q4_0.c and kernels.c built for this machine and called through ctypes: the decode kernels we write ourselves.

Why our own kernels (BENCHMARKS.md, the x86 machine there, one thread):
- q4: torch's int4 CPU kernel (`_weight_int4pack_mm_for_cpu`) widens every weight to float and
  multiplies in float, 53-57 ns per thousand multiply-adds, which held q4 decode under half of
  llama.cpp's speed whatever else was cut. Multiplying the bytes as integers (activations
  quantised to int8 per group of 32, llama.cpp's Q4_0 x Q8_0) is what the CPU's byte
  dot-product instructions are for: 28-36 ns.
- int8: llama.cpp's Q8_0 x Q8_0 (a scale per 32 weights and per 32 activations), where fbgemm
  rounds a call's activations with one 7-bit scale (issue 39: 1.7x the logit error).
- fp32 at one row (`generate`): a dot product per weight row streamed the decode shapes at
  28 GB/s where the BLAS numpy links (OpenBLAS) made 25 and oneDNN less; four rows at a time
  (four streams in flight, each row summed as alone) 1.16x that again (issue 39).
- the rest of a one-row fp32 decode step (`_one_token` of llama.LlamaBlock and gpt2.GPT2Block):
  the norms, RoPE with the cache writes and attention, the MLP's activation, each one call.

The C files are compiled once per machine (-march=native on x86, -mcpu=native on Arm: the
cache key holds the CPU's flags, so hosts sharing a home directory each get their own) into
~/.cache/smolcluster, a directory only its owner may use, atomically, so ranks starting together
do not trip over each other. A library is loaded only from that private directory, owned by the
user, and only when its bytes hash to what the build wrote beside it: a `.so` planted there is
rebuilt over, never run. A compiler without OpenMP (Apple's clang) builds with -fopenmp-simd,
one thread a call. A failed build is cached with its reason (one failure per compiler, not one
per process) and said once. Every wrapper checks shapes, dtypes, contiguity and alignment
before a pointer crosses into C, with a ValueError that names the argument.

Which kernels a process uses is models.backends' choice; `library()` is None (and `status()`
says why) where no C compiler is found, the build fails, the CPU has neither AVX2 nor NEON,
or SMOL_NATIVE=0.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).parent
SOURCES = (HERE / "q4_0.c", HERE / "kernels.c")
GROUP = 32  # Q4_0's and Q8_0's group along the input dimension
ISA = {0: "c", 1: "avx2", 2: "avx512-vnni", 3: "neon", 4: "neon-dotprod"}  # simd() -> name
OPENMP_FLAGS = (["-fopenmp"], ["-fopenmp-simd"], [])  # Apple's clang has no -fopenmp


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def arm() -> bool:
    return platform.machine().lower() in ("aarch64", "arm64")


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "smolcluster"


def compiler() -> str | None:
    """$CC (a name on PATH or a path; one that is not there is no compiler: never another in its
    place), else cc, gcc or clang on PATH."""
    if os.environ.get("CC"):
        return shutil.which(os.environ["CC"])
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _arch_flags(march: str | None) -> list[list[str]]:
    if march:
        return [[f"-march={march}"]]
    return [["-mcpu=native"], []] if arm() else [["-march=native"]]


def build(lib: Path, march: str | None = None, cc: str | None = None) -> list[str]:
    """Compile the C files into `lib` (for `march`: the tests build each instruction path) and
    write its sha256 beside it. Returns the flags that built it; raises OSError with the
    compiler's first error line where none did."""
    cc = cc or compiler()
    if not cc:
        raise OSError(f"no C compiler (CC={os.environ['CC']!r} not found)" if os.environ.get("CC") else "no C compiler")
    fd, tmp = tempfile.mkstemp(dir=lib.parent, suffix=".so")
    os.close(fd)
    why = ""
    try:
        for arch in _arch_flags(march):
            for omp in OPENMP_FLAGS:
                flags = ["-O3", *arch, *omp]
                cmd = [cc, *flags, "-shared", "-fPIC", *map(str, SOURCES), "-o", tmp, "-lm"]
                try:
                    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
                except (OSError, subprocess.TimeoutExpired) as e:
                    raise OSError(f"{cc}: {e}") from None
                if run.returncode == 0:
                    digest = hashlib.sha256(Path(tmp).read_bytes()).hexdigest()
                    _write(lib.with_suffix(".sha256"), digest)
                    os.replace(tmp, lib)
                    return flags
                errors = [x for x in run.stderr.splitlines() if "error" in x] or run.stderr.splitlines() or ["?"]
                why = why or f"{Path(cc).name} {' '.join(flags)}: {errors[0].strip()}"
        raise OSError(why)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def private(d: Path) -> Path:
    """`d`, created 0700; refused (OSError) where it is a link or another user's, narrowed to 0700
    where it is ours but open to others: whoever can write there runs code in every rank."""
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.lstat(d)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise OSError(f"{d} is not a directory of its own (a link?)")
    if st.st_uid != os.getuid():
        raise OSError(f"{d} belongs to uid {st.st_uid}, not this user ({os.getuid()})")
    if st.st_mode & 0o077:
        os.chmod(d, 0o700)
    return d


def trusted(lib: Path) -> str | None:
    """Why `lib` must not be loaded, or None: a regular file of this user's that only they may
    write, whose bytes hash to the sha256 its build wrote beside it."""
    side = lib.with_suffix(".sha256")
    for p in (lib, side):
        try:
            st = os.lstat(p)
        except OSError:
            return f"{p.name} is missing"
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            return f"{p} is not a file only this user may write"
    if hashlib.sha256(lib.read_bytes()).hexdigest() != side.read_text().strip():
        return f"{lib} does not hash to what its build wrote"
    return None


def _bind(so: ctypes.CDLL) -> ctypes.CDLL:
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    so.q4_0_mm.argtypes = [p, i, i, p, p, i, p, i]
    so.q8_0_mm.argtypes = [p, i, i, p, p, i, p, i]
    so.f32_gemv.argtypes = [p, i, p, i, p, i]
    so.rms_norm_row.argtypes = [p, p, i, f, p]
    so.attend_row.argtypes = [p, i, i, i, p, p, p, p, i, i, p, i]
    so.swiglu_row.argtypes = [p, i, p]
    so.layer_norm_row.argtypes = [p, p, p, i, f, p]
    so.gelu_row.argtypes = [p, i, i, p]
    for fn in (so.q4_0_mm, so.q8_0_mm, so.f32_gemv, so.simd, so.openmp, so.attend_row):
        fn.restype = i
    for fn in (so.rms_norm_row, so.swiglu_row, so.layer_norm_row, so.gelu_row):
        fn.restype = None
    return so


def load(lib: Path) -> ctypes.CDLL:
    """A library built by `build` (the tests load each instruction path's), refused (OSError)
    unless `trusted`."""
    why = trusted(lib)
    if why:
        raise OSError(why)
    return _bind(ctypes.CDLL(str(lib)))


def _key() -> str:
    src = b"".join(p.read_bytes() for p in SOURCES)
    return hashlib.sha256(src + platform.machine().encode() + _cpu_flags().encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def status() -> tuple[ctypes.CDLL | None, str | None]:
    """(the built kernels, None) or (None, why not), once per process."""
    if os.environ.get("SMOL_NATIVE", "1") == "0":
        return None, "SMOL_NATIVE=0"
    try:
        d = private(cache_dir())
    except OSError as e:
        return None, f"kernel cache not private: {e}"
    lib = d / f"kernels-{_key()}.so"
    if trusted(lib):  # absent, or not what our build wrote: build it (over whatever is there)
        cc = compiler()
        if not cc:
            return None, "no C compiler" + (f" (CC={os.environ['CC']!r} not found)" if os.environ.get("CC") else "")
        st = os.stat(cc)
        failed = (
            d / f"kernels-{_key()}-{hashlib.sha256(f'{cc}{st.st_mtime}{st.st_size}'.encode()).hexdigest()[:8]}.failed"
        )
        if failed.exists():
            return None, f"build failed earlier: {failed.read_text().strip()} ({failed}; delete it to retry)"
        try:
            build(lib, cc=cc)
        except OSError as e:
            _write(failed, str(e))
            print(f"smoltrain: the decode kernels did not build ({e}); torch's kernels run instead", file=sys.stderr)
            return None, f"build failed: {e}"
    try:
        so = load(lib)
    except OSError as e:
        return None, f"could not load {lib.name}: {e}"
    if so.simd() == 0:  # plain C would be slower than torch's kernels
        return None, "this CPU has neither AVX2 nor NEON"
    return so, None


def library() -> ctypes.CDLL | None:
    return status()[0]


def isa(so: ctypes.CDLL | None = None) -> str | None:
    so = so or library()
    return None if so is None else ISA.get(so.simd(), "c")


# --- checked arguments: nothing reaches C that it could index past ---
def _arg(t, name: str, dtype: torch.dtype, shape: tuple | None = None) -> torch.Tensor:
    """t itself, refused with a ValueError naming `name` unless a contiguous CPU tensor of
    `dtype` (aligned to its element) with `shape` (None in it: any size there)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: a tensor, not {type(t).__name__}")
    if t.device.type != "cpu" or t.dtype != dtype:
        raise ValueError(f"{name}: a {dtype} CPU tensor, not {t.dtype} on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: not contiguous")
    if t.data_ptr() % t.element_size():
        raise ValueError(f"{name}: not aligned to its {t.element_size()}-byte elements")
    if shape is not None and (t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape))):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name}: shape {list(t.shape)}, expected {want}")
    return t


def _rows(x: torch.Tensor, name: str = "x") -> torch.Tensor:
    """x as contiguous fp32 [M, K] (the products' activations), refused where not 2-D."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] < 1 or x.shape[1] < 1:
        raise ValueError(f"{name}: fp32 rows [M, K], got {getattr(x, 'shape', type(x).__name__)}")
    return x.float().contiguous()


def _groups(k: int) -> int:
    if k < GROUP or k % GROUP:
        raise ValueError(f"k = {k} is not a multiple of {GROUP} (Q4_0/Q8_0 groups)")
    if k >= 2**31:
        raise ValueError(f"k = {k} does not fit the kernels' int")
    return k // GROUP


def _ok(rc: int, what) -> None:
    """`what` is a callable giving the product's words: built only when the kernel refused."""
    if rc == -2:
        raise MemoryError(f"{what()}: no scratch memory")
    if rc != 0:
        raise ValueError(f"{what()}: refused by the kernel (rc {rc})")


class Packed:
    """A Q4_0 or Q8_0 weight whose bytes and scales were checked once, when it was built: a decode
    step multiplies by the same few hundred weights every token, so each product checks only its
    activations (a weight's checks cost about 5 us, a tenth of a small q4 product)."""

    __slots__ = ("fn", "q", "d", "n", "k")

    def __init__(self, fn: str, q: torch.Tensor, d: torch.Tensor, n: int, k: int):
        self.fn, self.q, self.d, self.n, self.k = fn, q, d, n, k

    def mm(self, x: torch.Tensor, so: ctypes.CDLL | None = None) -> torch.Tensor:
        """x fp32 [M, K] times this weight transposed: [M, N]."""
        x = _rows(x)
        m, k = x.shape
        if k != self.k:
            raise ValueError(f"x: {k} columns for a [{self.n}, {self.k}] weight")
        y = torch.empty(m, self.n)
        call = getattr(so or library(), self.fn)
        rc = call(x.data_ptr(), m, k, self.q.data_ptr(), self.d.data_ptr(), self.n, y.data_ptr(), _threads())
        _ok(rc, lambda: f"{self.fn} of [{m}, {k}] x [{self.n}, {k}]")
        return y


def q4_weight(qs: torch.Tensor, d: torch.Tensor) -> Packed:
    """The Q4_0 weight qs uint8 [N, K/2] with fp32 scales d [N, K/32], checked."""
    n, half = _arg(qs, "qs", torch.uint8, (None, None)).shape
    ng = _groups(2 * half)
    _arg(d, "d", torch.float32, (n, ng))
    return Packed("q4_0_mm", qs, d, n, 2 * half)


def q8_weight(q: torch.Tensor, d: torch.Tensor) -> Packed:
    """The Q8_0 weight q int8 [N, K] (-127..127) with fp16 scales d [N, K/32], checked."""
    n, k = _arg(q, "q", torch.int8, (None, None)).shape
    ng = _groups(k)
    _arg(d, "d", torch.float16, (n, ng))
    return Packed("q8_0_mm", q, d, n, k)


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
    """x fp32 [M, K] times the Q4_0 weight (qs uint8 [N, K/2], d fp32 [N, K/32]) transposed: [M, N]."""
    x = _rows(x)
    _groups(x.shape[1])
    _arg(qs, "qs", torch.uint8, (None, x.shape[1] // 2))
    return q4_weight(qs, d).mm(x, so)


def q8_mm(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, so: ctypes.CDLL | None = None) -> torch.Tensor:
    """x fp32 [M, K] times the Q8_0 weight (q int8 [N, K] in -127..127, d fp16 [N, K/32]) transposed: [M, N]."""
    x = _rows(x)
    _groups(x.shape[1])
    _arg(q, "q", torch.int8, (None, x.shape[1]))
    return q8_weight(q, d).mm(x, so)


def gemv(x: torch.Tensor, w: torch.Tensor, so: ctypes.CDLL | None = None) -> torch.Tensor:
    """One fp32 row x [K] times W [N, K] transposed: [N]."""
    n, k = _arg(w, "w", torch.float32, (None, None)).shape
    x = x.float().contiguous()
    if x.numel() != k or n < 1:
        raise ValueError(f"x: {x.numel()} values for a [{n}, {k}] weight")
    y = torch.empty(n)
    _ok((so or library()).f32_gemv(x.data_ptr(), k, w.data_ptr(), n, y.data_ptr(), _threads()), lambda: "f32_gemv")
    return y


def row_path(one_row: bool, dtype, device) -> bool:
    """Whether an inference block runs one sequence's decode steps through the row kernels
    below (`_one_token` of llama.LlamaBlock and gpt2.GPT2Block): a one-row (`generate`)
    block at fp32 on the CPU, where this process's backend has them (models.backends)."""
    from smoltrain.models import backends

    cpu = torch.device(device).type == "cpu"
    return one_row and dtype == torch.float32 and cpu and backends.current().row_kernels


def _one_row(x: torch.Tensor, name: str = "x") -> torch.Tensor:
    """x: fp32 values of one row ([..., k], one row in all), contiguous."""
    x = _arg(x.contiguous(), name, torch.float32)
    if x.numel() != x.shape[-1] or x.numel() < 1:
        raise ValueError(f"{name}: one row, got shape {list(x.shape)}")
    return x


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm of one fp32 row (x [..., k], one row in all)."""
    x = _one_row(x)
    _arg(w, "w", torch.float32, (x.numel(),))
    y = torch.empty_like(x)
    library().rms_norm_row(x.data_ptr(), w.data_ptr(), x.numel(), eps, y.data_ptr())
    return y


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    """torch's LayerNorm of one fp32 row (GPT-2)."""
    x = _one_row(x)
    _arg(w, "w", torch.float32, (x.numel(),))
    _arg(b, "b", torch.float32, (x.numel(),))
    y = torch.empty_like(x)
    library().layer_norm_row(x.data_ptr(), w.data_ptr(), b.data_ptr(), x.numel(), eps, y.data_ptr())
    return y


def gelu(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """F.gelu of fp32 values; `approximate` "tanh" or "none", as F.gelu takes it."""
    x = _arg(x.contiguous(), "x", torch.float32)
    y = torch.empty_like(x)
    library().gelu_row(x.data_ptr(), x.numel(), approximate == "tanh", y.data_ptr())
    return y


def attend(qkv: torch.Tensor, heads: int, kv_heads: int, k: torch.Tensor, v: torch.Tensor, rope, pos: int):
    """One new position of one sequence at fp32: qkv [..., (heads + 2 kv_heads) hd] (one row);
    RoPE from `rope` = (cos, sin) [max_len, hd] at row `pos` (None: none, GPT-2); the rotated
    keys and the values written into the cache k, v [1, kv_heads, max_len, hd] at `pos`; each
    query head attends over positions 0..pos of its kv head. Returns [..., heads hd]."""
    if not (isinstance(heads, int) and isinstance(kv_heads, int) and 0 < kv_heads <= heads and heads % kv_heads == 0):
        raise ValueError(f"heads {heads} / kv_heads {kv_heads}: kv_heads must divide heads (0 < kv_heads <= heads)")
    _arg(k, "k", torch.float32, (1, kv_heads, None, None))
    max_len, hd = k.shape[2], k.shape[3]
    _arg(v, "v", torch.float32, (1, kv_heads, max_len, hd))
    if not 0 <= pos < max_len:  # torch's slice assignment refuses this; C would write past the cache
        raise IndexError(f"position {pos} outside a KV cache of {max_len} positions")
    qkv = _one_row(qkv, "qkv")
    if qkv.numel() != (heads + 2 * kv_heads) * hd:
        raise ValueError(
            f"qkv: {qkv.numel()} values, expected (heads + 2 kv_heads) x hd = {(heads + 2 * kv_heads) * hd}"
        )
    cos = sin = None
    if rope is not None:
        _arg(rope[0], "cos", torch.float32, (None, hd))
        _arg(rope[1], "sin", torch.float32, (rope[0].shape[0], hd))
        if pos >= rope[0].shape[0] or hd % 2:
            raise ValueError(f"RoPE tables of {rope[0].shape[0]} rows x {hd} for position {pos}")
        at = 4 * pos * hd  # bytes into the tables' row `pos`
        cos, sin = rope[0].data_ptr() + at, rope[1].data_ptr() + at
    out = torch.empty(*qkv.shape[:-1], heads * hd)
    so = library()
    rc = so.attend_row(qkv.data_ptr(), heads, kv_heads, hd, cos, sin, k.data_ptr(), v.data_ptr(), max_len, pos,
                       out.data_ptr(), _threads())  # fmt: skip
    _ok(rc, lambda: f"attend_row of {heads} heads over {pos + 1} positions")
    return out


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    """silu(g) * u for one fp32 row gu = [g | u]: [..., 2f] -> [..., f]."""
    gu = _one_row(gu, "gu")
    if gu.numel() % 2:
        raise ValueError(f"gu: {gu.numel()} values, not [gate | up] halves")
    f = gu.shape[-1] // 2
    y = torch.empty(*gu.shape[:-1], f)
    library().swiglu_row(gu.data_ptr(), f, y.data_ptr())
    return y


def _threads() -> int:
    return torch.get_num_threads()
