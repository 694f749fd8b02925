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

The library itself (compiled once per machine, cached privately, loaded only when its bytes
hash to what its build wrote) is models.native_build's; this module is the calls into it.
Every wrapper checks shapes, dtypes, contiguity and alignment before a pointer crosses into C,
with a ValueError that names the argument. Which kernels a process uses is models.backends'
choice.
"""

from __future__ import annotations

import ctypes

import torch

from smoltrain.models.native_build import library

GROUP = 32  # Q4_0's and Q8_0's group along the input dimension


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
