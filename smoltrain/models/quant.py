"""Weights for inference at full width or quantised, and the one linear layer that runs them.

- `int8`: symmetric per output channel: w ~ q * s, q in [-127, 127], one scale per row.
- `q4`: llama.cpp's Q4_0 layout: groups of 32 along the input, one scale d per group
  (d = the group's largest-magnitude value / -8), q = round(w / d) + 8 in [0, 15], w ~ (q - 8) d:
  4.5 bits of information per weight.

Batch-1 decode reads every weight once per token, so it runs at memory bandwidth: fewer
bytes per weight is more tokens per second. Which kernel multiplies is the process's
backend's choice (models.backends, named in every report):

- `native` (ours, models.native: x86 AVX512/AVX2, Arm NEON): q4 as llama.cpp's Q4_0 x Q8_0;
  int8 as its Q8_0 x Q8_0: the weight int8 per group of 32 with an fp16 scale each (1 + 1/16
  bytes a weight, as llama.cpp's Q8_0), each call's activations int8 per group of 32.
  fbgemm's dynamic int8 linear rounded activations with one 7-bit scale per call: 1.7x
  llama.cpp's logit error on the same model (issue 39).
- `kleidiai` (aarch64 torch): q4 through `_dyn_quant_matmul_4bit` (Q4_0's nibbles, bf16
  scales, activations int8 per row); int8 as `torch`.
- `torch`: int8 through fbgemm's dynamic int8 linear (per-channel weights) where built, else
  `_weight_int8pack_mm` with bf16 activations; q4 through `_weight_int4pack_mm_for_cpu` with
  bf16 activations (4.6x fp32 on a 1024x2816 shape; with fp32 activations 6x slower than fp32).
  A matrix whose input is not whole groups of 32 takes these too.

A quantised layer hands back the caller's dtype. Where no kernel exists (another device)
the weight is dequantised on the fly: correct, not fast.

Full-width fp32 layers on the CPU go through oneDNN (`mkldnn_linear`, the weight held in
its own layout): MKL's batch-1 sgemv read 14 GB/s where a copy moves 23 on the machine of
BENCHMARKS.md (an AMD EPYC, which MKL serves a generic path), oneDNN 18. A layer that only
ever multiplies one row (`one_row`: `generate`, one sequence at a time) runs our own
one-row product under the native backend (models.native: a dot product per weight row, 28 GB/s on the decode
shapes there) and a prefill's several rows through F.linear on the same weight. Without
it, the weight is held transposed, [in, out], for the BLAS numpy links (OpenBLAS in its
Linux wheels, Accelerate on macOS): 17-25 GB/s there, where oneDNN read 13-19. With 2
or more rows oneDNN is the faster (2x at 4 rows), so batches (`serve`) stay there.

The weights our kernels and numpy's stream are held in transparent huge pages where Linux
offers them (models.hugepages): 1.2x on a whole fp32 decode step.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from smoltrain.models import backends, hugepages, native

QUANTIZE = ("int8", "q4")
GROUP = native.GROUP  # Q4_0's group along the input dimension
KERNEL_DTYPE = torch.bfloat16  # activations the low-bit CPU kernels are fast with


def _has(op: str) -> bool:
    return hasattr(torch.ops.aten, op)


def _fbgemm() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def _pack_int8(q: torch.Tensor, s: torch.Tensor):
    """fbgemm's prepacked int8 weight (per-channel scales, zero points 0)."""
    with warnings.catch_warnings():  # quantized tensors are deprecated in favour of torchao; torch is pinned
        warnings.simplefilter("ignore")
        zero = torch.zeros(q.shape[0], dtype=torch.int64)
        qw = torch._make_per_channel_quantized_tensor(q, s.double(), zero, 0)
        return torch.ops.quantized.linear_prepack(qw, None)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], scale fp32 [N]): symmetric, per output channel (row)."""
    w = w.float()
    s = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
    return q, s


def quantize_q4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int32 [N, K] in 0..15, d fp32 [N, K/32]): Q4_0, as llama.cpp's quantize_row_q4_0 does."""
    n, k = w.shape
    g = w.float().contiguous().reshape(n, k // GROUP, GROUP)  # a transposed w (GPT-2's) would stay a view
    peak = torch.gather(g, -1, g.abs().argmax(-1, keepdim=True))  # signed value of largest magnitude
    d = peak / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.clamp(torch.floor(g * inv + 8.5), 0, 15).to(torch.int32)  # llama.cpp: (int8)(x*id + 8.5), max 15
    return q.reshape(n, k), d.reshape(n, k // GROUP)


def quantize_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K] in -127..127, d fp16 [N, K/32]): Q8_0, as llama.cpp's quantize_row_q8_0
    does (q from the fp32 scale, the scale kept at fp16)."""
    n, k = w.shape
    g = w.float().contiguous().reshape(n, k // GROUP, GROUP)  # a transposed w (GPT-2's) would stay a view
    d = g.abs().amax(-1, keepdim=True) / 127
    q = torch.round(g * torch.where(d > 0, 1 / d, torch.zeros_like(d))).clamp(-127, 127).to(torch.int8)
    return q.reshape(n, k), d.reshape(n, k // GROUP).half()


def dequantize_q8_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    return (q.reshape(n, k // GROUP, GROUP).float() * d.float()[..., None]).reshape(n, k)


def _nibbles_even_odd(q: torch.Tensor) -> torch.Tensor:
    """q int [N, K] in 0..15 -> [N, K/2] bytes, element 2i in the low nibble and 2i+1 in the high
    (the layout `_dyn_quant_pack_4bit_weight` takes)."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8).contiguous()


def dequantize_int8(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * s[:, None]


def dequantize_q4(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    return ((q.reshape(n, k // GROUP, GROUP) - 8).float() * d[..., None]).reshape(n, k)


class Linear:
    """y = x W^T (+ b) for a weight W [out, in] held at `dtype`, as int8 or as q4.

    Built from the full-width weight as a rank loads it, so no full-width copy outlives
    the load. `nbytes` is what one batch-1 token reads of it (weights, scales, bias)."""

    def __init__(
        self,
        w: torch.Tensor,
        bias: torch.Tensor | None,
        dtype,
        quantize: str | None = None,
        pack: bool = True,
        one_row: bool = False,
    ):
        """`pack` False: keep a full-width weight as the tensor given (a tied head shares the embedding);
        `one_row`: the layer multiplies one row at a time (decode) but for a prefill now and then."""
        if quantize not in (None, *QUANTIZE):
            raise ValueError(f"unknown quantisation {quantize!r} (one of {', '.join(QUANTIZE)})")
        if quantize == "q4" and w.shape[1] % GROUP:
            quantize = "int8"  # Q4_0 needs whole groups of 32; such a matrix falls back to int8
        self.out_features, self.in_features = w.shape
        self.kind, self.dtype = quantize, dtype
        self.bias = None if bias is None else bias.to(dtype)
        cpu = w.device.type == "cpu"
        be = backends.current()
        if quantize is None:
            fp32_cpu = pack and cpu and dtype == torch.float32
            if fp32_cpu and one_row and be.fp32_row == "gemv":
                self.kernel, self.weight = "gemv", hugepages.hold(w.to(dtype).contiguous())
            elif fp32_cpu and one_row:  # [in, out], numpy's matmul
                self.kernel, self.weight = "blas", hugepages.hold(w.to(dtype).t().contiguous())
            else:
                self.weight = w.to(dtype).contiguous()
                self.kernel = "onednn" if fp32_cpu and torch.backends.mkldnn.is_available() else None
                if self.kernel:
                    self.weight = self.weight.to_mkldnn()
        elif quantize == "int8":
            whole = w.shape[1] % GROUP == 0
            if cpu and whole and be.int8 == "q8_0":
                self.kernel = "q8_0"
                q, d = quantize_q8_0(w)
                self.q, self.scale = hugepages.hold(q), d.contiguous()
                self.product = native.q8_weight(self.q, self.scale)  # checked once, not every token
                return
            q, s = quantize_int8(w)
            self.kernel = "fbgemm" if cpu and _fbgemm() else "int8pack" if cpu and _has("_weight_int8pack_mm") else None
            if self.kernel == "fbgemm":
                self.packed = _pack_int8(q, s)  # holds q, its scales at fp64 and a zero point per row
            else:
                self.q, self.scale = q, s.to(KERNEL_DTYPE if self.kernel else torch.float32)
        else:
            q, d = quantize_q4(w)
            fits = cpu and _has("_weight_int4pack_mm_for_cpu") and self.out_features % 16 == 0
            self.kernel = be.q4 if cpu and be.q4 in ("q4_0", "kleidiai") else "int4pack" if fits else None
            if self.kernel == "q4_0":
                self.q, self.scale = hugepages.hold(native.pack(q)), d.contiguous()  # Q4_0's bytes; fp32 scales
                self.product = native.q4_weight(self.q, self.scale)  # checked once, not every token
            elif self.kernel == "kleidiai":  # Q4_0's nibbles, bf16 scales (KleidiAI's groupwise layout)
                n, k = w.shape
                self.q = torch.ops.aten._dyn_quant_pack_4bit_weight(
                    _nibbles_even_odd(q), d.bfloat16(), None, GROUP, k, n
                )
                self.scale = torch.empty(0)
            elif self.kernel:
                self.q = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
                zeros = torch.zeros_like(d)  # the kernel computes (q - 8) * scale + zero; Q4_0 has no zero
                self.scale = torch.stack([d.t(), zeros.t()], dim=-1).to(KERNEL_DTYPE).contiguous()
            else:
                self.q, self.scale = q.to(torch.uint8), d

    @property
    def nbytes(self) -> int:
        if self.kind is None:
            n = self.weight.numel() * self.weight.element_size()
        elif self.kernel == "fbgemm":  # the packed int8 weight, an fp64 scale and an int64 zero per row
            n = self.out_features * (self.in_features + 16)
        else:
            n = self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def dequantized(self) -> torch.Tensor:
        """The weight this layer multiplies by, at fp32 (the reference the kernels are tested against)."""
        if self.kind is None:
            if self.kernel == "onednn":
                return self.weight.to_dense().float()
            return (self.weight.t() if self.kernel == "blas" else self.weight).float()
        if self.kind == "int8" and self.kernel == "fbgemm":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return torch.ops.quantized.linear_unpack(self.packed)[0].dequantize()
        if self.kernel == "q8_0":
            return dequantize_q8_0(self.q, self.scale)
        if self.kind == "int8":
            return dequantize_int8(self.q, self.scale.float())
        if not self.kernel:
            return dequantize_q4(self.q.to(torch.int32), self.scale)
        if self.kernel == "q4_0":
            return dequantize_q4(native.unpack(self.q), self.scale)
        eye = torch.eye(self.in_features)  # the kernel applied to the identity gives W^T exactly
        if self.kernel == "kleidiai":
            return self._kleidiai(eye).t().contiguous()
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.q, GROUP, self.scale.float()).t().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "gemv":
            if x.numel() != self.in_features:  # a prefill's rows
                return F.linear(x, self.weight, self.bias)
            y = native.gemv(x, self.weight).view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        if self.kernel == "blas":
            rows = x.reshape(-1, self.in_features).contiguous().numpy()
            y = torch.from_numpy(rows @ self.weight.numpy()).view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        if self.kind is None and self.kernel:
            y = torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), self.weight).to_dense()
            return y if self.bias is None else y + self.bias
        if self.kind is None:
            return F.linear(x, self.weight, self.bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if not self.kernel:
            w = self.dequantized().to(x.dtype)
            y = F.linear(x2, w)
        elif self.kernel in ("q8_0", "q4_0"):
            y = self.product.mm(x2)
        elif self.kernel == "kleidiai":
            y = self._kleidiai(x2)
        elif self.kernel == "fbgemm":
            y = torch.ops.quantized.linear_dynamic(x2.float(), self.packed)
        elif self.kind == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x2.to(KERNEL_DTYPE), self.q, self.scale)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(KERNEL_DTYPE), self.q, GROUP, self.scale)
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def _kleidiai(self, x2: torch.Tensor) -> torch.Tensor:
        k, n = self.in_features, self.out_features
        return torch.ops.aten._dyn_quant_matmul_4bit(x2.float().contiguous(), self.q, GROUP, k, n)
