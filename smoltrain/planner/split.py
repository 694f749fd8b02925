"""How a model divides over ranks, as the plan counts it: bytes per element, layers per stage,
fsdp's units and padding, the parameters in experts, and which splits a workload admits
(validate: one line for a shape no strategy of that kind can run). The traffic models
(planner.traffic), capacity and timing read them; nothing here knows about links."""

from __future__ import annotations

import math

from smolnet.errors import UsageError
from smoltrain import registry
from smoltrain.models.spec import ModelSpec

MODES = ("train", "infer")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise UsageError(f"unknown dtype {dtype!r} (one of {', '.join(DTYPE_BYTES)})") from None


def split_layers(layers: int, world: int) -> list[int]:
    """Layers per stage: as even as possible, the first stages take the remainder."""
    base, extra = divmod(layers, world)
    return [base + (1 if r < extra else 0) for r in range(world)]


def padded(n: int, world: int) -> int:
    """FSDP's flat buffer is padded to a multiple of the world size."""
    return int(math.ceil(n / world) * world)


def expert_params(model: ModelSpec) -> int:
    """Parameters that live in experts (sharded by ep); the router stays replicated."""
    if model.experts == 1:
        return 0
    per = (3 if model.gated_mlp else 2) * model.hidden * model.ffn
    return model.layers * per * model.experts


def fsdp_units(model: ModelSpec) -> list[int]:
    """Parameters per fsdp unit: embeddings, each block, head (final norm + LM head).

    A tied LM head is the embedding matrix: it is one parameter, gathered and reduced once
    (with the embedding unit), so the head unit holds only the final norm then."""
    emb = model.vocab * model.hidden + (model.ctx * model.hidden if model.learned_pos else 0)
    head = model.norm_params() + (0 if model.tied_embeddings else model.vocab * model.hidden)
    return [emb] + [model.layer_params()] * model.layers + [head]


def validate(strategy: str, mode: str, model: ModelSpec, world: int, batch: int, seq: int, microbatches: int) -> None:
    info = registry.REGISTRY.get(strategy)
    if info is None:
        raise UsageError(f"unknown strategy {strategy!r} (one of {', '.join(registry.names())}, or all)")
    if mode not in MODES:
        raise UsageError(f"unknown mode {mode!r} (train or infer)")
    for what, v in (("world", world), ("batch", batch), ("seq", seq), ("microbatches", microbatches)):
        if not isinstance(v, int) or v < 1:
            raise UsageError(f"{what} must be a positive integer, got {v!r}")
    if info.splits == "layers" and world > model.layers:
        raise UsageError(
            f"{strategy} over {world} ranks needs at least {world} layers; {model.name} has {model.layers}"
        )
    if info.splits == "heads" and world > model.kv_heads:  # uneven splits are the placement's (planner.placement)
        raise UsageError(
            f"{strategy} over {world} ranks needs at least one KV head group per rank; "
            f"{model.name} has {model.heads} heads in {model.kv_heads} groups"
        )
    if info.splits == "experts":
        if model.experts < 2:
            raise UsageError(
                f"{strategy} needs a mixture-of-experts model; {model.name} is dense (try --model mixtral-8x7b)"
            )
        if model.experts % world:
            raise UsageError(
                f"{strategy} over {world} ranks needs experts divisible by the world; {model.name} has {model.experts}"
            )
    if info.splits == "sequence" and seq % world:
        raise UsageError(f"{strategy} over {world} ranks needs seq divisible by the world, got seq {seq}")
    if mode == "train" and info.microbatched and microbatches > batch:
        raise UsageError(f"{strategy} cannot cut batch {batch} into {microbatches} microbatches")
    if mode == "train" and seq > model.ctx:
        raise UsageError(f"seq {seq} is longer than {model.name}'s context ({model.ctx})")
