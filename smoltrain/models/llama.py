"""The Llama arithmetic (RMSNorm, RoPE with Llama 3 scaling, grouped-query attention) and the
Llama block's decode view: a KV cache and packed weights, for generate and serve.

The block itself is models.blocks.LlamaBlock, the one the trainer runs (Llama, SmolLM2,
Qwen2's q/k/v biases, Qwen3's q/k norms); `LlamaDecode` is made from it (as a stage
loads it, or as training left it): q, k, v packed into one matrix and gate, up into
another, each optionally quantised (models.quant), the rest its tensors as they are.
Both match `transformers`' LlamaForCausalLM number for number (fp32 norms, rotate-half
RoPE), so greedy decoding gives the same tokens. Under tp a block holds only its ranks'
heads and MLP columns (Megatron): the attention output and the MLP output are partial
sums, finished by `reduce` (an all-reduce; identity alone).

Batch-1 decode is memory-bound only if little else costs time, so each layer runs few
operations (each costs microseconds of Python and dispatch whatever its size): q, k, v
are one matmul and gate, up another; RoPE's cos and sin come from a table made once per
request; keys and values are written in place into a cache preallocated for the request;
query heads share their kv head inside scaled_dot_product_attention (no copies).

A forward runs a batch of rows (`stage.Rows`): several sequences, each with its own KV
cache (its slot) and RoPE table, each at its own position. The matrix products take all
rows at once (one read of the weights for the whole batch); attention runs row by row
over that row's own cache, exactly as the row would alone.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from smoltrain.models import native
from smoltrain.models.quant import Linear


def rms_norm(x, weight, eps: float):
    """transformers' LlamaRMSNorm: normalise in fp32, scale at the input's dtype (at fp32 torch's
    fused rms_norm gives the same bits in one operation)."""
    dt = x.dtype
    if dt == torch.float32 and weight.dtype == dt:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dt)


def inv_freq(theta: float, head_dim: int, scaling: tuple | None = None) -> torch.Tensor:
    """RoPE's inverse frequencies; `scaling` (factor, low, high, original context): Llama 3's
    rescaling of the long wavelengths (transformers' _compute_llama3_parameters)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    factor, low, high, orig = scaling
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > orig / low, inv / factor, inv)
    smooth = (orig / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < orig / high) & ~(wavelen > orig / low)
    return torch.where(medium, blended, scaled)


@functools.lru_cache(maxsize=8)
def rope_table(
    theta: float, head_dim: int, max_len: int, dtype, device="cpu", scaling: tuple | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [max_len, head_dim] for positions 0..max_len-1.

    rotate_half(x) = cat(-x2, x1) = roll(x, hd/2) * sign, with sign -1 on the first half, so
    x*cos + rotate_half(x)*sin = x*cos + roll(x)*(sign*sin): the same products, fewer ops."""
    inv = inv_freq(theta, head_dim, scaling)
    freqs = torch.arange(max_len).float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    sign = torch.cat((-torch.ones(head_dim // 2), torch.ones(head_dim // 2)))
    return emb.cos().to(device, dtype), (emb.sin() * sign).to(device, dtype)


def apply_rope(x, cos, sin):
    """x [..., heads, hd]; cos, sin broadcast to it (sin signed, see rope_table)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin


class KVCache:
    """Keys and values of the positions seen so far, for one layer and one sequence."""

    def __init__(self, kv_heads: int, head_dim: int, max_len: int, dtype, device="cpu"):
        self.k = torch.zeros(1, kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(1, kv_heads, max_len, head_dim, dtype=dtype, device=device)

    def update(self, k, v, pos: int):
        """k, v [1, kv_heads, T, hd]; returns the cached keys and values of positions 0..pos+T-1."""
        t = k.shape[2]
        self.k[:, :, pos : pos + t] = k
        self.v[:, :, pos : pos + t] = v
        return self.k[:, :, : pos + t], self.v[:, :, : pos + t]


def attend(q, k, v, heads: int, kv_heads: int, causal: bool):
    """Scaled dot-product attention with each kv head shared by heads/kv_heads query heads."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kv_heads != heads)


def attend_rows(caches: dict, rows, q, k, v, heads: int, kv_heads: int):
    """q, k, v: [rows, heads, T, head_dim]; each row writes its keys and values into its slot's
    cache and attends over that cache alone (padding rows, slot None, give zeros)."""
    if len(rows.slots) == 1:  # one sequence (generate): no gathering of rows
        kk, vv = caches[rows.slots[0]].update(k, v, rows.pos[0])
        return attend(q, kk, vv, heads, kv_heads, causal=q.shape[2] > 1)
    out = torch.zeros_like(q)
    for i, (slot, pos) in enumerate(zip(rows.slots, rows.pos)):
        if slot is None:
            continue
        kk, vv = caches[slot].update(k[i : i + 1], v[i : i + 1], pos)
        out[i] = attend(q[i : i + 1], kk, vv, heads, kv_heads, causal=q.shape[2] > 1)[0]
    return out


def take(module, name: str, release: bool):
    """`module.name` as a plain tensor (None if absent); `release`: dropped from the module, so a
    loader's block lets each weight go once it is packed (one layer at full width at a time)."""
    t = getattr(module, name)
    if release:
        setattr(module, name, None)
    return None if t is None else t.detach()


class LlamaDecode(torch.nn.Module):
    """The decode view of a models.blocks.LlamaBlock (its tensors at the dtype they hold)."""

    def __init__(self, block, quantize: str | None = None, one_row=False, release=False):
        """`quantize` (int8, q4): the four matrices, quantised as they are packed; `one_row`: held
        for one row at a time (models.quant.Linear); `release`: empty `block` as it goes (take)."""
        super().__init__()
        a, m, cfg = block.self_attn, block.mlp, block.cfg
        self.cfg, self.heads, self.kv_heads = cfg, a.heads, a.kv_heads

        def t(mod, name="weight"):
            return take(mod, name, release)

        self.ln1, self.ln2 = t(block.input_layernorm), t(block.post_attention_layernorm)
        dt = self.ln1.dtype
        qkv = (a.q_proj, a.k_proj, a.v_proj)
        bias = None if a.q_proj.bias is None else torch.cat([t(p, "bias") for p in qkv])
        self.q_norm, self.k_norm = (t(a.q_norm), t(a.k_norm)) if cfg.qk_norm else (None, None)
        self.qkv = Linear(torch.cat([t(p) for p in qkv]), bias, dt, quantize, one_row=one_row)
        self.o = Linear(t(a.o_proj), None, dt, quantize, one_row=one_row)
        self.o_bias = t(a.o_proj, "bias")  # added once, after the tp reduce
        gate_up = torch.cat([t(m.gate_proj), t(m.up_proj)])
        self.gate_up = Linear(gate_up, None, dt, quantize, one_row=one_row)
        del gate_up
        self.down = Linear(t(m.down_proj), None, dt, quantize, one_row=one_row)
        self.caches: dict[int, KVCache] = {}  # slot -> its sequence's cache
        self.rope: dict[int, tuple] = {}  # slot -> its sequence's RoPE table
        # `_one_token` (its kernel has no per-head q/k norm: qwen3 takes the torch path)
        self.row_kernels = native.row_path(one_row, dt, self.ln1.device) and self.q_norm is None

    def weight_bytes(self) -> int:
        """Bytes of weights one token reads in this block."""
        small = [t for t in (self.ln1, self.ln2, self.o_bias, self.q_norm, self.k_norm) if t is not None]
        return sum(lin.nbytes for lin in (self.qkv, self.o, self.gate_up, self.down)) + sum(
            t.numel() * t.element_size() for t in small
        )

    def open(self, slot: int, max_len: int, dtype) -> None:
        """A new sequence in this slot: a fresh cache of max_len positions and its RoPE table."""
        dev = self.ln1.device
        self.caches[slot] = KVCache(self.kv_heads, self.cfg.head_dim, max_len, dtype, dev)
        scaling = tuple(self.cfg.rope_scaling) if self.cfg.rope_scaling else None
        self.rope[slot] = rope_table(self.cfg.rope_theta, self.cfg.head_dim, max_len, dtype, str(dev), scaling)

    def _rope(self, rows, T: int):
        """cos, sin [rows, T, 1, hd]: each row's positions from its own sequence's table (a padding
        row borrows the first row's). Every layer of a stage has the same tables, so the first
        block of a forward builds them and the others take them from `rows.cache`."""
        if "rope" not in rows.cache:
            tables = [self.rope[s if s is not None else rows.slots[0]] for s in rows.slots]
            cos = torch.stack([c[p : p + T] for (c, _), p in zip(tables, rows.pos)])
            sin = torch.stack([s[p : p + T] for (_, s), p in zip(tables, rows.pos)])
            rows.cache["rope"] = cos[:, :, None], sin[:, :, None]
        return rows.cache["rope"]

    def forward(self, x, rows, reduce):
        if self.row_kernels and x.shape[0] * x.shape[1] == 1:
            return self._one_token(x, rows, reduce)
        hd, (n, T), H, KV = self.cfg.head_dim, x.shape[:2], self.heads, self.kv_heads
        qkv = self.qkv(rms_norm(x, self.ln1, self.cfg.eps)).view(n, T, H + 2 * KV, hd)
        qk = qkv[:, :, : H + KV]
        if self.q_norm is not None:
            qk = torch.cat(
                [rms_norm(qk[:, :, :H], self.q_norm, self.cfg.eps), rms_norm(qk[:, :, H:], self.k_norm, self.cfg.eps)],
                2,
            )
        qk = apply_rope(qk, *self._rope(rows, T))  # q and k heads rotated together
        q, k = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2)
        a = attend_rows(self.caches, rows, q, k, qkv[:, :, H + KV :].transpose(1, 2), H, KV)
        a = reduce(self.o(a.transpose(1, 2).reshape(n, T, H * hd)))
        if self.o_bias is not None:
            a = a + self.o_bias
        x = x + a
        g, u = self.gate_up(rms_norm(x, self.ln2, self.cfg.eps)).chunk(2, dim=-1)
        return x + reduce(self.down(F.silu(g) * u))

    def _one_token(self, x, rows, reduce):
        """`forward` for one sequence's next token at fp32 (`generate`'s decode steps): the same
        arithmetic, with the norms, RoPE, the cache writes, attention and SwiGLU each one call
        into models.native instead of ~25 torch operations a layer (their dispatch was a fifth
        of a q4 step)."""
        slot, pos, eps = rows.slots[0], rows.pos[0], self.cfg.eps
        cache = self.caches[slot]
        qkv = self.qkv(native.rms_norm(x, self.ln1, eps))
        a = native.attend(qkv, self.heads, self.kv_heads, cache.k, cache.v, self.rope[slot], pos)
        a = reduce(self.o(a))
        if self.o_bias is not None:
            a = a + self.o_bias
        x = x + a
        return x + reduce(self.down(native.swiglu(self.gate_up(native.rms_norm(x, self.ln2, eps)))))
