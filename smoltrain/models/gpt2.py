"""The GPT-2 block's decode view (pre-LayerNorm, gelu_new, a KV cache), for generate and serve.

The block itself is models.blocks.GPT2Block, the one the trainer runs; `GPT2Decode` is made
from it: its Conv1D weights ([in, out]) turned into Linear ones ([out, in]), optionally
quantised (models.quant). Matches `transformers`' GPT2LMHeadModel number for number. Under
tp a block holds its ranks' heads and MLP columns; the two output projections are partial
sums that `reduce` finishes, and their biases are added once, after it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from smoltrain.models import native
from smoltrain.models.hf import GELUS
from smoltrain.models.llama import KVCache, attend_rows, take
from smoltrain.models.quant import Linear


class GPT2Decode(torch.nn.Module):
    """The decode view of a models.blocks.GPT2Block (its tensors at the dtype they hold)."""

    def __init__(self, block, quantize: str | None = None, one_row=False, release=False):
        """`quantize` (int8, q4): the four matrices, quantised as they are taken; `one_row`: held for
        one row at a time (models.quant.Linear); `release`: empty `block` as it goes (llama.take)."""
        super().__init__()
        a, m = block.attn, block.mlp
        self.cfg, self.heads = block.cfg, a.heads

        def t(mod, name="weight"):
            return take(mod, name, release)

        self.ln_1, self.ln_2 = (t(block.ln_1), t(block.ln_1, "bias")), (t(block.ln_2), t(block.ln_2, "bias"))
        dt = self.ln_1[0].dtype
        # Conv1D stores [in, out]; a Linear holds [out, in]. Output biases come after the tp reduce.
        self.qkv = Linear(t(a.c_attn).t(), t(a.c_attn, "bias"), dt, quantize, one_row=one_row)
        self.proj = Linear(t(a.c_proj).t(), None, dt, quantize, one_row=one_row)
        self.fc = Linear(t(m.c_fc).t(), t(m.c_fc, "bias"), dt, quantize, one_row=one_row)
        self.down = Linear(t(m.c_proj).t(), None, dt, quantize, one_row=one_row)
        self.proj_bias, self.down_bias = t(a.c_proj, "bias"), t(m.c_proj, "bias")
        self.caches: dict[int, KVCache] = {}  # slot -> its sequence's cache
        self.row_kernels = native.row_path(one_row, dt, self.ln_1[0].device)  # `_one_token`

    def weight_bytes(self) -> int:
        """Bytes of weights one token reads in this block."""
        small = (*self.ln_1, *self.ln_2, self.proj_bias, self.down_bias)
        return sum(lin.nbytes for lin in (self.qkv, self.proj, self.fc, self.down)) + sum(
            t.numel() * t.element_size() for t in small
        )

    def open(self, slot: int, max_len: int, dtype) -> None:
        self.caches[slot] = KVCache(self.heads, self.cfg.head_dim, max_len, dtype, self.ln_1[0].device)

    def forward(self, x, rows, reduce):
        if self.row_kernels and x.shape[0] * x.shape[1] == 1:
            return self._one_token(x, rows, reduce)
        hd, (B, T), n, eps = self.cfg.head_dim, x.shape[:2], self.heads, self.cfg.eps
        y = F.layer_norm(x, (x.shape[-1],), *self.ln_1, eps)
        q, k, v = (t.view(B, T, n, hd).transpose(1, 2) for t in self.qkv(y).split(n * hd, dim=-1))
        a = attend_rows(self.caches, rows, q, k, v, n, n).transpose(1, 2).reshape(B, T, n * hd)
        x = x + (reduce(self.proj(a)) + self.proj_bias)
        y = F.layer_norm(x, (x.shape[-1],), *self.ln_2, eps)
        m = F.gelu(self.fc(y), approximate=GELUS[self.cfg.act])
        return x + (reduce(self.down(m)) + self.down_bias)

    def _one_token(self, x, rows, reduce):
        """`forward` for one sequence's next token at fp32 (`generate`'s decode steps): the norms,
        the cache write with attention and GELU each one call into models.native."""
        eps, cache = self.cfg.eps, self.caches[rows.slots[0]]
        qkv = self.qkv(native.layer_norm(x, *self.ln_1, eps))
        a = native.attend(qkv, self.heads, self.heads, cache.k, cache.v, None, rows.pos[0])
        x = x + (reduce(self.proj(a)) + self.proj_bias)
        m = native.gelu(self.fc(native.layer_norm(x, *self.ln_2, eps)), GELUS[self.cfg.act])
        return x + (reduce(self.down(m)) + self.down_bias)
