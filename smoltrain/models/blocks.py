"""The transformer blocks, each architecture written once: Llama (SmolLM2, Llama 3.x), Qwen2/2.5
(q/k/v biases), Qwen3 (q/k RMSNorm), GPT-2, and the built-in GPT.

A block is plain parameters and autograd, what every training strategy runs. Its sub-module
names are the checkpoint's (`self_attn.q_proj`, `mlp.gate_proj`, GPT-2's `attn.c_attn`), so
models.causal.hf_name maps each parameter to its checkpoint key. Inference does not define
the blocks again: a stage of generate/serve loads these same blocks (models.causal.load_block)
and packs each into its decode view (models.llama.LlamaDecode, models.gpt2.GPT2Decode: fused
q/k/v and gate/up, quantised, with KV caches).

Tensor parallelism is described once too: `cuts(heads, ffn)` says which window of each
parameter a rank holds (Megatron: q, k, v, gate, up, c_attn, c_fc by output features;
o, down and both c_proj by input features), and both `tp_slice` (training: cut from the
whole block) and the stage loader (inference: read only that window from disk) follow it.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from smoltrain.models.hf import GELUS, HFConfig
from smoltrain.models.llama import apply_rope, rms_norm, rope_table


def _same(t):
    return t


def run_block(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`block.body(x)`, under activation checkpointing when `block.checkpoint` is set
    (--checkpoint-activations): autograd keeps the block's input only and reruns its forward
    (with the same RNG state) in backward; without grad (eval) it runs plainly."""
    if block.checkpoint and torch.is_grad_enabled():
        from torch.utils.checkpoint import checkpoint

        return checkpoint(block.body, x, use_reentrant=False)
    return block.body(x)


def tp_share(cfg: HFConfig, rank: int, world: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Rank's heads [lo, hi) and MLP units [lo, hi) of an even tp split (models.split.check_tp)."""
    h, f = cfg.heads // world, cfg.ffn // world
    return (rank * h, (rank + 1) * h), (rank * f, (rank + 1) * f)


def cut(t: torch.Tensor, dim: int, ranges: list) -> torch.Tensor:
    """The windows `ranges` ([lo, hi) each) of `t` along `dim`, joined."""
    return torch.cat([t.narrow(dim, lo, hi - lo) for lo, hi in ranges], dim)


def tp_windows(block: nn.Module, heads: tuple[int, int], ffn: tuple[int, int]) -> dict:
    """`block.cuts(heads, ffn)` and, beside each cut layer's weight, the LoRA factor cut with it:
    lora_B's rows (dim 0) where the layer is cut along its output features (dim 0 of a Linear, 1
    of GPT-2's Conv1D), else lora_A's columns (dim 1); the layer's other factor stays whole. The
    one statement of tp's cut that tp_slice, the planner's adapters (finetune.tuning) and a tp
    run's export (finetune.export) all read."""
    cuts, mods = block.cuts(heads, ffn), dict(block.named_modules())
    out = dict(cuts)
    for name, (dim, ranges) in cuts.items():
        layer = name.removesuffix(".weight")
        if layer == name or layer not in mods:
            continue
        by_output = dim == (1 if getattr(mods[layer], "fan_in_fan_out", False) else 0)
        out[f"{layer}.lora_B.weight" if by_output else f"{layer}.lora_A.weight"] = (0 if by_output else 1, ranges)
    return out


def _adapter_cuts(windows: dict) -> dict:
    """{layer: (rows, cols)} for finetune.lora.attach_like from tp_windows' LoRA factors."""
    out = {}
    for name, (_, ranges) in windows.items():
        layer, _, factor = name.removesuffix(".weight").rpartition(".")
        if factor in ("lora_A", "lora_B"):
            idx = torch.cat([torch.arange(lo, hi) for lo, hi in ranges])
            out[layer] = (idx, None) if factor == "lora_B" else (None, idx)
    return out


def _carry_adapters(part, whole, cuts: dict) -> None:
    """LoRA adapters of `whole`'s layers onto the tp slice `part` (finetune.lora.attach_like): a
    column-parallel layer's B cut by its output rows, a row-parallel layer's A by its input columns;
    the uncut factor then has a partial-sum gradient, which tp all-reduces (`partial_grads`)."""
    mods = dict(whole.named_modules())
    if any(hasattr(m, "lora_A") for m in mods.values()):
        from smoltrain.finetune.lora import attach_like

        dst = dict(part.named_modules())
        for name, (rows, cols) in cuts.items():
            if hasattr(mods[name], "lora_A"):
                attach_like(dst[name], mods[name], rows=rows, cols=cols)
                part.partial_grads.append(dst[name].lora_A.weight if cols is None else dst[name].lora_B.weight)
    frozen = {n for n, p in whole.named_parameters() if not p.requires_grad}  # the base, under LoRA
    for n, p in part.named_parameters():
        p.requires_grad_(n not in frozen)


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class Conv1D(nn.Module):
    """GPT-2's linear layer: weight stored [in, out] as in the checkpoint (and as PEFT expects)."""

    fan_in_fan_out = True  # PEFT's flag for a weight stored [in, out]

    def __init__(self, n_in: int, n_out: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features, self.nf = n_in, n_out, n_out
        self.weight = nn.Parameter(torch.zeros(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out)) if bias else None

    def forward(self, x):
        y = x @ self.weight
        return y if self.bias is None else y + self.bias


class Block(nn.Module):
    """A pre-norm block: `body` holds its maths; `enter`/`leave` are identities alone and tp's f/g
    all-reduces when sliced; forward goes through run_block (activation checkpointing).

    A Hugging Face block also gives `sized` (a block of some heads and MLP units), `cuts` (the
    window of each parameter those take) and SHARED (parameters every rank holds whole but uses
    with its own heads only: their gradients are partial sums)."""

    SHARED: tuple[str, ...] = ()

    def __init__(self, cfg: HFConfig):
        super().__init__()
        self.cfg = cfg
        self.enter, self.leave = _same, _same
        self.checkpoint = False  # activation checkpointing (run_block)
        self.partial_grads: list[nn.Parameter] = []  # tp: replicated weights whose gradients need a sum

    def forward(self, x):
        return run_block(self, x)

    def tp_slice(self, heads: tuple[int, int], ffn: tuple[int, int], enter, leave, keep_bias: bool) -> Block:
        """This rank's heads [lo, hi) (whole KV groups) and MLP units, each parameter cut by `cuts`;
        the output projections' biases only on the rank that keeps them (added once)."""
        part = self.sized(self.cfg, heads, ffn, keep_bias)
        cuts, own = tp_windows(self, heads, ffn), dict(self.named_parameters())
        with torch.no_grad():
            for n, p in part.named_parameters():
                p.copy_(cut(own[n], *cuts[n]) if n in cuts else own[n])
        part.partial_grads += [p for n, p in part.named_parameters() if n in self.SHARED]
        _carry_adapters(part, self, _adapter_cuts(cuts))
        part.enter, part.leave, part.checkpoint = enter, leave, self.checkpoint
        return part


class LlamaAttention(nn.Module):
    def __init__(self, cfg: HFConfig, heads: int, kv_heads: int, o_bias: bool):
        super().__init__()
        h, hd = cfg.hidden, cfg.head_dim
        self.cfg, self.heads, self.kv_heads = cfg, heads, kv_heads
        bias = cfg.bias or cfg.qkv_bias
        self.q_proj = nn.Linear(h, heads * hd, bias=bias)
        self.k_proj = nn.Linear(h, kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(h, kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(heads * hd, h, bias=o_bias)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(hd, cfg.eps), RMSNorm(hd, cfg.eps)

    def forward(self, x):
        (B, T), hd, cfg = x.shape[:2], self.cfg.head_dim, self.cfg
        q = self.q_proj(x).view(B, T, self.heads, hd)
        k = self.k_proj(x).view(B, T, self.kv_heads, hd)
        v = self.v_proj(x).view(B, T, self.kv_heads, hd)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        scaling = tuple(cfg.rope_scaling) if cfg.rope_scaling else None
        cos, sin = rope_table(cfg.rope_theta, hd, T, torch.float32, str(x.device), scaling)
        cos, sin = cos.to(x.dtype)[:, None], sin.to(x.dtype)[:, None]
        q, k = apply_rope(q, cos, sin).transpose(1, 2), apply_rope(k, cos, sin).transpose(1, 2)
        a = F.scaled_dot_product_attention(
            q, k, v.transpose(1, 2), is_causal=True, enable_gqa=self.kv_heads != self.heads
        )
        return self.o_proj(a.transpose(1, 2).reshape(B, T, self.heads * hd))


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(Block):
    SHARED = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")  # qwen3

    def __init__(self, cfg: HFConfig, heads: int, kv_heads: int, ffn: int, o_bias: bool | None = None):
        super().__init__(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        self.self_attn = LlamaAttention(cfg, heads, kv_heads, cfg.bias if o_bias is None else o_bias)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        self.mlp = LlamaMLP(cfg.hidden, ffn)

    def body(self, x):
        x = x + self.leave(self.self_attn(self.enter(self.input_layernorm(x))))
        return x + self.leave(self.mlp(self.enter(self.post_attention_layernorm(x))))

    @classmethod
    def sized(cls, cfg: HFConfig, heads: tuple[int, int], ffn: tuple[int, int], keep_bias: bool) -> LlamaBlock:
        n = heads[1] - heads[0]
        return cls(cfg, n, n // (cfg.heads // cfg.kv_heads), ffn[1] - ffn[0], cfg.bias and keep_bias)

    def cuts(self, heads: tuple[int, int], ffn: tuple[int, int]) -> dict:
        """{parameter: (dim, [(lo, hi)])}: q by these heads, k and v by their kv groups, gate and up
        by these MLP units (output rows); o and down by the same (input columns)."""
        hd, g, f = self.cfg.head_dim, self.cfg.heads // self.cfg.kv_heads, tuple(ffn)
        q, kv = (heads[0] * hd, heads[1] * hd), (heads[0] // g * hd, heads[1] // g * hd)
        out = {}
        for p, r in (("q", q), ("k", kv), ("v", kv)):
            out[f"self_attn.{p}_proj.weight"] = out[f"self_attn.{p}_proj.bias"] = (0, [r])
        out.update({"self_attn.o_proj.weight": (1, [q]), "mlp.down_proj.weight": (1, [f])})
        out.update({"mlp.gate_proj.weight": (0, [f]), "mlp.up_proj.weight": (0, [f])})
        return out


class GPT2Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, head_dim: int, proj_bias: bool):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.c_attn = Conv1D(hidden, 3 * heads * head_dim)
        self.c_proj = Conv1D(heads * head_dim, hidden, bias=proj_bias)

    def forward(self, x):
        (B, T), n, hd = x.shape[:2], self.heads, self.head_dim
        q, k, v = (t.view(B, T, n, hd).transpose(1, 2) for t in self.c_attn(x).split(n * hd, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(a.transpose(1, 2).reshape(B, T, n * hd))


class GPT2MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int, act: str, proj_bias: bool):
        super().__init__()
        self.c_fc, self.c_proj, self.approx = Conv1D(hidden, ffn), Conv1D(ffn, hidden, bias=proj_bias), GELUS[act]

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approx))


class GPT2Block(Block):
    def __init__(self, cfg: HFConfig, heads: int, ffn: int, proj_bias: bool = True):
        super().__init__(cfg)
        self.ln_1 = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.attn = GPT2Attention(cfg.hidden, heads, cfg.head_dim, proj_bias)
        self.ln_2 = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.mlp = GPT2MLP(cfg.hidden, ffn, cfg.act, proj_bias)

    def body(self, x):
        x = x + self.leave(self.attn(self.enter(self.ln_1(x))))
        return x + self.leave(self.mlp(self.enter(self.ln_2(x))))

    @classmethod
    def sized(cls, cfg: HFConfig, heads: tuple[int, int], ffn: tuple[int, int], keep_bias: bool) -> GPT2Block:
        return cls(cfg, heads[1] - heads[0], ffn[1] - ffn[0], keep_bias)

    def cuts(self, heads: tuple[int, int], ffn: tuple[int, int]) -> dict:
        """Megatron's split of GPT-2 (Conv1D weights are [in, out]): c_attn's q, k and v columns of
        these heads, c_fc's columns of these units, the rows of both c_proj."""
        h, hd, f = self.cfg.hidden, self.cfg.head_dim, tuple(ffn)
        c = (heads[0] * hd, heads[1] * hd)
        thirds = [(o + c[0], o + c[1]) for o in (0, h, 2 * h)]
        out = {"attn.c_attn.weight": (1, thirds), "attn.c_attn.bias": (0, thirds), "attn.c_proj.weight": (0, [c])}
        out.update({"mlp.c_fc.weight": (1, [f]), "mlp.c_fc.bias": (0, [f]), "mlp.c_proj.weight": (0, [f])})
        return out


class Attention(nn.Module):
    """The built-in GPT's causal self-attention over `heads` heads (tp builds it with a slice)."""

    def __init__(self, hidden: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.q = nn.Linear(hidden, inner, bias=False)
        self.k = nn.Linear(hidden, inner, bias=False)
        self.v = nn.Linear(hidden, inner, bias=False)
        self.out = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mix(x))

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        """Everything up to (not including) the output projection."""
        b, t, _ = x.shape
        split = lambda y: y.view(b, t, self.heads, self.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        return (att @ v).transpose(1, 2).reshape(b, t, self.heads * self.head_dim)


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc = nn.Linear(hidden, ffn, bias=False)
        self.proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class GPTBlock(Block):
    """The built-in GPT's block: GPT-2's pre-norm layout without linear biases, exact GELU (tp
    slices it through strategies.tp.ParallelBlock)."""

    def __init__(self, cfg: HFConfig):
        super().__init__(cfg)
        self.ln1 = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.attn = Attention(cfg.hidden, cfg.heads, cfg.head_dim)
        self.ln2 = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.mlp = MLP(cfg.hidden, cfg.ffn)

    def body(self, x):
        x = x + self.leave(self.attn(self.enter(self.ln1(x))))
        return x + self.leave(self.mlp(self.enter(self.ln2(x))))


def make_block(cfg: HFConfig) -> Block:
    """One whole layer of the architecture `cfg` names."""
    if cfg.family == "gpt":
        return GPTBlock(cfg)
    return BLOCKS[cfg.family].sized(cfg, (0, cfg.heads), (0, cfg.ffn), True)


BLOCKS = {"llama": LlamaBlock, "gpt2": GPT2Block}  # the Hugging Face families, by HFConfig.family
