"""A frozen linear layer held quantised, for training LoRA adapters on a quantised base (QLoRA-style).

The weight is kept in the formats inference uses (models.quant), so a base costs in training
what it costs in `generate --quantize` and what the planner counts (planner.widths):

- `int8`: llama.cpp's Q8_0, a byte per weight and an fp16 scale per group of 32 along the input
  (17/16 bytes a weight); a layer whose input is not whole groups of 32 keeps one fp32 scale per
  row instead (quant.Linear's fallback).
- `q4`: Q4_0, a nibble per weight and an fp32 scale per group of 32 (5/8 bytes a weight), packed
  as models.native packs it; such a layer whose input is not whole groups falls back to int8.

Training multiplies by the dequantised weight: each product dequantises the layer to fp32 for
that call only, in forward and again in backward (for the input's gradient), so no full-width
copy outlives the call and autograd keeps only the layer's input. The weight takes no gradient
and no optimizer state; the layers below get their input gradients through it, and LoRA's
adapters (finetune.lora's forward hook on this module) train on top. Dequantising is one pass
over the layer's bytes per call, small beside the product's batch x seq x in x out multiply-adds.
The decode kernels (native.Packed) are not used here: they round the activations to 8 bits,
and training wants the product of the dequantised weight itself.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from smoltrain.models import native
from smoltrain.models.quant import GROUP, QUANTIZE, quantize_int8, quantize_q4, quantize_q8_0


def layout(kind: str, n_in: int) -> str:
    """The format a [out, n_in] weight is held in under --quantize `kind` (quant.Linear's rules)."""
    if kind not in QUANTIZE:
        raise ValueError(f"unknown quantisation {kind!r} (one of {', '.join(QUANTIZE)})")
    if n_in % GROUP:
        return "int8_row"
    return "q4_0" if kind == "q4" else "q8_0"


class _Product(torch.autograd.Function):
    """x W^T with W dequantised per call: forward and backward each rebuild it, nothing is saved."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer, ctx.dtype = layer, x.dtype
        return F.linear(x, layer.dequantized().to(x.dtype))  # under autocast: both cast to bf16

    @staticmethod
    def backward(ctx, g):
        if not ctx.needs_input_grad[0]:
            return None, None
        return (g @ ctx.layer.dequantized().to(g.dtype)).to(ctx.dtype), None


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W [out, in] frozen and quantised (buffers, not parameters); a bias
    stays a frozen fp32 parameter under its checkpoint name. `fan_in_fan_out`: GPT-2's Conv1D,
    whose checkpoint stores W as [in, out] (what `load` takes for it, and what LoRA's merge needs)."""

    def __init__(self, n_in: int, n_out: int, kind: str, bias: bool, fan_in_fan_out: bool = False, device=None):
        super().__init__()
        self.in_features, self.out_features, self.kind = n_in, n_out, kind
        self.fan_in_fan_out = fan_in_fan_out
        self.format = layout(kind, n_in)
        if self.format == "q4_0":
            q, s = torch.empty(n_out, n_in // 2, dtype=torch.uint8), torch.empty(n_out, n_in // GROUP)
        elif self.format == "q8_0":
            q, s = torch.empty(n_out, n_in, dtype=torch.int8), torch.empty(n_out, n_in // GROUP, dtype=torch.float16)
        else:
            q, s = torch.empty(n_out, n_in, dtype=torch.int8), torch.empty(n_out)
        self.register_buffer("q", q.to(device), persistent=False)
        self.register_buffer("scale", s.to(device), persistent=False)
        self.bias = nn.Parameter(torch.zeros(n_out, device=device), requires_grad=False) if bias else None

    @classmethod
    def like(cls, module: nn.Module, kind: str) -> QuantLinear:
        """An empty quantised stand-in for `module` (an nn.Linear or a Conv1D), on its device."""
        fifo = bool(getattr(module, "fan_in_fan_out", False))
        n_in, n_out = (module.weight.shape if fifo else module.weight.shape[::-1])[:2]
        return cls(int(n_in), int(n_out), kind, module.bias is not None, fifo, module.weight.device)

    @torch.no_grad()
    def load(self, w: torch.Tensor) -> None:
        """Quantise the checkpoint's weight into this layer ([in, out] under fan_in_fan_out)."""
        w = (w.t() if self.fan_in_fan_out else w).float()
        if tuple(w.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight {tuple(w.shape)} for a [{self.out_features}, {self.in_features}] layer")
        if self.format == "q4_0":
            q, d = quantize_q4(w)
            q = native.pack(q)
        else:
            q, d = (quantize_q8_0 if self.format == "q8_0" else quantize_int8)(w)
        self.q.copy_(q)
        self.scale.copy_(d)

    def dequantized(self) -> torch.Tensor:
        """W [out, in] at fp32, as the layer multiplies by it: models.quant's dequantisation number
        for number (q4: (q - 8) d; int8: q d), with one fp32 buffer written in place, since every
        product of a training step calls it (the tests hold it to models.quant's)."""
        n, k = self.out_features, self.in_features
        if self.format == "q4_0":  # native.pack's bytes: q[j] in the low nibble, q[j + 16] in the high
            g = self.q.view(n, k // GROUP, 1, GROUP // 2)
            w = torch.cat([g & 0x0F, g >> 4], dim=2).float().sub_(8)
            return w.mul_(self.scale[:, :, None, None]).view(n, k)
        if self.format == "q8_0":
            w = self.q.float().view(n, k // GROUP, GROUP)
            return w.mul_(self.scale.float()[:, :, None]).view(n, k)
        return self.q.float().mul_(self.scale[:, None])

    @property
    def nbytes(self) -> int:
        """Bytes the quantised weight holds (its scales included; the bias not)."""
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _Product.apply(x, self)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}"


def base_linears(model) -> list[tuple[int, str, nn.Module]]:
    """(unit index, name in the unit, module) of every linear layer of the blocks and an untied
    LM head: what --quantize holds quantised (the embeddings, norms and a tied head stay fp32)."""
    out = []
    n = len(model.units)
    for i, unit in enumerate(model.units):
        if i == 0:
            continue
        for name, m in unit.named_modules():
            if i == n - 1 and (name != "lm_head" or model.cfg.tied):
                continue
            if isinstance(m, nn.Linear) or getattr(m, "fan_in_fan_out", False):
                out.append((i, name, m))
    return out


def swap_in(model, kind: str) -> dict[str, QuantLinear]:
    """Replace the base's linear layers by empty QuantLinears in place; returns them by the
    checkpoint key of their weight, for the loader to fill."""
    from smoltrain.models.causal import hf_name

    n, out = len(model.units), {}
    for i, name, m in base_linears(model):
        q = QuantLinear.like(m, kind)
        parent, _, leaf = name.rpartition(".")
        setattr(model.units[i].get_submodule(parent) if parent else model.units[i], leaf, q)
        out[hf_name(model.cfg, i, name + ".weight", n)] = q
    return out
