"""What each rank holds and computes: parameters, FLOPs, memory traffic and memory footprint.

Footprint per rank = weights + gradients + optimizer state (Adam: two fp32 moments, plus an
fp32 master copy when training in 16-bit) + activations (Korthikanti et al. 2022: per layer
s*b*h*(34 + 5*heads*s/h) bytes at 16 bits, tp: s*b*h*(10 + 24/t + 5*heads*s/(h*t))) + logits
+ KV cache (inference). It is compared with each device's memory; 10% stays for the OS.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from smoltrain import registry
from smoltrain.models.spec import ModelSpec
from smoltrain.planner.split import dtype_bytes, expert_params, split_layers

ADAM_BYTES = 8  # two fp32 moments per owned parameter
MASTER_BYTES = 4  # fp32 master weights when training in bf16/fp16
OPT_TRAFFIC = 28  # Adam step: read p, g, m, v and write p, m, v (fp32)
HEADROOM = 0.9  # share of device memory a training process can count on
# strategies/parameter_server.py, in fp32: a worker keeps the received parameters and its flat
# gradient beside its model; the server (rank 0) a master copy, the AdamW moments, the gradient
# sum, one receive buffer reused for every member, and the update's sqrt(v) temporary
PS_WORKER_COPIES = 2
PS_SERVER_BUFFERS = 3


@dataclass
class RankWork:
    layers: int  # transformer layers this rank runs
    params_held: float  # parameters stored on this rank (at rest)
    params_owned: float  # parameters this rank keeps optimizer state for
    matmul_params: float  # parameters this rank multiplies per token it processes
    tokens: float  # tokens this rank processes per step (infer: per generated token)
    attn_share: float = 1.0  # share of attention heads (tp) this rank computes
    kv_positions: float = 0  # KV cache positions held (infer)
    gathered: float = 0.0  # transient copy of gathered parameters (fsdp: one unit at a time)
    logits: bool = True  # computes the LM head's logits (a pipeline's last stage only)
    recompute: bool = False  # reruns each unit's forward in backward (fsdp)
    saved_only: bool = False  # keeps only each unit's input activation (fsdp)
    in_flight: float = 0.0  # tokens whose activations are held at once (0: all of `tokens`)
    served: float = 0.0  # parameters this rank serves to workers (a parameter server's rank 0)
    wire_copies: int = 0  # flat fp32 copies of the parameters a worker keeps for the wire
    trainable: float | None = None  # LoRA: the adapters this rank trains beside its frozen base (None: all)
    quantized_base: str | None = None  # LoRA: the frozen base's format (int8, q4), QLoRA-style


@dataclass
class Memory:
    weights: float
    grads: float
    optimizer: float
    activations: float
    kv_cache: float
    buffers: float = 0.0  # communication buffers (a parameter server's sums and receive buffers)

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.kv_cache + self.buffers

    def to_dict(self) -> dict:
        d = {k: int(v) for k, v in asdict(self).items()}
        d["total"] = int(self.total)
        return d


def _emb_in(model: ModelSpec) -> int:
    return model.vocab * model.hidden + (model.ctx * model.hidden if model.learned_pos else 0)


def _head(model: ModelSpec) -> int:
    return model.vocab * model.hidden


def layout(
    strategy: str,
    mode: str,
    model: ModelSpec,
    world: int,
    batch: int,
    seq: int,
    microbatches: int = 1,
    placement: dict | None = None,
) -> list[RankWork]:
    """Per rank: what it stores, owns and computes, per step (train) or per token (infer),
    under the placement's uneven split when one is given (batch shares, layer cuts, heads)."""
    N, L, P = world, model.layers, model.params()
    lp = model.layer_params()
    # MoE: a token multiplies only its top_k experts, in training as in decode
    lp_active = lp if model.experts == 1 else (model.active_params() - model.embedding_params()) / L
    train = mode == "train"
    toks_all = batch * seq if train else 1
    kv = 0 if train else seq
    head = _head(model)
    full_matmul = L * lp_active + head
    info = registry.get(strategy)
    by_seq = info.splits == "sequence"
    if info.splits in ("batch", "sequence"):
        toks = toks_all / N if train else 1
        counts = _placed_counts(placement, "shares", batch, N) if train and info.splits == "batch" else None
        out = []
        fs = info.shards_params
        for r in range(N):
            if counts is not None:
                toks = counts[r] * seq
            owned = P / N if fs else (P if not info.parameter_server or r == 0 or not train else 0)
            held = P / N if fs else P
            ps = info.parameter_server and train
            out.append(
                RankWork(
                    L,
                    held,
                    owned,
                    full_matmul,
                    toks,
                    kv_positions=kv / N if by_seq else kv,
                    gathered=_largest_unit(model) if fs else 0.0,
                    recompute=fs and train,
                    saved_only=fs and train,
                    served=P if ps and r == 0 else 0.0,
                    wire_copies=PS_WORKER_COPIES if ps else 0,
                )
            )
            if by_seq and not train:
                out[-1].tokens = 1 / N  # each rank attends over its share; matmuls split by position
        return out
    if info.splits == "heads":
        return [heads_work(model, attn, mlp, mode, batch, seq) for attn, mlp in _head_fractions(placement, model, N)]
    if info.splits == "layers":
        counts = _placed_counts(placement, "layers", L, N) or split_layers(L, N)
        return [
            stage_work(model, r, N, nl, mode, batch, seq, microbatches, info.microbatched)
            for r, nl in enumerate(counts)
        ]
    if info.splits == "experts":
        ex = expert_params(model)
        held = P - ex + ex / N
        active = model.active_params() - model.embedding_params() + head
        if train:
            return [RankWork(L, held, held, active, toks_all / N) for _ in range(N)]
        # decode: rank 0 runs attention for the sequence; the experts' share is small
        return [RankWork(L, held, held, active, 1 if r == 0 else 0, kv_positions=kv if r == 0 else 0) for r in range(N)]
    raise ValueError(strategy)


def _active_layer_params(model: ModelSpec) -> float:
    """Parameters a token multiplies per layer (MoE: only its top_k experts)."""
    if model.experts == 1:
        return model.layer_params()
    return (model.active_params() - model.embedding_params()) / model.layers


def heads_work(model: ModelSpec, attn: float, mlp: float, mode: str, batch: int, seq: int) -> RankWork:
    """A tp rank computing `attn` of the heads and `mlp` of the MLP columns of every layer; the
    embeddings and the head are replicated (the model's own: no learned positions on a rotary
    model, a tied head once)."""
    L, train = model.layers, mode == "train"
    frac = (model.attn_params() * attn + model.mlp_params() * mlp) / (model.attn_params() + model.mlp_params())
    held = L * model.layer_params() * frac + model.embedding_params()
    mm = L * _active_layer_params(model) * frac + _head(model)
    return RankWork(L, held, held, mm, batch * seq if train else 1, attn, 0 if train else seq)


def stage_work(
    model: ModelSpec, r: int, N: int, nl: int, mode: str, batch: int, seq: int, microbatches: int, microbatched: bool
) -> RankWork:
    """Stage r of N holding `nl` layers: the first also the input embeddings, the last the
    final norm, the head and the logits."""
    train = mode == "train"
    toks_all = batch * seq if train else 1
    held = nl * model.layer_params()
    mm = nl * _active_layer_params(model)
    if r == 0:
        held += _emb_in(model)
    if r == N - 1:
        held += 2 * model.hidden + (_head(model) if (not model.tied_embeddings or N > 1) else 0)
        mm += _head(model)
    m = max(1, microbatches) if microbatched and train else 1
    # 1F1B: stage r holds at most min(m, N - r) microbatches' activations (<= p)
    live = toks_all / m * min(m, N - r) if m > 1 else 0.0
    return RankWork(nl, held, held, mm, toks_all, kv_positions=0 if train else seq, logits=r == N - 1, in_flight=live)


def _placed_counts(placement: dict | None, key: str, total: int, world: int) -> list[int] | None:
    """Sequences (key "shares") or layers ("layers") per rank under the placement; None: even."""
    if not placement or not placement.get(key):
        return None
    if key == "shares":
        from smoltrain.planner.placement import batch_ranges

        return [hi - lo for lo, hi in batch_ranges(total, placement["shares"], world)]
    counts = [hi - lo for lo, hi in placement[key]]
    if len(counts) != world or sum(counts) != total:
        raise ValueError(f"placement {key} {placement[key]} do not cover {total} over {world} ranks")
    return counts


def _head_fractions(placement: dict | None, model: ModelSpec, world: int) -> list[tuple[float, float]]:
    """(share of the heads, share of the MLP columns) per tp rank: the placement's, else 1/N."""
    heads = (placement or {}).get("heads")
    if not heads:
        return [(1 / world, 1 / world)] * world
    ffn = placement.get("ffn") or heads
    return [
        ((h1 - h0) / model.heads, (f1 - f0) / (model.ffn if placement.get("ffn") else model.heads))
        for (h0, h1), (f0, f1) in zip(heads, ffn)
    ]


def _largest_unit(model: ModelSpec) -> float:
    from smoltrain.planner.split import fsdp_units

    return max(fsdp_units(model))


def flops(w: RankWork, model: ModelSpec, mode: str, seq: int) -> float:
    """6 FLOPs per parameter per token in training (2 in decode), plus attention over seq;
    8 (and 16) where the forward is recomputed in backward (fsdp, checkpointing); under LoRA 4
    per frozen weight (the inputs' gradients only) and 6 per adapter weight."""
    attn = w.layers * model.hidden * seq * w.attn_share
    if mode == "train":
        k = 8 / 6 if w.recompute else 1.0
        if w.trainable is not None:  # LoRA: the frozen base has no weight gradients (4, 6 recomputed)
            return w.tokens * ((6 if w.recompute else 4) * w.matmul_params + 12 * k * attn + 6 * w.trainable)
        return w.tokens * k * (6 * w.matmul_params + 12 * attn)
    return w.tokens * 2 * w.matmul_params + 4 * attn * (w.kv_positions / seq if seq else 0)


def weight_bytes(w: RankWork, model: ModelSpec, a: int, quantize: str | None) -> tuple[float, float]:
    """Inference: (weight bytes one token reads, weight bytes held) on this rank. Quantised
    weights are the layers' matmuls and an untied LM head (models.quant); embeddings and
    norms stay at the compute dtype. Unquantised: every weight at `a` bytes."""
    if not quantize:
        return w.matmul_params * a, w.params_held * a + w.gathered * a
    from smoltrain.planner.widths import weight_bytes as per_weight

    q = per_weight(quantize, "fp32")
    head = model.vocab * model.hidden if w.logits else 0
    layers = w.matmul_params - head
    head_b = head * (a if model.tied_embeddings else q)
    rest = max(0.0, w.params_held - w.matmul_params)  # embeddings (a tied head is the table itself), norms
    return layers * q + head_b, layers * q + head_b + rest * a


def memory_traffic(
    w: RankWork, model: ModelSpec, mode: str, dtype: str, batch: int, seq: int, strategy: str, quantize=None
) -> float:
    """Bytes moved to and from memory per step: what a memory-bound rank waits for."""
    a = dtype_bytes(dtype)
    if mode == "train":
        weights = model.params() if w.gathered else w.params_held  # fsdp: every unit passes through
        every = replace(w, in_flight=0.0, saved_only=False)  # all tokens' activations pass through memory
        return weights * 3 * a + w.params_owned * OPT_TRAFFIC + 2 * _activations(every, model, a, seq, strategy)
    return weight_bytes(w, model, a, quantize)[0] + kv_bytes(w, model, a)


def kv_bytes(w: RankWork, model: ModelSpec, a: int) -> float:
    """Inference: the KV cache this rank holds for one sequence, which each decode step reads."""
    return 2 * w.layers * model.kv_dim * w.kv_positions * a * w.attn_share


def _activations(w: RankWork, model: ModelSpec, a: int, seq: int, strategy: str) -> float:
    h, heads = model.hidden, model.heads
    per_token = h * (34 + 5 * heads * seq / h)
    if registry.get(strategy).splits == "heads":
        t = 1 / w.attn_share
        per_token = h * (10 + 24 / t + 5 * heads * seq / (h * t))
    toks = w.in_flight or w.tokens
    logits = toks * model.vocab * 4 if w.logits else 0
    if w.saved_only:  # each unit's input is kept; one unit's full activations live at a time
        return w.tokens * (w.layers + 2) * h * a + w.tokens * per_token * a / 2 + logits
    return toks * w.layers * per_token * a / 2 + logits


def memory(w: RankWork, model: ModelSpec, mode: str, dtype: str, seq: int, strategy: str, quantize=None) -> Memory:
    a = dtype_bytes(dtype)
    kv = kv_bytes(w, model, a)
    if mode == "infer":
        return Memory(weight_bytes(w, model, a, quantize)[1], 0, 0, 0, kv)
    master = MASTER_BYTES if a < 4 and not w.served else 0  # a server's master copy is its weights
    if w.trainable is not None:  # LoRA: the frozen base (at `dtype` or quantised) and the adapters
        base = weight_bytes(w, model, a, w.quantized_base)[1] if w.quantized_base else w.params_held * a
        return Memory(
            weights=base + w.trainable * a,
            grads=w.trainable * a,
            optimizer=w.params_owned * (ADAM_BYTES + master),
            activations=_activations(w, model, a, seq, strategy),
            kv_cache=0,
        )
    # fsdp: the shard's gradient plus one gathered unit's full gradient before its reduce-scatter
    grads_full = w.params_held + w.gathered
    return Memory(
        weights=w.params_held * a + w.gathered * a + w.served * 4,
        grads=grads_full * a,
        optimizer=w.params_owned * (ADAM_BYTES + master),
        activations=_activations(w, model, a, seq, strategy),
        kv_cache=0,
        buffers=(w.wire_copies * w.params_held + PS_SERVER_BUFFERS * w.served) * 4,
    )


def frozen_grad_bytes(w: RankWork, model: ModelSpec) -> float:
    """Bytes a whole-model training step moves, whatever its batch, for the gradients of the
    weights LoRA freezes on this rank (w as tuning.work gives it): each frozen weight's fp32
    gradient written once by its weight-gradient product, and, where the rank computes the
    logits, the embedding's dense gradient zero-filled and (tied) summed with the head's: read
    both, write one. Calibration times a step that trains every weight, so its fixed cost
    holds these bytes; a LoRA rank does not move them. 0 under full training."""
    if w.trainable is None:
        return 0.0
    emb = model.vocab * model.hidden if w.logits else 0
    return 4.0 * (max(0.0, w.params_held - w.trainable) + emb * (4 if model.tied_embeddings else 1))


def fixed_share(w: RankWork, model: ModelSpec, strategy: str) -> float:
    """Share of a whole-model step's fixed cost (per-operation overhead, optimizer loop) a
    rank pays: a pipeline stage runs its layers' operations only, every other rank all of
    them (tp narrower, dp/fsdp on fewer tokens, but as many operations)."""
    if registry.get(strategy).splits == "layers":
        return (w.layers + (1 if w.matmul_params > w.layers * model.layer_params() else 0)) / (model.layers + 1)
    return 1.0


def server_seconds(model: ModelSpec, world: int, mem_bw: float) -> float:
    """syncps/edp: the server sums `world` fp32 gradients (read each, read-modify-write the
    sum) and runs AdamW on the whole model, between the last push and the first pull, so
    the step waits for it: memory-bound, (2 * world * 4 + 28) bytes per parameter."""
    return model.params() * (8 * world + OPT_TRAFFIC) / mem_bw
