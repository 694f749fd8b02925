"""The causal LM, for training and inference alike: Llama (and SmolLM2, Llama 3.x), Qwen2/2.5,
Qwen3, GPT-2, and the built-in GPT.

One model for every strategy: `units` = `Embed`, one block per layer (models.blocks), `Head`,
so mp/pp take a run of units, fsdp each unit's parameters and tp the inside of each block
(`Block.tp_slice`; the built-in block through strategies.tp). A config picks the block: a
Hugging Face checkpoint's (models.hf.HFConfig) or the built-in shapes' (`tiny`, `tiny8`, a
JSON shape: models.gpt.config, arch "gpt": LayerNorm, learned positions, exact GELU, no linear
biases, its own short parameter names, which its checkpoints and export keep).

`hf_name` maps every parameter to its checkpoint key: what LoRA targets, what export writes,
and how both `build` (a whole model for training) and `load_block`/`load_ends` (one stage's
units, one tp rank's windows, for generate and serve: models.stage packs them for decode)
read a checkpoint. Both follow transformers number for number, and the tests hold them to it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from smoltrain.models.blocks import (  # noqa: F401 (re-exported: models.gpt)
    BLOCKS,
    MLP,
    Attention,
    Block,
    GPTBlock,
    RMSNorm,
    make_block,
    run_block,
    tp_share,
)
from smoltrain.models.hf import Checkpoint, HFConfig
from smoltrain.models.spec import ModelSpec


def _embedding(n: int, dim: int) -> nn.Embedding:
    """nn.Embedding (its N(0, 1) init), except on the meta device, where it is left uninitialised:
    meta's normal_ is a Python decomposition whose first use imports ~800 modules (1 s, 67 MB)."""
    w = torch.empty(n, dim)
    if w.device.type != "meta":
        nn.init.normal_(w)
    return nn.Embedding(n, dim, _weight=w)


class Embed(nn.Module):
    """Token embeddings, plus learned positions where the model has them (GPT-2, the built-in GPT)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.wte = _embedding(spec.vocab, spec.hidden)
        self.wpe = _embedding(spec.ctx, spec.hidden) if spec.learned_pos else None

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """`positions` [rows, T]: where each row's tokens sit (decode continues a sequence); 0..T-1 else."""
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(idx.shape[1], device=idx.device) if positions is None else positions)
        return x


class Head(nn.Module):
    """The final norm and the LM head (tied: the embedding table itself)."""

    def __init__(self, cfg: HFConfig):
        super().__init__()
        if cfg.family in ("gpt2", "gpt"):
            self.ln_f = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        else:
            self.norm = RMSNorm(cfg.hidden, cfg.eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    @property
    def final_norm(self) -> nn.Module:
        return self.ln_f if hasattr(self, "ln_f") else self.norm

    def forward(self, x):
        return self.lm_head(self.final_norm(x))


class CausalLM(nn.Module):
    """`units`: Embed, blocks, Head; `forward(ids)` -> logits [B, T, vocab]."""

    def __init__(self, cfg: HFConfig, spec: ModelSpec):
        super().__init__()
        self.cfg, self.spec = cfg, spec
        blocks = [make_block(cfg) for _ in range(cfg.layers)]
        self.units = nn.ModuleList([Embed(spec), *blocks, Head(cfg)])
        if cfg.tied:
            self.units[-1].lm_head.weight = self.units[0].wte.weight

    def forward(self, idx):
        x = idx
        for unit in self.units:
            x = unit(x)
        return x

    def hf_named_modules(self):
        """(checkpoint module name, module) of every sub-module of the blocks and ends, e.g.
        `model.layers.0.self_attn.q_proj` or GPT-2's `h.0.attn.c_attn`: what LoRA targets."""
        n = len(self.units)
        for i, unit in enumerate(self.units):
            for name, mod in unit.named_modules():
                if name:
                    yield hf_name(self.cfg, i, name + ".weight", n)[: -len(".weight")], mod

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return hf_state_dict(self)


def hf_name(cfg: HFConfig, unit: int, name: str, n_units: int) -> str:
    """The checkpoint key of parameter `name` of unit `unit` (without GPT-2's `transformer.` prefix)."""
    gpt2 = cfg.family == "gpt2"
    if unit == 0:
        table = "wte" if gpt2 else "model.embed_tokens"
        return table + name[3:] if name.startswith("wte") else name
    if unit == n_units - 1:
        if name.startswith("lm_head"):
            return name
        return name if gpt2 else "model." + name
    return f"h.{unit - 1}.{name}" if gpt2 else f"model.layers.{unit - 1}.{name}"


def hf_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """Every parameter under its checkpoint key (a tied head is the embedding: not repeated)."""
    out, n = {}, len(model.units)
    for i, unit in enumerate(model.units):
        for name, p in unit.named_parameters(remove_duplicate=False):
            if i == n - 1 and name == "lm_head.weight" and model.cfg.tied:
                continue
            out[hf_name(model.cfg, i, name, n)] = p
    return out


def trainable_params(spec: ModelSpec, lora: dict | None) -> int:
    """Parameters a run trains: all of them, or under LoRA the adapters alone, counted on a model
    built without memory (the meta device); finetune.lora raises on targets or ranks it cannot take."""
    if not lora:
        return spec.params()
    from smoltrain.finetune.lora import LoraConfig, apply
    from smoltrain.models.hf import read_config

    with torch.device("meta"):
        model = CausalLM(read_config(spec.source), spec)
    apply(model, LoraConfig.from_dict(lora), spec.arch, 0)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def build(spec: ModelSpec, quantize: str | None = None) -> CausalLM:
    """The checkpoint at `spec.source` as fp32 parameters (the master weights whatever its dtype);
    with `quantize` (QLoRA) the blocks' linear layers and an untied head are held quantised and
    frozen (models.qlinear), each quantised as it is read: the base is never whole at fp32."""
    ckpt = Checkpoint(spec.source)
    ckpt.check()
    if quantize:
        from smoltrain.models.qlinear import swap_in

        with torch.device("meta"):
            model = CausalLM(ckpt.config, spec)
        quantised = swap_in(model, quantize)
        model.to_empty(device="cpu")
        if ckpt.config.tied:  # to_empty gives each use of the shared table its own storage
            model.units[-1].lm_head.weight = model.units[0].wte.weight
    else:
        model, quantised = CausalLM(ckpt.config, spec), {}
    with torch.no_grad():
        for key, p in hf_state_dict(model).items():
            t = ckpt.read(key).float()
            if ckpt.config.family == "gpt2" and key == "wpe.weight":
                t = t[: p.shape[0]]
            p.copy_(t)
        for key, layer in quantised.items():
            layer.load(ckpt.read(key))
    if quantize:
        model.requires_grad_(False)  # frozen until LoRA adds what trains
    return model


def _read(ckpt: Checkpoint, key: str, dim: int | None = None, ranges=()) -> torch.Tensor:
    """Tensor `key`, or only its windows `ranges` along `dim` (models.blocks cuts), joined."""
    if dim is None:
        return ckpt.read(key)
    return torch.cat([ckpt.read(key, r, None) if dim == 0 else ckpt.read(key, None, r) for r in ranges], dim)


def _assign(unit: nn.Module, tensors: dict) -> nn.Module:
    """`unit` (built on the meta device) holding `tensors` themselves, frozen: no copy, no init."""
    unit.load_state_dict(tensors, assign=True)
    return unit.requires_grad_(False)


def load_block(ckpt: Checkpoint, i: int, rank: int = 0, world: int = 1, dtype=torch.float32, device="cpu") -> Block:
    """Layer `i` as its training block, holding tp rank `rank` of `world`'s heads and MLP units (every
    output bias: inference adds it once, after the reduce); each parameter read by its hf_name, only
    this rank's window of it, at `dtype` on `device`: a stage never holds more than its own share."""
    cfg = ckpt.config
    heads, ffn = tp_share(cfg, rank, world)
    with torch.device("meta"):
        block = BLOCKS[cfg.family].sized(cfg, heads, ffn, True)
    cuts = block.cuts(heads, ffn) if world > 1 else {}
    n, tensors = cfg.layers + 2, {}
    # the matrices first, in their order (the order they are packed), then the vectors: a norm kept
    # after packing, read between them, would pin the heap their memory returns to (glibc)
    for name, _ in sorted(block.named_parameters(), key=lambda np: np[1].dim() < 2):
        tensors[name] = _read(ckpt, hf_name(cfg, i + 1, name, n), *cuts.get(name, (None, ()))).to(device, dtype)
    return _assign(block, tensors)


def load_ends(ckpt: Checkpoint, first: bool, last: bool, dtype, device="cpu") -> tuple[Embed | None, Head | None]:
    """The Embed unit (first stage) and the Head unit (last stage), read by hf_name at `dtype`; an
    untied head stays at the checkpoint's dtype (a stage quantises it from that), a tied one is
    the embedding table itself."""
    cfg, n = ckpt.config, ckpt.config.layers + 2
    table = None
    if first or (last and cfg.tied):
        table = ckpt.read(hf_name(cfg, 0, "wte.weight", n)).to(device, dtype)
    embed = head = None
    if first:
        with torch.device("meta"):
            embed = Embed(cfg.spec())
        tensors = {"wte.weight": table}
        if embed.wpe is not None:
            tensors["wpe.weight"] = ckpt.read(hf_name(cfg, 0, "wpe.weight", n)).to(device, dtype)
        embed = _assign(embed, tensors)
    if last:
        with torch.device("meta"):
            head = Head(cfg)
        names = [name for name, _ in head.named_parameters() if name != "lm_head.weight"]
        tensors = {name: ckpt.read(hf_name(cfg, n - 1, name, n)).to(device, dtype) for name in names}
        tensors["lm_head.weight"] = table if cfg.tied else ckpt.read("lm_head.weight").to(device)
        head = _assign(head, tensors)
    return embed, head
