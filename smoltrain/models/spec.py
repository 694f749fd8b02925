"""Shapes of the built-in models: what the planner counts and the trainer builds.

Published shapes for the real models; `tiny` is ours, sized to train in seconds on a
CPU and to split evenly over 1, 2 or 3 ranks (6 layers, 6 heads); its head is
untied so pipeline stages share no weights and only activations cross the links.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from smolnet.errors import SmolError


class ModelSpecError(SmolError):
    pass


@dataclass(frozen=True)
class ModelSpec:
    name: str
    vocab: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int  # MLP inner width (per expert for MoE)
    ctx: int  # maximum sequence length
    tied_embeddings: bool = True
    gated_mlp: bool = False  # SwiGLU (3 matrices) instead of GELU (2)
    experts: int = 1  # MoE experts per layer (1 = dense)
    top_k: int = 1  # experts each token visits
    learned_pos: bool = True  # learned position embeddings (GPT) vs rotary (Llama)
    # A Hugging Face checkpoint (models.hf): its architecture, folder, and what the counts need
    arch: str = ""  # "" (built-in shape), "llama", "qwen2", "qwen3" or "gpt2"
    source: str = ""  # the checkpoint folder the trainer loads (models.causal); "" builds from the seed
    head_size: int = 0  # head_dim when it is not hidden/heads (qwen3); 0: hidden // heads
    qkv_bias: bool = False  # biases on q, k, v (qwen2, gpt2)
    o_bias: bool = False  # a bias on the attention output (gpt2, llama attention_bias)
    qk_norm: bool = False  # per-head RMSNorm of q and k (qwen3)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def rms(self) -> bool:
        """RMSNorm (weight only) rather than LayerNorm (weight and bias): the Llama family."""
        return self.arch in ("llama", "qwen2", "qwen3")

    def attn_params(self) -> int:
        h, q = self.hidden, self.q_dim
        bias = (q + 2 * self.kv_dim if self.qkv_bias else 0) + (h if self.o_bias else 0)
        return 2 * h * q + 2 * h * self.kv_dim + bias  # q, k, v, out

    def mlp_params(self) -> int:
        per = (3 if self.gated_mlp else 2) * self.hidden * self.ffn
        if self.arch == "gpt2":
            per += self.ffn + self.hidden  # c_fc and c_proj biases
        return per * self.experts + (self.hidden * self.experts if self.experts > 1 else 0)

    def norm_params(self) -> int:
        """One norm's parameters: RMSNorm a weight, LayerNorm a weight and a bias."""
        return self.hidden if self.rms else 2 * self.hidden

    def layer_params(self) -> int:
        qk = 2 * self.head_dim if self.qk_norm else 0
        return self.attn_params() + self.mlp_params() + 2 * self.norm_params() + qk

    def embedding_params(self) -> int:
        emb = self.vocab * self.hidden
        pos = self.ctx * self.hidden if self.learned_pos else 0
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return emb + pos + head + self.norm_params()  # + final norm

    def params(self) -> int:
        return self.layers * self.layer_params() + self.embedding_params()

    def active_params(self) -> int:
        """Parameters one token touches (MoE: only top_k experts)."""
        if self.experts == 1:
            return self.params()
        per_expert = (3 if self.gated_mlp else 2) * self.hidden * self.ffn
        return self.params() - self.layers * per_expert * (self.experts - self.top_k)

    def to_dict(self) -> dict:
        """The fields, params and head_dim; the checkpoint fields only for a checkpoint, so a
        built-in shape's dict (and the run identity digested from it) is what it always was."""
        d = asdict(self)
        if not self.arch:
            for k in ("arch", "source", "head_size", "qkv_bias", "o_bias", "qk_norm"):
                d.pop(k)
        d["params"] = self.params()
        d["head_dim"] = self.head_dim
        return d


BUILTIN: dict[str, ModelSpec] = {
    "tiny": ModelSpec(
        "tiny", vocab=256, layers=6, hidden=96, heads=6, kv_heads=6, ffn=384, ctx=64, tied_embeddings=False
    ),
    # tiny8: the demo's model, whose 8 layers and 4 heads split evenly over 1, 2 or 4 ranks
    # (pp and tp apply on the 4-host sim); untied like tiny
    "tiny8": ModelSpec(
        "tiny8", vocab=256, layers=8, hidden=96, heads=4, kv_heads=4, ffn=384, ctx=64, tied_embeddings=False
    ),
    "gpt2-124m": ModelSpec("gpt2-124m", vocab=50257, layers=12, hidden=768, heads=12, kv_heads=12, ffn=3072, ctx=1024),
    "llama-3.2-1b": ModelSpec(
        "llama-3.2-1b",
        vocab=128256,
        layers=16,
        hidden=2048,
        heads=32,
        kv_heads=8,
        ffn=8192,
        ctx=131072,
        tied_embeddings=True,
        gated_mlp=True,
        learned_pos=False,
    ),
    "llama-3.1-8b": ModelSpec(
        "llama-3.1-8b",
        vocab=128256,
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        ffn=14336,
        ctx=131072,
        tied_embeddings=False,
        gated_mlp=True,
        learned_pos=False,
    ),
    "mixtral-8x7b": ModelSpec(
        "mixtral-8x7b",
        vocab=32000,
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        ffn=14336,
        ctx=32768,
        tied_embeddings=False,
        gated_mlp=True,
        experts=8,
        top_k=2,
        learned_pos=False,
    ),
}


def get_model(name_or_file: str) -> ModelSpec:
    """A built-in name, a JSON file with ModelSpec's fields, or a Hugging Face checkpoint folder
    (its exact shape, with `source` set so the trainer loads its weights)."""
    if name_or_file in BUILTIN:
        return BUILTIN[name_or_file]
    p = Path(name_or_file)
    if p.is_dir():
        from smoltrain.models.hf import CheckpointError, read_config

        try:
            return replace(read_config(str(p)).spec(), source=str(p.resolve()))
        except CheckpointError as e:
            raise ModelSpecError(str(e)) from None
    if p.suffix == ".json" and p.exists():
        try:
            d = json.loads(p.read_text())
            d.setdefault("name", p.stem)
            fields = set(ModelSpec.__dataclass_fields__)
            spec = ModelSpec(**{k: v for k, v in d.items() if k in fields})
        except (ValueError, TypeError) as e:
            raise ModelSpecError(f"{p}: not a model description: {e}") from None
        if spec.hidden % spec.heads or spec.heads % spec.kv_heads:
            raise ModelSpecError(f"{p}: hidden must divide by heads and heads by kv_heads")
        return spec
    raise ModelSpecError(
        f"unknown model {name_or_file!r} (built-in: {', '.join(BUILTIN)}, a .json file or a Hugging Face folder)"
    )


def with_overrides(spec: ModelSpec, **kw) -> ModelSpec:
    return replace(spec, **{k: v for k, v in kw.items() if v is not None})
