"""A readable Llama block for inference: RMSNorm, RoPE, grouped-query attention, SwiGLU, a KV cache.

Written to match `transformers`' LlamaForCausalLM number for number (fp32 norms,
rotate-half RoPE), so greedy decoding gives the same tokens. Under tp a block holds
only its ranks' heads and MLP columns (Megatron): the attention output and the MLP
output are partial sums, finished by `reduce` (an all-reduce; identity alone).
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
    """Keys and values of the positions seen so far, for one layer, batch 1."""

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


class LlamaBlock(torch.nn.Module):
    def __init__(self, cfg: HFConfig, w: dict, heads: int, kv_heads: int):
        super().__init__()
        self.cfg, self.w, self.heads, self.kv_heads = cfg, w, heads, kv_heads
        self.ln1 = RMSNorm(w["input_layernorm.weight"], cfg.eps)
        self.ln2 = RMSNorm(w["post_attention_layernorm.weight"], cfg.eps)
        self.cache: KVCache | None = None

    def reset(self, max_len: int, dtype) -> None:
        self.cache = KVCache(self.kv_heads, self.cfg.head_dim, max_len, dtype)

    def _lin(self, x, name):
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def forward(self, x, pos: int, reduce):
        w, hd, T = self.w, self.cfg.head_dim, x.shape[1]
        y = self.ln1(x)
        q = self._lin(y, "self_attn.q_proj").view(1, T, self.heads, hd).transpose(1, 2)
        k = self._lin(y, "self_attn.k_proj").view(1, T, self.kv_heads, hd).transpose(1, 2)
        v = self._lin(y, "self_attn.v_proj").view(1, T, self.kv_heads, hd).transpose(1, 2)
        cos, sin = rope(self.cfg, torch.arange(pos, pos + T), x.dtype)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = self.cache.update(k, v, pos)
        a = attend(q, k, v, self.heads, self.kv_heads, causal=T > 1)
        a = F.linear(a.transpose(1, 2).reshape(1, T, self.heads * hd), w["self_attn.o_proj.weight"])
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


def embed(ends: dict, ids, pos: int):
    return F.embedding(ids, ends["embed"])
