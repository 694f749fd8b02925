"""Bytes each strategy puts on each directed link, per step (train) or per token (infer).

Counting follows CONTRACT.md §4: tensor payload only; ring all-reduce sends 2(N-1)/N of the
buffer from each rank to its ring successor, reduce-scatter and all-gather (N-1)/N each. The
result is a list of phases (transfers that run at the same time, repeated serially) so the
timing model can charge latency per message and bandwidth per byte on the right links.

Layouts on real links: ring neighbours (rank r sends to r+1 mod N) for dp, fsdp, tp and sp;
a star around rank 0 for syncps and edp (rank 0 is the server and also a worker, so it
exchanges with ranks 1..N-1); stage boundaries r -> r+1 for pp and mp (gradients r+1 -> r);
all pairs for ep.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from smolnet.errors import UsageError
from smoltrain import registry
from smoltrain.comm.layout import SMALL_BYTES
from smoltrain.models.spec import ModelSpec
from smoltrain.planner.split import dtype_bytes, expert_params, fsdp_units, padded, validate

STRATEGIES = registry.names()
BUCKET_BYTES = 1e6  # smoltrain's dp bucket size (bucket_mb=1.0)
TOKEN_ID_BYTES = 8  # the sampled token id returns to stage 0 as one int64
STEP_HEADER_BYTES = 32  # each decode step starts with rank 0's header: 4 int64 (smoltrain/infer/batching.py)
HOP_MESSAGES = 2  # a pp decode hop: the step's header, then the hidden states, each a message (infer/pp.py)
LSE_BYTES = 4  # ring-attention decode carries one fp32 log-sum-exp per head


@dataclass
class Transfer:
    src: int
    dst: int
    nbytes: float  # per repetition
    msgs: int = 1  # messages per repetition (latency is paid per message)


@dataclass
class Phase:
    """Transfers that run concurrently; `repeat` serial rounds of them per step."""

    what: str
    transfers: list[Transfer]
    repeat: int = 1
    overlap_backward: bool = False  # dp buckets may hide behind the backward pass
    buckets: int = 1  # gradient buckets the rounds are grouped in
    serial: bool = False  # each transfer waits for the one before (a decode ring)
    after_compute: bool = False  # each transfer leaves when its own sender finishes computing


@dataclass
class Traffic:
    strategy: str
    mode: str
    world: int
    phases: list[Phase] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def link_bytes(self) -> dict[tuple[int, int], float]:
        out: dict[tuple[int, int], float] = {}
        for ph in self.phases:
            for t in ph.transfers:
                out[(t.src, t.dst)] = out.get((t.src, t.dst), 0.0) + t.nbytes * ph.repeat
        return out

    def link_msgs(self) -> dict[tuple[int, int], int]:
        out: dict[tuple[int, int], int] = {}
        for ph in self.phases:
            for t in ph.transfers:
                out[(t.src, t.dst)] = out.get((t.src, t.dst), 0) + t.msgs * ph.repeat
        return out

    def rank_bytes(self) -> list[float]:
        sent = [0.0] * self.world
        for (src, _), b in self.link_bytes().items():
            sent[src] += b
        return sent


def bucketed_all_reduce(world: int, nbytes: float, what: str, bucket: float = BUCKET_BYTES) -> list[Phase]:
    """Gradients all-reduced in ~1 MB buckets (as smoltrain's dp) that overlap the backward pass."""
    if world < 2 or nbytes <= 0:
        return []
    n = max(1, math.ceil(nbytes / bucket))
    phases = all_reduce(world, nbytes / n, what, overlap=True, times=n)
    phases[0].buckets = n
    return phases


def _ring(world: int, nbytes_per_rank: float, repeat: int, what: str, overlap: bool = False) -> Phase:
    return Phase(what, [Transfer(r, (r + 1) % world, nbytes_per_rank) for r in range(world)], repeat, overlap)


def all_reduce(world: int, nbytes: float, what: str, overlap: bool = False, times: int = 1) -> list[Phase]:
    """`times` ring all-reduces of `nbytes`: 2(N-1) rounds each, each rank sends a 1/N chunk per
    round; two ranks and a small buffer swap it whole in one round (the transport's comm.ring, same
    bytes: a tp pair's activations, which the plan had charged the ring's two rounds, 33 latencies
    a cores-sim decode token for the 17 messages each rank sent)."""
    if world < 2:
        return []
    if world == 2 and nbytes <= SMALL_BYTES:
        return [_ring(world, nbytes, times, what, overlap)]
    return [_ring(world, nbytes / world, 2 * (world - 1) * times, what, overlap)]


def gather_or_scatter(world: int, nbytes: float, what: str) -> list[Phase]:
    """Ring all-gather or reduce-scatter of a full buffer of `nbytes`: N-1 rounds."""
    if world < 2:
        return []
    return [_ring(world, nbytes / world, world - 1, what)]


@dataclass(frozen=True)
class Step:
    """What a traffic model reads: the strategy's traits and the shape of one step."""

    info: registry.StrategyInfo
    model: ModelSpec
    world: int
    a: int  # bytes per element
    batch: int
    seq: int
    microbatches: int
    act: float = 0.0  # bytes of one token's hidden state on the wire (infer; planner.widths)
    wire: str = "fp32"
    rows: int = 1  # infer: sequences a decode message carries (serve batches them; planner.serve)
    tuning: object = None  # planner.tuning.Tuning (train): under LoRA only the adapters' gradients move

    @property
    def lora(self) -> bool:
        return bool(self.tuning is not None and self.tuning.lora)

    @property
    def grads(self) -> int:
        """Gradient elements a replica synchronises: every parameter, or the adapters."""
        return self.tuning.trainable(self.model) if self.tuning is not None else self.model.params()


# --- train: one optimizer step ---
def ring_allreduce_train(tr: Traffic, s: Step) -> None:
    tr.phases += bucketed_all_reduce(s.world, s.grads * s.a, "all-reduce gradients")


def sharded_gather_train(tr: Traffic, s: Step) -> None:
    N, P = s.world, s.model.params()
    units = fsdp_units(s.model)
    pad = sum(padded(u, N) for u in units)
    for what in ("all-gather parameters (forward)", "all-gather parameters (backward)", "reduce-scatter gradients"):
        for u in units:
            tr.phases += gather_or_scatter(N, padded(u, N) * s.a, what)
    if pad != P:
        tr.notes.append(f"each unit's flat buffer is padded to a multiple of {N}: {pad} elements instead of {P}")


def parameter_server_train(tr: Traffic, s: Step) -> None:
    N, nbytes = s.world, s.model.params() * s.a
    if N > 1:
        tr.phases.append(
            Phase("workers push gradients", [Transfer(r, 0, nbytes) for r in range(1, N)], after_compute=True)
        )
        tr.phases.append(Phase("server returns parameters", [Transfer(0, r, nbytes) for r in range(1, N)]))
    tr.notes.append("rank 0 is the parameter server and also a worker; it exchanges with ranks 1..N-1")
    if s.info.joiners:
        tr.notes.append(
            f"{s.info.name}: bytes per step as syncps; workers do not wait for each other, and a "
            "joiner also pulls the parameters and optimizer state (~3x params) once"
        )


def layer_chain_train(tr: Traffic, s: Step) -> None:
    N, h, model = s.world, s.model.hidden, s.model
    m = s.microbatches if s.info.microbatched else 1
    mb = s.batch * s.seq * h * s.a / m
    fwd = [Transfer(r, r + 1, mb) for r in range(N - 1)]
    bwd = [Transfer(r + 1, r, mb) for r in range(N - 1)]
    if fwd:
        tr.phases.append(Phase("activations forward", fwd, m))
        tr.phases.append(Phase("activation gradients backward", bwd, m))
    if model.tied_embeddings and N > 1 and not s.lora:  # LoRA: the embedding is frozen
        E = model.vocab * h * s.a
        tr.phases.append(
            Phase("tied embedding gradient sync (first <-> last stage)", [Transfer(0, N - 1, E), Transfer(N - 1, 0, E)])
        )
        tr.notes.append(
            "tied embeddings: the first and last stages both hold the embedding "
            "and all-reduce its gradient once per step"
        )


def tensor_allreduce_train(tr: Traffic, s: Step) -> None:
    # Megatron: 2 all-reduces of b*s*h forward per layer and 2 backward, per microbatch; under
    # LoRA no backward one before the first adapter (planner.tuning.backward_enters)
    N, m, L = s.world, s.microbatches, s.model.layers
    bwd = s.tuning.backward_enters(L) if s.tuning is not None else 2 * L
    bwd += s.tuning.recompute_leaves(L) if s.tuning is not None else 0  # --checkpoint-activations' reruns
    if N > 1:
        what = "2 fwd + 2 bwd per layer" if bwd == 2 * L else f"2 fwd per layer, {bwd} bwd"
        nbytes = s.batch * s.seq * s.model.hidden * s.a / m
        tr.phases += all_reduce(N, nbytes, f"all-reduce activations ({what})", times=(2 * L + bwd) * m)
    if N > 1 and s.lora:  # the uncut factor of each adapter (A column-, B row-parallel) holds partial sums
        if s.tuning.partial():
            tr.phases += all_reduce(N, s.tuning.partial() * s.a, "all-reduce the uncut LoRA factors' gradients")
    elif N > 1 and s.model.qk_norm:  # qwen3: every rank's heads share the q/k norm weights
        tr.phases += all_reduce(N, 2 * s.model.layers * s.model.head_dim * s.a, "all-reduce q/k norm gradients")
    tr.notes.append("embeddings and LM head replicated: nothing else crosses the links")


def expert_all_to_all_train(tr: Traffic, s: Step) -> None:
    N, model = s.world, s.model
    dense = model.params() - expert_params(model)
    tr.phases += bucketed_all_reduce(N, dense * s.a, "all-reduce non-expert gradients")
    per_pair = s.batch * s.seq / N * model.top_k * model.hidden * s.a / N
    pairs = [Transfer(r, j, per_pair) for r in range(N) for j in range(N) if r != j]
    if pairs:
        tr.phases.append(Phase("all-to-all dispatch/combine (2 fwd + 2 bwd per layer)", pairs, 4 * model.layers))
    tr.notes.append(f"{s.info.name} assumes uniform routing with capacity factor 1; the busiest expert sets the time")


def ring_attention_train(tr: Traffic, s: Step) -> None:
    N, model = s.world, s.model
    kv = 2 * s.batch * (s.seq // N) * model.kv_dim * s.a
    if N > 1:
        tr.phases.append(_ring(N, kv, 3 * (N - 1) * model.layers, "ring attention K,V (fwd) and K,V,dK,dV (bwd)"))
    tr.phases += bucketed_all_reduce(N, model.params() * s.a, "all-reduce gradients")


def outer_allreduce_train(tr: Traffic, s: Step) -> None:
    tr.notes.append(f"{s.info.name}: nothing crosses per inner step; planner.diloco plans the outer all-reduce")


# --- infer: one generated token, batch 1, KV cache over `seq` positions ---
def replicated_infer(tr: Traffic, s: Step) -> None:
    tr.notes.append("inference: every rank serves its own request stream; nothing crosses the links")


def sharded_gather_infer(tr: Traffic, s: Step) -> None:
    tr.phases += gather_or_scatter(s.world, padded(s.model.params(), s.world) * s.a, "all-gather parameters per token")


def layer_chain_infer(tr: Traffic, s: Step) -> None:
    N = s.world
    hop = s.rows * s.act + STEP_HEADER_BYTES
    tr.phases += [
        Phase(f"hidden state stage {r} -> {r + 1}", [Transfer(r, r + 1, hop, HOP_MESSAGES)]) for r in range(N - 1)
    ]
    if N > 1:
        tr.notes.append(f"each hop also carries the step's {STEP_HEADER_BYTES}-byte header, a message of its own")
        tr.phases.append(Phase("sampled token id back to stage 0", [Transfer(N - 1, 0, s.rows * TOKEN_ID_BYTES)]))
        tr.notes.append("the last stage returns the sampled token id to stage 0 as one int64 (8 bytes)")


def tensor_allreduce_infer(tr: Traffic, s: Step) -> None:
    N = s.world
    if N > 1:
        chain = [Transfer(r, r + 1, STEP_HEADER_BYTES) for r in range(N - 1)]
        tr.phases.append(Phase("step header from rank 0 (broadcast)", chain, serial=True))
    if N > 1 and s.wire == "int8":  # int8 cannot be summed on the wire: all-gather, add up locally
        tr.phases.append(
            _ring(
                N,
                s.rows * s.act,
                2 * s.model.layers * (N - 1),
                "all-gather int8 hidden state (2 per layer), summed locally",
            )
        )
    elif N > 1:
        tr.phases += all_reduce(N, s.rows * s.act, "all-reduce hidden state (2 per layer)", times=2 * s.model.layers)


def expert_all_to_all_infer(tr: Traffic, s: Step) -> None:
    N, L = s.world, s.model.layers
    share = s.model.top_k * s.model.hidden * s.a / N
    if N > 1:
        tr.phases.append(Phase("dispatch token to experts", [Transfer(0, j, share) for j in range(1, N)], L))
        tr.phases.append(Phase("combine expert outputs", [Transfer(j, 0, share) for j in range(1, N)], L))
    tr.notes.append(f"{s.info.name} decode: rank 0 runs attention for the sequence; experts answer it")


def ring_attention_infer(tr: Traffic, s: Step) -> None:
    N, model = s.world, s.model
    if N > 1:
        tr.phases.append(
            Phase(
                "ring-attention decode: q and partial (out, lse) around the ring",
                [Transfer(r, (r + 1) % N, 2 * model.hidden * s.a + model.heads * LSE_BYTES) for r in range(N)],
                model.layers,
                serial=True,
            )
        )
        tr.notes.append(
            f"{s.info.name} decode: the KV cache is split by position; q and the running "
            "(out, lse) go once around the ring per layer"
        )


class TrafficModel(NamedTuple):
    train: Callable[[Traffic, Step], None]
    infer: Callable[[Traffic, Step], None]


# A strategy names its model in the registry (StrategyInfo.traffic); the planner looks it up here.
MODELS: dict[str, TrafficModel] = {
    "ring_allreduce": TrafficModel(ring_allreduce_train, replicated_infer),
    "sharded_gather": TrafficModel(sharded_gather_train, sharded_gather_infer),
    "parameter_server": TrafficModel(parameter_server_train, replicated_infer),
    "layer_chain": TrafficModel(layer_chain_train, layer_chain_infer),
    "tensor_allreduce": TrafficModel(tensor_allreduce_train, tensor_allreduce_infer),
    "expert_all_to_all": TrafficModel(expert_all_to_all_train, expert_all_to_all_infer),
    "ring_attention": TrafficModel(ring_attention_train, ring_attention_infer),
    "outer_allreduce": TrafficModel(outer_allreduce_train, replicated_infer),  # diloco: planner.diloco
}


def model_for(info: registry.StrategyInfo, mode: str) -> Callable[[Traffic, Step], None]:
    """The function that counts this strategy's bytes in `mode` (a replica decodes alone)."""
    tm = MODELS.get(info.traffic)
    if tm is None:
        raise UsageError(f"{info.name}: no traffic model {info.traffic!r} (one of {', '.join(MODELS)})")
    if mode == "infer":
        return replicated_infer if info.replicated_infer else tm.infer
    return tm.train


def traffic(
    strategy: str,
    mode: str,
    model: ModelSpec,
    world: int,
    dtype: str = "fp32",
    batch: int = 8,
    seq: int = 64,
    microbatches: int = 1,
    wire: str | None = None,
    rows: int = 1,
    tuning=None,
) -> Traffic:
    """Every byte the strategy sends per step (train) or per generated token (infer); `wire`:
    the dtype inference hidden states cross the links at (default `dtype`); `rows`: the
    sequences one decode step carries (pp, tp; a served batch); `tuning`: what trains
    (planner.tuning; None: every parameter)."""
    from smoltrain.planner.widths import wire_bytes

    validate(strategy, mode, model, world, batch, seq, microbatches)
    if tuning is not None and mode == "train":
        tuning.check(strategy)
    else:
        tuning = None
    info = registry.get(strategy)
    tr = Traffic(strategy, mode, world)
    wire = wire or dtype
    act = wire_bytes(model.hidden, wire)
    step = Step(info, model, world, dtype_bytes(dtype), batch, seq, microbatches, act, wire, rows, tuning)
    model_for(info, mode)(tr, step)
    return tr


def bytes_per_token(tr: Traffic, batch: int, seq: int) -> float:
    """What the busiest rank sends per token (contract §4)."""
    busiest = max(tr.rank_bytes()) if tr.world else 0.0
    return busiest if tr.mode == "infer" else busiest / (batch * seq)
