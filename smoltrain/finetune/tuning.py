"""The planner's picture of a fine-tuning run (planner.tuning.Tuning), read off the model the run
builds: the checkpoint's layers on the meta device (no memory, no weights read) with LoRA applied
as `run` applies it, so the adapters the plan counts are the ones that train and cross the wire.
"""

from __future__ import annotations

import re

from smolnet.errors import UsageError
from smoltrain.planner.tuning import QUANTIZED_STRATEGIES, Adapter, Tuning

LAYER = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")


def describe(spec, lora: dict | None, quantize: str | None = None, checkpoint_activations: bool = False) -> Tuning:
    """The Tuning of `spec` (a Hugging Face checkpoint for LoRA or --quantize) under these settings;
    a LoRA target or rank the model cannot take exits 2 (finetune.lora.LoraError)."""
    if (lora or quantize) and not spec.source:
        raise UsageError("--lora-rank and --quantize (training) need a Hugging Face checkpoint folder as --model")
    if not lora:
        return Tuning(None, (), quantize, checkpoint_activations)
    import torch

    from smoltrain.finetune.lora import LoraConfig, adapted, apply
    from smoltrain.models.blocks import tp_windows
    from smoltrain.models.causal import CausalLM
    from smoltrain.models.hf import read_config

    with torch.device("meta"):
        model = CausalLM(read_config(spec.source), spec)
    cfg = LoraConfig.from_dict(lora)
    apply(model, cfg, spec.arch, 0)
    hf = model.cfg
    windows = tp_windows(model.units[1], (0, hf.heads), (0, hf.ffn))  # tp's cut (models.blocks), any block's
    out = []
    for name, m in adapted(model):
        hit = LAYER.search(name)
        unit = int(hit.group(1)) + 1 if hit else (spec.layers + 1 if name.endswith("lm_head") else 0)
        inner = name[hit.end() :] if hit else ""  # its name within the block
        # a column-parallel layer's B is cut by rows, a row-parallel layer's A by columns
        cut = "col" if f"{inner}.lora_B.weight" in windows else "row" if f"{inner}.lora_A.weight" in windows else ""
        a, b = m.lora_A.weight, m.lora_B.weight
        pos = 2 * (unit - 1) + (".mlp." in name) if hit else 2 * spec.layers if unit else 0
        out.append(Adapter(unit, name, int(a.shape[1]), int(b.shape[0]), cfg.rank, cut, pos))
    return Tuning(cfg.to_dict(), tuple(out), quantize, checkpoint_activations)


def check_quantize(quantize: str | None, spec, lora: dict | None, strategy: str, mesh: str | None) -> None:
    """`run --quantize`: a frozen base held quantised (models.qlinear) under LoRA adapters, with a
    strategy that keeps each layer whole; anything else exits 2 in one line naming why."""
    if not quantize:
        return
    if not spec.source:
        raise UsageError("--quantize (training) needs a Hugging Face checkpoint folder as --model")
    if not lora:
        raise UsageError(f"--quantize {quantize} in training quantises a frozen base: it needs --lora-rank")
    axes = [a.split("=")[0].strip() for a in (mesh or "").split(",") if a]
    if strategy not in QUANTIZED_STRATEGIES or any(a not in QUANTIZED_STRATEGIES for a in axes):
        raise UsageError(
            f"--quantize with {'--mesh ' + mesh if mesh else strategy}: a quantised base trains with "
            f"{', '.join(QUANTIZED_STRATEGIES)} (tp cuts each layer's full-width weight; fsdp, syncps and edp move it)"
        )


def add_arguments(p) -> None:
    """`plan`'s fine-tuning inputs (run takes the same LoRA flags; --quantize is plan's own)."""
    g = p.add_argument_group("fine-tuning (train, a Hugging Face --model)")
    from smoltrain import validate

    g.add_argument(
        "--lora-rank", type=validate.LORA_RANK, metavar="R", help="plan LoRA adapters of rank R (the base frozen)"
    )
    g.add_argument("--lora-alpha", type=validate.LORA_ALPHA, default=16.0, help="LoRA scale alpha/R (default 16)")
    g.add_argument("--lora-targets", help="layers to adapt, e.g. q_proj,v_proj (default: q_proj,v_proj; c_attn)")
    g.add_argument(
        "--checkpoint-activations",
        action="store_true",
        help="plan activation checkpointing: each layer's input kept, its forward rerun in backward",
    )


def from_options(spec, o: dict) -> Tuning | None:
    """The Tuning that `plan`'s or `run`'s options ask for (None: full training, nothing special);
    --quantize in train mode is the frozen base's format (QLoRA)."""
    rank = o.get("lora_rank")
    quantize = o.get("quantize") if o.get("mode", "train") == "train" else None
    ckpt = bool(o.get("checkpoint_activations"))
    if rank is None and not quantize and not ckpt:
        return None
    lora = None
    if rank is not None:
        from smoltrain.finetune.lora import LoraConfig, parse_targets

        cfg = LoraConfig(
            rank, o.get("lora_alpha", 16.0), o.get("lora_dropout") or 0.0, parse_targets(o.get("lora_targets"))
        )
        lora = cfg.to_dict()
    return describe(spec, lora, quantize, ckpt)
