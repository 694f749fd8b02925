"""How a checkpoint's layers and heads split over ranks, checked before any rank starts.

Torch-free, so a `generate` or `serve` controller that only checks the split does not pay
torch's second of start-up.
"""

from __future__ import annotations

from smoltrain.models.hf import CheckpointError

DTYPES = ("fp32", "bf16", "fp16")  # the compute dtypes a stage runs in (models.stage.TORCH)


def even_layers(layers: int, world: int) -> list[tuple[int, int]]:
    """`--placement even`: [first, last) per stage, the first stages one layer longer (3 over 2: 2,1)."""
    if world > layers:
        raise CheckpointError(f"{world} pipeline stages for {layers} layers: at most one stage per layer")
    base, extra = divmod(layers, world)
    out, at = [], 0
    for r in range(world):
        n = base + (1 if r < extra else 0)
        out.append((at, at + n))
        at += n
    return out


def check_tp(cfg, world: int) -> None:
    for what, n in (("attention heads", cfg.heads), ("kv heads", cfg.kv_heads), ("MLP width", cfg.ffn)):
        if n % world:
            raise CheckpointError(f"tp over {world} ranks: the model's {n} {what} do not split evenly")
