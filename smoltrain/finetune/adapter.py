"""A PEFT LoRA adapter folder read back: `generate`/`serve --model BASE --adapter DIR`, and `export --merge`.

`adapter_config.json` must say `peft_type: LORA`; `adapter_model.safetensors` holds
`base_model.model.<layer>.lora_A.weight` (r x in) and `lora_B.weight` (out x r) for each adapted
layer. The scale is lora_alpha / r (lora_alpha / sqrt(r) with use_rslora), and GPT-2's Conv1D
layers take the transposed product, as PEFT's merge does. What we cannot apply exactly (DoRA,
bias adapters, modules_to_save, per-layer rank patterns, embedding adapters) is refused.

`AdaptedCheckpoint` is a models.hf.Checkpoint whose `read` returns base + delta for every adapted
weight (only the window a rank asks for under tp), so every inference path, one process or many
ranks, quantised or not, runs the merged model without a merged copy on disk.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from smoltrain.finetune.lora import delta
from smoltrain.models.hf import Checkpoint, CheckpointError, expected_tensors

PREFIX = "base_model.model."
REFUSED = {
    "use_dora": "DoRA",
    "lora_bias": "bias adapters (lora_bias)",
    "modules_to_save": "modules_to_save (fully trained extra layers)",
    "rank_pattern": "per-layer ranks (rank_pattern)",
    "alpha_pattern": "per-layer alphas (alpha_pattern)",
}


@dataclass
class Adapter:
    rank: int
    alpha: float
    scaling: float
    targets: list
    pairs: dict  # layer name as the checkpoint names it (no `transformer.`) -> (A, B)


def from_state(state: dict, lora_cfg) -> Adapter:
    """An Adapter of a run's tensors ({layer.lora_A.weight: tensor}, lora.adapter_state's names)."""
    pairs: dict = {}
    for key, t in state.items():
        pairs.setdefault(_layer_name(key), {})[key.rsplit(".", 2)[-2][-1]] = t
    return Adapter(
        lora_cfg.rank, lora_cfg.alpha, lora_cfg.scaling, [], {n: (ab["A"], ab["B"]) for n, ab in pairs.items()}
    )


def _layer_name(key: str) -> str:
    """`base_model.model.transformer.h.0.attn.c_attn.lora_A.weight` -> `h.0.attn.c_attn`."""
    name = key.removeprefix(PREFIX).rsplit(".lora_", 1)[0]
    return name.removeprefix("transformer.")


def read_adapter(adapter_dir: str) -> Adapter:
    cfg_path = os.path.join(adapter_dir, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"--adapter {adapter_dir}: no adapter_config.json (a PEFT LoRA adapter folder)")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            c = json.load(f)
        if c.get("peft_type") != "LORA":
            raise CheckpointError(f"{cfg_path}: peft_type {c.get('peft_type')!r}; only LORA adapters are supported")
        r, alpha = int(c["r"]), float(c["lora_alpha"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise CheckpointError(f"{cfg_path}: not a LoRA adapter config ({type(e).__name__}: {e})") from None
    for key, what in REFUSED.items():
        if c.get(key):
            raise CheckpointError(f"{cfg_path}: {what} is not supported")
    if c.get("bias", "none") != "none":
        raise CheckpointError(f"{cfg_path}: bias {c['bias']!r} is not supported (only 'none')")
    weights = os.path.join(adapter_dir, "adapter_model.safetensors")
    if not os.path.isfile(weights):
        raise CheckpointError(f"--adapter {adapter_dir}: no adapter_model.safetensors")
    from safetensors.torch import load_file

    try:
        tensors = load_file(weights)
    except Exception as e:
        raise CheckpointError(f"{weights}: not a readable safetensors file: {e}") from None
    pairs: dict = {}
    for key, t in tensors.items():
        if not (key.startswith(PREFIX) and (key.endswith(".lora_A.weight") or key.endswith(".lora_B.weight"))):
            raise CheckpointError(f"{weights}: tensor {key} is not a LoRA A or B weight")
        pairs.setdefault(_layer_name(key), {})[key.rsplit(".", 2)[-2][-1]] = t
    for name, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise CheckpointError(f"{weights}: {name} has lora_{next(iter(ab))} without its pair")
        if ab["A"].shape[0] != r or ab["B"].shape[1] != r:
            raise CheckpointError(f"{weights}: {name}'s adapters are not of rank r={r}")
    scaling = alpha / math.sqrt(r) if c.get("use_rslora") else alpha / r
    targets = c.get("target_modules") or []
    return Adapter(r, alpha, scaling, targets, {n: (ab["A"], ab["B"]) for n, ab in pairs.items()})


class AdaptedCheckpoint(Checkpoint):
    """A base checkpoint read with an adapter folded into each weight it adapts."""

    def __init__(self, model_dir: str, adapter_dir):
        """`adapter_dir`: a PEFT adapter folder, or an Adapter already in memory (a run's checkpoint)."""
        super().__init__(model_dir)
        if isinstance(adapter_dir, Adapter):
            self.adapter, self.adapter_dir = adapter_dir, "the run's adapters"
        else:
            self.adapter, self.adapter_dir = read_adapter(adapter_dir), str(adapter_dir)
        where = f"--adapter {self.adapter_dir}"
        self.fan_in_fan_out = self.config.arch == "gpt2"  # Conv1D: weights stored in x out
        shapes = expected_tensors(self.config)
        self.adapted = {}
        for layer, (a, b) in self.adapter.pairs.items():
            name = layer + ".weight"
            if name not in shapes:
                raise CheckpointError(f"{where} adapts {layer}, which {model_dir} does not have")
            out_in = (int(b.shape[0]), int(a.shape[1]))
            want = out_in[::-1] if self.fan_in_fan_out else out_in
            if tuple(shapes[name]) != want:
                raise CheckpointError(
                    f"{where}: {layer} adapters imply a {want[0]} x {want[1]} weight, the model's is "
                    f"{shapes[name][0]} x {shapes[name][1]} (an adapter for another model?)"
                )
            self.adapted[name] = (a, b)

    def delta(self, name: str):
        a, b = self.adapted[name]
        return delta(a, b, self.adapter.scaling, self.fan_in_fan_out)

    def read(self, name: str, rows=None, cols=None):
        t = super().read(name, rows, cols)
        if name not in self.adapted:
            return t
        d = self.delta(name)
        d = d[slice(*rows) if rows else slice(None), slice(*cols) if cols else slice(None)]
        return (t.float() + d).to(t.dtype)


def open_checkpoint(model_dir: str, adapter_dir: str | None = None) -> Checkpoint:
    """The base checkpoint, with the adapter applied as it is read when one is given."""
    if adapter_dir is None:
        return Checkpoint(model_dir)
    if not os.path.isdir(adapter_dir):
        raise CheckpointError(
            f"--adapter {adapter_dir}: not a folder (a PEFT adapter: adapter_config.json, adapter_model.safetensors)"
        )
    return AdaptedCheckpoint(model_dir, adapter_dir)
