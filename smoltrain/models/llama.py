"""A readable Llama block for inference: RMSNorm, RoPE, grouped-query attention, SwiGLU, a KV cache.

Written to match `transformers`' LlamaForCausalLM number for number (fp32 norms,
rotate-half RoPE), so greedy decoding gives the same tokens. Under tp a block holds
only its ranks' heads and MLP columns (Megatron): the attention output and the MLP
output are partial sums, finished by `reduce` (an all-reduce; identity alone).

A forward runs a batch of rows (`stage.Rows`): several sequences, one KV cache each (its
slot), each at its own position. The matrix products take all rows at once (one read of
the weights for the whole batch); attention runs row by row over that row's own cache,
exactly as the row would alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from smoltrain.models.hf import HFConfig


class RMSNorm(torch.nn.Module):
    def __init__(self, weight, eps: float):
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, x):
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


def rope(cfg: HFConfig, positions: torch.Tensor, dtype):
    """cos, sin of shape [T, head_dim] for these positions (rope_theta from the config)."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    freqs = positions.float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class KVCache:
    """Keys and values of the positions seen so far, for one layer and one sequence."""

    def __init__(self, kv_heads: int, head_dim: int, max_len: int, dtype):
        self.k = torch.zeros(1, kv_heads, max_len, head_dim, dtype=dtype)
        self.v = torch.zeros(1, kv_heads, max_len, head_dim, dtype=dtype)

    def update(self, k, v, pos: int):
        t = k.shape[2]
        self.k[:, :, pos : pos + t] = k
        self.v[:, :, pos : pos + t] = v
        return self.k[:, :, : pos + t], self.v[:, :, : pos + t]


def attend(q, k, v, heads: int, kv_heads: int, causal: bool):
    """Scaled dot-product attention with each kv head shared by heads/kv_heads query heads."""
    if kv_heads != heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def attend_rows(caches: dict, rows, q, k, v, heads: int, kv_heads: int):
    """q, k, v: [rows, heads, T, head_dim]; each row writes its keys and values into its slot's
    cache and attends over that cache alone (padding rows, slot None, give zeros)."""
    out = torch.zeros_like(q)
    for i, (slot, pos) in enumerate(zip(rows.slots, rows.pos)):
        if slot is None:
            continue
        kk, vv = caches[slot].update(k[i : i + 1], v[i : i + 1], pos)
        out[i] = attend(q[i : i + 1], kk, vv, heads, kv_heads, causal=q.shape[2] > 1)[0]
    return out


def rope_rows(cfg: HFConfig, rows, T: int, dtype):
    """cos, sin [rows, 1, T, head_dim], each row from its own positions (computed row by row,
    so a row's figures never depend on the batch it is in)."""
    cs = [rope(cfg, torch.arange(p, p + T), dtype) for p in rows.pos]
    return torch.stack([c for c, _ in cs])[:, None], torch.stack([s for _, s in cs])[:, None]


class LlamaBlock(torch.nn.Module):
    def __init__(self, cfg: HFConfig, w: dict, heads: int, kv_heads: int):
        super().__init__()
        self.cfg, self.w, self.heads, self.kv_heads = cfg, w, heads, kv_heads
        self.ln1 = RMSNorm(w["input_layernorm.weight"], cfg.eps)
        self.ln2 = RMSNorm(w["post_attention_layernorm.weight"], cfg.eps)
        self.caches: dict[int, KVCache] = {}

    def open(self, slot: int, max_len: int, dtype) -> None:
        """A new sequence in this slot: a fresh cache of max_len positions."""
        self.caches[slot] = KVCache(self.kv_heads, self.cfg.head_dim, max_len, dtype)

    def _lin(self, x, name):
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def forward(self, x, rows, reduce):
        w, hd, (n, T) = self.w, self.cfg.head_dim, x.shape[:2]
        y = self.ln1(x)
        q = self._lin(y, "self_attn.q_proj").view(n, T, self.heads, hd).transpose(1, 2)
        k = self._lin(y, "self_attn.k_proj").view(n, T, self.kv_heads, hd).transpose(1, 2)
        v = self._lin(y, "self_attn.v_proj").view(n, T, self.kv_heads, hd).transpose(1, 2)
        cos, sin = rows.memo("rope", lambda: rope_rows(self.cfg, rows, T, x.dtype))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        a = attend_rows(self.caches, rows, q, k, v, self.heads, self.kv_heads)
        a = F.linear(a.transpose(1, 2).reshape(n, T, self.heads * hd), w["self_attn.o_proj.weight"])
        a = reduce(a)
        if "self_attn.o_proj.bias" in w:
            a = a + w["self_attn.o_proj.bias"]
        x = x + a
        y = self.ln2(x)
        m = F.linear(
            F.silu(F.linear(y, w["mlp.gate_proj.weight"])) * F.linear(y, w["mlp.up_proj.weight"]),
            w["mlp.down_proj.weight"],
        )
        return x + reduce(m)


def shard_windows(cfg: HFConfig, rank: int, world: int) -> dict:
    """Which rows/cols of each layer tensor tp rank `rank` of `world` reads: {suffix: (rows, cols)}."""
    hd = cfg.head_dim
    qh, kvh, f = cfg.heads // world, cfg.kv_heads // world, cfg.ffn // world
    q = (rank * qh * hd, (rank + 1) * qh * hd)
    kv = (rank * kvh * hd, (rank + 1) * kvh * hd)
    fr = (rank * f, (rank + 1) * f)
    out = {
        "self_attn.q_proj.weight": (q, None),
        "self_attn.k_proj.weight": (kv, None),
        "self_attn.v_proj.weight": (kv, None),
        "self_attn.o_proj.weight": (None, q),
        "mlp.gate_proj.weight": (fr, None),
        "mlp.up_proj.weight": (fr, None),
        "mlp.down_proj.weight": (None, fr),
        "input_layernorm.weight": (None, None),
        "post_attention_layernorm.weight": (None, None),
    }
    if cfg.bias:
        out.update(
            {
                "self_attn.q_proj.bias": (q, None),
                "self_attn.k_proj.bias": (kv, None),
                "self_attn.v_proj.bias": (kv, None),
                "self_attn.o_proj.bias": (None, None),
            }
        )
    return out


def load_block(ckpt, i: int, rank: int, world: int, dtype) -> LlamaBlock:
    cfg = ckpt.config
    w = {
        k: ckpt.read(f"model.layers.{i}.{k}", rows, cols).to(dtype)
        for k, (rows, cols) in shard_windows(cfg, rank, world).items()
    }
    return LlamaBlock(cfg, w, cfg.heads // world, cfg.kv_heads // world)


def load_ends(ckpt, first: bool, last: bool, dtype) -> dict:
    """Embedding (first stage) and final norm + head (last stage)."""
    out = {}
    if first or (last and ckpt.config.tied):
        out["embed"] = ckpt.read("model.embed_tokens.weight").to(dtype)
    if last:
        out["norm"] = RMSNorm(ckpt.read("model.norm.weight").to(dtype), ckpt.config.eps)
        out["head"] = out["embed"] if ckpt.config.tied else ckpt.read("lm_head.weight").to(dtype)
    return out


def embed(ends: dict, ids, positions):
    return F.embedding(ids, ends["embed"])
