"""The built-in GPT (`tiny`, `tiny8`, a JSON shape): a configuration of the one causal model.

nanoGPT's model, as `models.causal.CausalLM` with the "gpt" block: learned token and
position embeddings, pre-norm blocks (LayerNorm, causal self-attention, exact-GELU MLP), a
final LayerNorm and an LM head (untied for `tiny`). Linear layers have no bias, so the
parameter count is exactly `spec.params()`, the number the planner uses.

The model is a plain list of *units*: `Embed`, then one block per layer, then `Head`. Every
strategy cuts along these units: `mp`/`pp` give each rank a run of them, `fsdp` shards each
unit's parameters, `tp` splits inside each block. Building the full model from the seed on
every rank and then cutting it is what makes initial weights independent of the world size.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from smoltrain.models.causal import MLP, Attention, CausalLM, Embed, GPTBlock, run_block  # noqa: F401 (re-exported)
from smoltrain.models.hf import HFConfig
from smoltrain.models.spec import ModelSpec

Block = GPTBlock


def config(spec: ModelSpec) -> HFConfig:
    """The causal model's config of a built-in shape (LayerNorm's default eps, exact GELU)."""
    return HFConfig(
        "gpt",
        spec.vocab,
        spec.hidden,
        spec.layers,
        spec.heads,
        spec.kv_heads,
        spec.head_dim,
        spec.ffn,
        spec.ctx,
        eps=1e-5,
        tied=spec.tied_embeddings,
        name=spec.name,
        act="gelu",
    )


class GPT(CausalLM):
    def __init__(self, spec: ModelSpec):
        if spec.gated_mlp or spec.experts > 1 or spec.kv_heads != spec.heads:
            raise ValueError(f"model {spec.name}: only GPT-style (dense, GELU, full-head) shapes can be trained")
        super().__init__(config(spec), spec)


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
