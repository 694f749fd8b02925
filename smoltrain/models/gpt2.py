"""A readable GPT-2 block for inference (pre-LayerNorm, gelu_new, Conv1D weights stored [in, out]), with a KV cache.

Matches `transformers`' GPT2LMHeadModel number for number. Under tp a block holds
its ranks' heads and MLP columns; the two output projections are partial sums that
`reduce` finishes, and their biases are added once, after it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from smoltrain.models import native
from smoltrain.models.hf import GELUS, HFConfig
from smoltrain.models.llama import KVCache, attend_rows
from smoltrain.models.quant import Linear


class GPT2Block(torch.nn.Module):
    def __init__(self, cfg: HFConfig, w: dict, heads: int, quantize: str | None = None, one_row=False):
        super().__init__()
        self.cfg, self.w, self.heads = cfg, w, heads
        dt = w["ln_1.weight"].dtype
        # Conv1D stores [in, out]; a Linear holds [out, in]. Output biases come after the tp reduce.
        self.qkv = Linear(w.pop("attn.c_attn.weight").t(), w.pop("attn.c_attn.bias"), dt, quantize, one_row=one_row)
        self.proj = Linear(w.pop("attn.c_proj.weight").t(), None, dt, quantize, one_row=one_row)
        self.fc = Linear(w.pop("mlp.c_fc.weight").t(), w.pop("mlp.c_fc.bias"), dt, quantize, one_row=one_row)
        self.down = Linear(w.pop("mlp.c_proj.weight").t(), None, dt, quantize, one_row=one_row)
        self.caches: dict[int, KVCache] = {}  # slot -> its sequence's cache
        self.row_kernels = native.row_path(one_row, dt, w["ln_1.weight"].device)  # `_one_token`

    def weight_bytes(self) -> int:
        """Bytes of weights one token reads in this block."""
        return sum(lin.nbytes for lin in (self.qkv, self.proj, self.fc, self.down)) + sum(
            t.numel() * t.element_size() for t in self.w.values()
        )

    def open(self, slot: int, max_len: int, dtype) -> None:
        self.caches[slot] = KVCache(self.heads, self.cfg.head_dim, max_len, dtype, self.w["ln_1.weight"].device)

    def _ln(self, x, name):
        return F.layer_norm(x, (x.shape[-1],), self.w[name + ".weight"], self.w[name + ".bias"], self.cfg.eps)

    def forward(self, x, rows, reduce):
        if self.row_kernels and x.shape[0] * x.shape[1] == 1:
            return self._one_token(x, rows, reduce)
        w, hd, (B, T), n = self.w, self.cfg.head_dim, x.shape[:2], self.heads
        y = self._ln(x, "ln_1")
        q, k, v = (t.view(B, T, n, hd).transpose(1, 2) for t in self.qkv(y).split(n * hd, dim=-1))
        a = attend_rows(self.caches, rows, q, k, v, n, n).transpose(1, 2).reshape(B, T, n * hd)
        x = x + (reduce(self.proj(a)) + w["attn.c_proj.bias"])
        y = self._ln(x, "ln_2")
        m = F.gelu(self.fc(y), approximate=GELUS[self.cfg.act])
        return x + (reduce(self.down(m)) + w["mlp.c_proj.bias"])

    def _one_token(self, x, rows, reduce):
        """`forward` for one sequence's next token at fp32 (`generate`'s decode steps): the norms,
        the cache write with attention and GELU each one call into models.native."""
        w, eps, cache = self.w, self.cfg.eps, self.caches[rows.slots[0]]
        qkv = self.qkv(native.layer_norm(x, w["ln_1.weight"], w["ln_1.bias"], eps))
        a = native.attend(qkv, self.heads, self.heads, cache.k, cache.v, None, rows.pos[0])
        x = x + (reduce(self.proj(a)) + w["attn.c_proj.bias"])
        m = native.gelu(self.fc(native.layer_norm(x, w["ln_2.weight"], w["ln_2.bias"], eps)), GELUS[self.cfg.act])
        return x + (reduce(self.down(m)) + w["mlp.c_proj.bias"])


def load_block(
    ckpt, i: int, rank: int, world: int, dtype, quantize: str | None = None, device="cpu", one_row=False
) -> GPT2Block:
    cfg = ckpt.config
    h, n, hd = cfg.hidden, cfg.heads // world, cfg.head_dim
    f = cfg.ffn // world
    p = f"h.{i}."

    def rd(name, rows=None, cols=None):
        return ckpt.read(p + name, rows, cols).to(device, dtype)

    c0, c1 = rank * n * hd, (rank + 1) * n * hd
    w = {
        "ln_1.weight": rd("ln_1.weight"),
        "ln_1.bias": rd("ln_1.bias"),
        "ln_2.weight": rd("ln_2.weight"),
        "ln_2.bias": rd("ln_2.bias"),
        # q, k, v each: this rank's heads' columns
        "attn.c_attn.weight": torch.cat([rd("attn.c_attn.weight", None, (o + c0, o + c1)) for o in (0, h, 2 * h)], 1),
        "attn.c_attn.bias": torch.cat([rd("attn.c_attn.bias", (o + c0, o + c1)) for o in (0, h, 2 * h)]),
        "attn.c_proj.weight": rd("attn.c_proj.weight", (c0, c1)),
        "attn.c_proj.bias": rd("attn.c_proj.bias"),
        "mlp.c_fc.weight": rd("mlp.c_fc.weight", None, (rank * f, (rank + 1) * f)),
        "mlp.c_fc.bias": rd("mlp.c_fc.bias", (rank * f, (rank + 1) * f)),
        "mlp.c_proj.weight": rd("mlp.c_proj.weight", (rank * f, (rank + 1) * f)),
        "mlp.c_proj.bias": rd("mlp.c_proj.bias"),
    }
    return GPT2Block(cfg, w, n, quantize, one_row)


class _LN(torch.nn.Module):
    def __init__(self, w, b, eps):
        super().__init__()
        self.w, self.b, self.eps = w, b, eps

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.w, self.b, self.eps)


def load_ends(ckpt, first: bool, last: bool, dtype, quantize: str | None = None, device="cpu", one_row=False) -> dict:
    out = {}
    if first or (last and ckpt.config.tied):
        out["embed"] = ckpt.read("wte.weight").to(device, dtype)
    if first:
        out["pos"] = ckpt.read("wpe.weight").to(device, dtype)
    if last:
        ln = [ckpt.read(f"ln_f.{k}").to(device, dtype) for k in ("weight", "bias")]
        out["norm"] = _LN(*ln, ckpt.config.eps)
        w = out["embed"] if ckpt.config.tied else ckpt.read("lm_head.weight").to(device)
        out["head"] = Linear(
            w, None, dtype, None if ckpt.config.tied else quantize, pack=not ckpt.config.tied, one_row=one_row
        )
    return out


def embed(ends: dict, ids, positions):
    return F.embedding(ids, ends["embed"]) + ends["pos"][positions]
