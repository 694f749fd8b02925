"""LoRA with PEFT's semantics and names, on any model whose linear layers carry Hugging Face names.

Each target layer W (out x in) gets `lora_A` (Linear in -> r, no bias, Kaiming-uniform with
a=sqrt(5), PEFT's default init) and `lora_B` (Linear r -> out, zeros, so training starts from the
base model), and computes W x + B(A(dropout(x))) * alpha/r. The adapters are child modules of the
layer they adapt, so their names are PEFT's saved names less the `base_model.model.` prefix
(`model.layers.0.self_attn.q_proj.lora_A.weight`), and the base model's own parameter names do
not change; the addition is a forward hook, so the layer itself (fp32, bf16 or quantised) runs as
before. Everything else is frozen: only adapters train, cross the wire and are checkpointed.

GPT-2's Conv1D layers store W as in x out (PEFT's `fan_in_fan_out`): A and B keep the same shapes,
and merging adds the transposed product. A is drawn from a generator seeded by (seed, layer name),
so every rank that builds a layer gets the same adapter whatever the strategy or world size.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass

from smolnet.errors import UsageError

DEFAULT_TARGETS = {"gpt2": ("c_attn",)}  # PEFT's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
ATTENTION = ("q_proj", "v_proj")  # llama, qwen2, qwen3 (and every other arch we train)


class LoraError(UsageError):
    """LoRA settings the model cannot take: a target it lacks, a rank larger than the layer (exit 2)."""


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] | None = None  # None: the architecture's attention projections

    def __post_init__(self):
        if self.rank < 1:
            raise LoraError(f"--lora-rank must be at least 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise LoraError(f"--lora-dropout must be in [0, 1), got {self.dropout}")
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise LoraError(f"--lora-alpha must be a positive number, got {self.alpha}")
        if self.targets is not None and (not self.targets or not all(t.strip() for t in self.targets)):
            raise LoraError(f"--lora-targets needs layer names like q_proj,v_proj, got {','.join(self.targets)!r}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def targets_for(self, arch: str) -> tuple[str, ...]:
        return tuple(self.targets) if self.targets else DEFAULT_TARGETS.get(arch, ATTENTION)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["targets"] = list(self.targets) if self.targets else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> LoraConfig:
        t = d.get("targets")
        return cls(int(d["rank"]), float(d["alpha"]), float(d["dropout"]), tuple(t) if t else None)


def parse_targets(text: str | None) -> tuple[str, ...] | None:
    """`--lora-targets q_proj,k_proj,v_proj` as a tuple (None: the default)."""
    if text is None:
        return None
    return tuple(t.strip() for t in text.split(","))


def linear_shape(module) -> tuple[int, int, bool] | None:
    """(in, out, fan_in_fan_out) of a linear layer, or None for anything else."""
    import torch

    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features, False
    w = getattr(module, "weight", None)
    if w is None and hasattr(module, "in_features") and hasattr(module, "out_features"):  # models.qlinear
        return int(module.in_features), int(module.out_features), bool(getattr(module, "fan_in_fan_out", False))
    if getattr(module, "fan_in_fan_out", False) or (hasattr(module, "nf") and w is not None):  # Conv1D
        return int(w.shape[0]), int(w.shape[1]), True
    if hasattr(module, "in_features") and hasattr(module, "out_features"):
        return int(module.in_features), int(module.out_features), False
    return None


def named_layers(model) -> list[tuple[str, object]]:
    """(Hugging Face name, module) of every module: the model's own map where it has one."""
    if hasattr(model, "hf_named_modules"):
        return list(model.hf_named_modules())
    return [(n, m) for n, m in model.named_modules() if n]


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)  # PEFT's rule for a list of targets


def _forward_hook(module, args, output):
    x = args[0]
    a = module.lora_A.weight
    return output + (module.lora_B(module.lora_A(module.lora_dropout(x.to(a.dtype)))) * module.lora_scaling).to(
        output.dtype
    )


def apply(model, cfg: LoraConfig, arch: str, seed: int) -> list[str]:
    """Freeze `model` and adapt its target layers in place; returns the adapted layers' names."""
    import torch

    targets = cfg.targets_for(arch)
    layers = named_layers(model)
    linear = {n: (m, linear_shape(m)) for n, m in layers}
    chosen = [n for n in linear if any(_matches(n, t) for t in targets)]
    for t in targets:
        hits = [n for n in chosen if _matches(n, t)]
        if not hits:
            names = sorted({n.rsplit(".", 1)[-1] for n, (_, s) in linear.items() if s is not None})
            raise LoraError(
                f"--lora-targets {t}: this {arch} model has no such layer (its linear layers: {', '.join(names)})"
            )
        bad = [n for n in hits if linear[n][1] is None]
        if bad:
            raise LoraError(f"--lora-targets {t}: {bad[0]} is not a linear layer")
    for name in chosen:  # every check before anything changes
        _, (fin, fout, _) = linear[name]
        if cfg.rank > min(fin, fout):
            raise LoraError(f"--lora-rank {cfg.rank} is larger than {name} ({fout} x {fin}): at most {min(fin, fout)}")
    for p in model.parameters():
        p.requires_grad_(False)
    for name in chosen:
        module, (fin, fout, fifo) = linear[name]
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        a = torch.empty(cfg.rank, fin)
        torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
        _attach(module, a, torch.zeros(fout, cfg.rank), cfg.dropout, cfg.scaling, fifo)
    return chosen


def _attach(module, a, b, dropout: float, scaling: float, fan_in_fan_out: bool) -> None:
    """lora_A (weights a, r x in) and lora_B (b, out x r) as children of `module`, added to its output."""
    import torch

    w = getattr(module, "weight", getattr(module, "q", None))  # models.qlinear holds `q`, no weight
    dev = w.device if w is not None else None
    module.lora_A = torch.nn.Linear(a.shape[1], a.shape[0], bias=False, device=dev)
    module.lora_B = torch.nn.Linear(b.shape[1], b.shape[0], bias=False, device=dev)
    with torch.no_grad():
        module.lora_A.weight.copy_(a)
        module.lora_B.weight.copy_(b)
    module.lora_dropout = torch.nn.Dropout(dropout) if dropout else torch.nn.Identity()
    module.lora_scaling = scaling
    module.lora_fan_in_fan_out = fan_in_fan_out
    module.lora_hook = module.register_forward_hook(_forward_hook)


def attach_like(dst, src, rows=None, cols=None) -> None:
    """Give `dst`, a tp slice of the adapted layer `src`, src's adapter cut the same way: lora_B's rows
    `rows` (a column-parallel layer's output features), lora_A's columns `cols` (a row-parallel layer's
    input features); a slice or an index tensor. The uncut factor's gradient is then a partial sum."""
    a, b = src.lora_A.weight.detach(), src.lora_B.weight.detach()
    a = a if cols is None else a[:, cols]
    b = b if rows is None else b[rows]
    p = src.lora_dropout.p if hasattr(src.lora_dropout, "p") else 0.0
    _attach(dst, a, b, p, src.lora_scaling, src.lora_fan_in_fan_out)


def adapted(model) -> list[tuple[str, object]]:
    return [(n, m) for n, m in named_layers(model) if hasattr(m, "lora_A")]


def adapter_state(model) -> dict:
    """The adapters by PEFT's saved key names less `base_model.model.`."""
    out = {}
    for name, m in adapted(model):
        out[f"{name}.lora_A.weight"] = m.lora_A.weight.detach()
        out[f"{name}.lora_B.weight"] = m.lora_B.weight.detach()
    return out


def delta(a, b, scaling: float, fan_in_fan_out: bool):
    """What merging adds to the base weight (in fp32): B @ A * scaling, transposed for Conv1D."""
    d = (b.float() @ a.float()) * scaling
    return d.t() if fan_in_fan_out else d


def merge(model) -> int:
    """Fold every adapter into its base weight and remove it (PEFT's merge_and_unload); returns how many."""
    import torch

    done = adapted(model)
    if any(getattr(m, "weight", None) is None for _, m in done):
        raise LoraError("a quantised base has no full-width weights to merge into: merge on its checkpoint")
    with torch.no_grad():
        for _, m in done:
            w = m.weight
            w.copy_(
                (w.float() + delta(m.lora_A.weight, m.lora_B.weight, m.lora_scaling, m.lora_fan_in_fan_out)).to(w.dtype)
            )
            m.lora_hook.remove()
            for k in ("lora_A", "lora_B", "lora_dropout"):
                delattr(m, k)
            for k in ("lora_scaling", "lora_fan_in_fan_out", "lora_hook"):
                delattr(m, k)
    return len(done)
