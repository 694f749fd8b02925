"""Bytes per link of a mesh (smoltrain.mesh): each axis's 1-D traffic over each of its groups.

A mesh's traffic is the sum, over its axes, of that axis's strategy run on each of its
groups, with what that group carries:
- tp along a tp group: the all-reduces of its replica's batch through the layers its stage
  holds (all layers without pp);
- pp along a pp group: the activations and their gradients of its replica's batch, the same on
  every tp rank of a stage (each sends its own copy);
- dp along a dp group: one all-reduce of the gradients of what each of its ranks holds (a
  stage's units, cut by tp: blocks' matrices by their heads and MLP columns, norms and
  embeddings whole);
- diloco along a diloco group: every H steps one ring all-reduce of the pseudo-gradient of what
  each rank holds, at the sync dtype (planner.diloco.outer_traffic), amortised over H.
Group-local ranks map to world ranks, so the result is one table keyed by world (src, dst), as
the transport counts them. fsdp x tp and the Hugging Face architectures are not planned yet.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from smolnet.errors import UsageError
from smoltrain.planner.placement import counts_from_shares, even_counts
from smoltrain.planner.split import dtype_bytes
from smoltrain.planner.traffic import Traffic, all_reduce, traffic
from smoltrain.planner.tuning import Tuning


def _tp_block_params(spec, t: int, T: int) -> int:
    """Parameters tp rank t of T holds of one built-in block: its heads' q, k, v and out, its MLP
    columns, and both norms whole (the split strategies.tp makes: whole KV groups, even)."""
    g = spec.heads // spec.kv_heads
    kv = even_counts(spec.kv_heads, T)
    ffn = counts_from_shares(spec.ffn, [n * g for n in kv])[t]
    q, k = kv[t] * g * spec.head_dim, kv[t] * spec.head_dim
    mats = 2 * spec.hidden * q + 2 * spec.hidden * k + (3 if spec.gated_mlp else 2) * spec.hidden * ffn
    return mats + 2 * spec.norm_params()


def held_params(spec, coords: dict, layers: int | None = None) -> int:
    """Trainable parameters one rank holds at mesh coordinates {axis: (index, size)}, its stage
    `layers` long (None: the even cut's)."""
    s, P = coords.get("pp", (0, 1))
    t, T = coords.get("tp", (0, 1))
    layers = even_counts(spec.layers, P)[s] if layers is None else layers
    block = _tp_block_params(spec, t, T) if T > 1 else spec.layer_params()
    emb = spec.vocab * spec.hidden + (spec.ctx * spec.hidden if spec.learned_pos else 0)
    head = spec.norm_params() + (0 if spec.tied_embeddings else spec.vocab * spec.hidden)
    return layers * block + (emb if s == 0 else 0) + (head if s == P - 1 else 0)


def adapter_params(tuning, spec, coords: dict, layers: int) -> float:
    """LoRA: the adapter elements a rank at mesh coordinates {axis: (index, size)} trains (its
    stage `layers` long): its blocks' adapters cut by its tp share of the heads (the uncut factor
    whole), and the head's on the last stage; as planner.tuning.Tuning.work counts them."""
    s, P = coords.get("pp", (0, 1))
    t, T = coords.get("tp", (0, 1))
    share = even_counts(spec.kv_heads, T)[t] / spec.kv_heads
    blocks = sum(a.held(share) for a in tuning.adapters if 1 <= a.unit <= spec.layers) * layers / spec.layers
    return blocks + (sum(a.params for a in tuning.adapters if a.unit > spec.layers) if s == P - 1 else 0)


@dataclass(frozen=True)
class StageTuning(Tuning):
    """LoRA in one pp stage's tp group: the stage's adapters, numbered as a model of its own; when
    an earlier stage trains adapters, this stage's input needs its gradient (pp sends it back),
    so every one of its backward all-reduces runs."""

    input_grad: bool = False

    def backward_enters(self, layers: int) -> int:
        return 2 * layers if self.input_grad else super().backward_enters(layers)


def stage_tuning(tuning, first: int, layers: int, total: int) -> StageTuning:
    """`tuning` cut to the stage of `layers` blocks from block `first` (of `total`); the head's
    adapters on the last stage."""
    last = first + layers == total
    kept = [
        replace(a, unit=a.unit - first, pos=a.pos - 2 * first)
        for a in tuning.adapters
        if first < a.unit <= first + layers or (last and a.unit > total)
    ]
    earlier = any(a.unit <= first for a in tuning.adapters)
    return StageTuning(tuning.lora, tuple(kept), tuning.quantize, tuning.checkpoint_activations, earlier)


def axis_traffic(
    mesh,
    spec,
    batch: int,
    seq: int,
    microbatches: int = 1,
    dtype: str = "fp32",
    inner_steps=None,
    sync_dtype="fp32",
    tuning=None,
) -> list:
    """[(axis, world ranks of the group in group order, that group's 1-D Traffic)] of a mesh run's
    step: what mesh_link_bytes adds up and planner.mesh_plan times, group by group. A diloco
    axis needs its `inner_steps` H and `sync_dtype`: its outer all-reduce, amortised over H.
    `tuning` (planner.tuning) under LoRA: the data axes move the adapters' gradients alone, tp
    and pp what their 1-D traffic under LoRA sends; a Hugging Face model is planned so."""
    model, data, inner = mesh.roles()
    lora = tuning is not None and tuning.lora
    if model == "fsdp" or ((spec.arch or "gpt") != "gpt" and not lora):
        raise UsageError(
            f"plan --mesh {mesh.text()}: planned today for the built-in models' dp, pp and tp axes"
            " (a Hugging Face model's under LoRA, --lora-rank)"
        )
    if data == "diloco" and not inner_steps:
        raise UsageError(f"plan --mesh {mesh.text()}: a diloco axis is planned only with its inner steps H (a run's)")
    out = []

    def place(rank: int) -> dict:
        return {a: (c, n) for (a, n), c in zip(mesh.axes, mesh.coords(rank))}

    def replica_batch(rank: int) -> int:
        if not data:
            return batch
        return mesh.replica_rows(batch)[place(rank)[data][0]]

    def held(rank: int) -> int:
        return held_params(spec, place(rank), mesh.stage_layers(spec.layers)[place(rank).get("pp", (0, 1))[0]])

    def trained(rank: int) -> float:  # what a data axis synchronises: the adapters under LoRA
        if not lora:
            return held(rank)
        pl = place(rank)
        return adapter_params(tuning, spec, pl, mesh.stage_layers(spec.layers)[pl.get("pp", (0, 1))[0]])

    for axis in (model, inner):
        if axis is None or mesh.size(axis) == 1:
            continue
        for g in mesh.groups(axis):
            b, stage, tuned = replica_batch(g[0]), spec, tuning
            if axis == "tp" and "pp" in mesh.names:  # tp inside a stage: only that stage's layers
                s, P = place(g[0])["pp"]
                cut = mesh.stage_layers(spec.layers)
                stage = replace(spec, layers=cut[s])
                tuned = stage_tuning(tuning, sum(cut[:s]), cut[s], spec.layers) if lora else tuning
            # every microbatch crosses a stage's layers on its own, tp's all-reduces with it
            m = microbatches if axis == "pp" or mesh.size("pp") > 1 else 1
            out.append((axis, g, traffic(axis, "train", stage, len(g), dtype, b, seq, m, tuning=tuned)))
    if data and mesh.size(data) > 1:
        for g in mesh.groups(data):
            if data == "diloco":  # the pseudo-gradient's ring all-reduce every H steps (planner.diloco)
                from smoltrain.planner.diloco import outer_traffic

                tr = outer_traffic(trained(g[0]), sync_dtype, len(g))
                for t in (t for ph in tr.phases for t in ph.transfers):
                    t.nbytes /= inner_steps
                out.append((data, g, tr))
                continue
            nbytes = trained(g[0]) * dtype_bytes(dtype)
            out.append((data, g, Traffic("dp", "train", len(g), all_reduce(len(g), nbytes, "all-reduce gradients"))))
    return out


def mesh_link_bytes(mesh, spec, batch: int, seq: int, microbatches: int = 1, dtype: str = "fp32", **outer) -> dict:
    """{(world src, world dst): payload bytes per optimizer step} of a mesh run (`outer`: a diloco
    axis's inner_steps and sync_dtype, as axis_traffic takes them)."""
    out: dict[tuple[int, int], float] = {}
    for _, group, tr in axis_traffic(mesh, spec, batch, seq, microbatches, dtype, **outer):
        for (src, dst), b in tr.link_bytes().items():
            key = (group[src], group[dst])
            out[key] = out.get(key, 0.0) + b
    return out


def mesh_decode_bytes(mesh, spec, dtype: str = "fp32", wire: str | None = None, rows: int = 1) -> dict:
    """{(world src, world dst): payload bytes per decode step} of `generate --mesh pp=P,tp=T`
    (infer.meshed): pp's chain between the stages' doors (their tp rank 0), each stage's tp
    header broadcast and all-reduces over its layers, and what a door hands its tp peers along
    the same chain: each row's last token (stage 0) or hidden state (the later stages)."""
    from smoltrain.planner.traffic import TOKEN_ID_BYTES
    from smoltrain.planner.widths import wire_bytes

    P, T = mesh.size("pp"), mesh.size("tp")
    out: dict[tuple[int, int], float] = {}

    def add(group: list[int], link: tuple[int, int], nbytes: float) -> None:
        key = (group[link[0]], group[link[1]])
        out[key] = out.get(key, 0.0) + nbytes

    def coord(rank: int, axis: str) -> int:
        return mesh.coords(rank)[mesh.names.index(axis)]

    doors = next(g for g in mesh.groups("pp") if coord(g[0], "tp") == 0)
    for link, b in traffic("pp", "infer", spec, P, dtype, 1, 1, wire=wire, rows=rows).link_bytes().items():
        add(doors, link, b)
    for g in mesh.groups("tp"):
        s = coord(g[0], "pp")
        stage = replace(spec, layers=even_counts(spec.layers, P)[s])
        for link, b in traffic("tp", "infer", stage, T, dtype, 1, 1, wire=wire, rows=rows).link_bytes().items():
            add(g, link, b)
        handed = rows * (TOKEN_ID_BYTES if s == 0 else wire_bytes(spec.hidden, wire or dtype))
        for i in range(T - 1):
            add(g, (i, i + 1), handed)
    return out
