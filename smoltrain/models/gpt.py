"""A GPT in one file (nanoGPT-like), built from a `ModelSpec`.

Learned token and position embeddings, pre-norm blocks (LayerNorm, causal
self-attention, GELU MLP), a final LayerNorm and an LM head (untied for `tiny`).
Linear layers have no bias, so the parameter count is exactly `spec.params()`,
the number the planner uses.

The model is a plain list of *units*: `Embed`, then one `Block` per layer, then
`Head`. Every strategy cuts along these units: `mp`/`pp` give each rank a run of
them, `fsdp` shards each unit's parameters, `tp` splits inside each `Block`.
Building the full model from the seed on every rank and then cutting it is what
makes initial weights independent of the world size.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from smoltrain.models.spec import ModelSpec


class Embed(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.wte = nn.Embedding(spec.vocab, spec.hidden)
        self.wpe = nn.Embedding(spec.ctx, spec.hidden) if spec.learned_pos else None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        return x


class Attention(nn.Module):
    """Causal self-attention over `heads` heads; `tp` builds it with a slice of the heads."""

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


def run_block(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`block.body(x)`, under activation checkpointing when `block.checkpoint` is set
    (--checkpoint-activations): autograd keeps the block's input only and reruns its forward
    (with the same RNG state) in backward; without grad (eval) it runs plainly."""
    if block.checkpoint and torch.is_grad_enabled():
        from torch.utils.checkpoint import checkpoint

        return checkpoint(block.body, x, use_reentrant=False)
    return block.body(x)


class Block(nn.Module):
    checkpoint = False  # set per instance by Context.build_model (RunConfig.checkpoint_activations)

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.ln1 = nn.LayerNorm(spec.hidden)
        self.attn = Attention(spec.hidden, spec.heads, spec.head_dim)
        self.ln2 = nn.LayerNorm(spec.hidden)
        self.mlp = MLP(spec.hidden, spec.ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_block(self, x)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.ln_f = nn.LayerNorm(spec.hidden)
        self.lm_head = nn.Linear(spec.hidden, spec.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class GPT(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        if spec.gated_mlp or spec.experts > 1 or spec.kv_heads != spec.heads:
            raise ValueError(f"model {spec.name}: only GPT-style (dense, GELU, full-head) shapes can be trained")
        self.spec = spec
        self.units = nn.ModuleList([Embed(spec)] + [Block(spec) for _ in range(spec.layers)] + [Head(spec)])
        if spec.tied_embeddings:
            self.units[-1].lm_head.weight = self.units[0].wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = idx
        for unit in self.units:
            x = unit(x)
        return x


def build_model(spec: ModelSpec, seed: int, quantize: str | None = None) -> GPT:
    """The full model with GPT-2 style initialisation, a function of the seed only; a Hugging Face
    checkpoint's shape (`spec.source`) is that checkpoint's weights instead (models.causal), its
    base quantised and frozen under `quantize` (QLoRA)."""
    if spec.source:
        from smoltrain.models.causal import build

        return build(spec, quantize)
    if quantize:
        raise ValueError("--quantize (training) needs a Hugging Face checkpoint")
    gen = torch.Generator().manual_seed(seed)
    model = GPT(spec)
    for name, p in model.named_parameters():
        if name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight")):
            nn.init.ones_(p)
        elif p.dim() == 1:
            nn.init.zeros_(p)
        else:
            std = 0.02 / math.sqrt(2 * spec.layers) if name.endswith(("out.weight", "proj.weight")) else 0.02
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


def loss_sum(logits: torch.Tensor, targets: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """This rank's share of the global mean loss: sum over its tokens / global tokens.

    Summing these shares over ranks gives the mean over the global batch, and so
    do their gradients: no rank needs to know how the batch was split.
    Targets of -100 (transformers' ignore_index: prompt tokens, padding) carry no loss, and
    `total_tokens` counts only the targets that do.
    """
    logits = logits.reshape(-1, logits.shape[-1]).float()
    return F.cross_entropy(logits, targets.reshape(-1), reduction="sum", ignore_index=-100) / total_tokens


def split_units(n_units: int, layers: int, stages: int) -> list[range]:
    """Units per stage for mp/pp: layers spread as evenly as possible; Embed joins
    the first stage, Head the last."""
    base, extra = divmod(layers, stages)
    out, start = [], 1
    for s in range(stages):
        n = base + (1 if s < extra else 0)
        lo = 0 if s == 0 else start
        hi = start + n + (1 if s == stages - 1 else 0)
        out.append(range(lo, hi))
        start += n
    assert out[-1].stop == n_units
    return out
