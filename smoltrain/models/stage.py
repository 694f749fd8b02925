"""A stage of a Hugging Face model: layers [first, last), the embedding on the first stage,
the final norm and LM head on the last; under tp, one rank's slice of every layer.

`Stage.forward` takes token ids (first stage) or the previous stage's hidden state for a
batch of rows, one sequence each, and returns the hidden state, or each row's last-position
logits on the last stage. Every sequence has a slot: its own KV cache in each block and
its own position, kept here; `open` starts a new sequence in a slot.

A row's result does not depend on the other rows in its batch (so a request batched with
others gets exactly the tokens it gets alone): attention runs row by row, and a decode
batch of fewer than MIN_ROWS rows is padded to MIN_ROWS, because the CPU's matrix
multiply takes another code path (another summation order) below 4 rows. Where nothing
is ever batched (`generate`: at most one sequence), `min_rows = 1` skips the padding
and its compute.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from smoltrain.models import gpt2, llama
from smoltrain.models.hf import Checkpoint, CheckpointError, expected_tensors

ARCH = {"llama": llama, "gpt2": gpt2}
TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MIN_ROWS = 4


@dataclass
class Rows:
    """The sequences of one forward: slot and first position per row (None: a padding row)."""

    slots: list
    pos: list
    cache: dict = field(default_factory=dict)

    def memo(self, key: str, make):
        """Something every block would compute the same (RoPE tables): once per forward."""
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]


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


def stage_tensors(cfg, first: int, last: int, is_first: bool, is_last: bool) -> set[str]:
    """Names of the tensors one stage reads (what a rank checks and loads)."""
    names = set()
    for name in expected_tensors(cfg):
        parts = name.split(".")
        if "layers" in parts or (parts[0] == "h" and len(parts) > 2):
            i = int(parts[parts.index("layers") + 1] if "layers" in parts else parts[1])
            if first <= i < last:
                names.add(name)
        elif name in ("model.embed_tokens.weight", "wte.weight"):
            if is_first or (is_last and cfg.tied):
                names.add(name)
        elif name == "wpe.weight":
            if is_first:
                names.add(name)
        elif is_last:
            names.add(name)
    return names


class Stage(torch.nn.Module):
    def __init__(
        self,
        ckpt: Checkpoint,
        first: int,
        last: int,
        is_first: bool,
        is_last: bool,
        tp_rank: int = 0,
        tp_world: int = 1,
        dtype: str | None = None,
    ):
        super().__init__()
        cfg = ckpt.config
        self.cfg, self.first, self.last, self.is_first, self.is_last = cfg, first, last, is_first, is_last
        self.dtype = TORCH[dtype or cfg.dtype]
        ckpt.check(stage_tensors(cfg, first, last, is_first, is_last))
        if tp_world > 1:
            check_tp(cfg, tp_world)
        mod = ARCH[cfg.arch]
        self.mod = mod
        self.blocks = [mod.load_block(ckpt, i, tp_rank, tp_world, self.dtype) for i in range(first, last)]
        self.ends = mod.load_ends(ckpt, is_first, is_last, self.dtype)
        self.pos: dict[int, int] = {}  # slot -> positions its sequence has so far
        self.min_rows = MIN_ROWS  # decode batches are padded to this many rows

    def open(self, slot: int, max_len: int) -> None:
        """Start a new sequence of at most max_len positions in this slot (its old one is dropped)."""
        for b in self.blocks:
            b.open(slot, max_len, self.dtype)
        self.pos[slot] = 0

    @torch.no_grad()
    def forward(self, x, slots: list[int], reduce=lambda t: t):
        """x: token ids [rows, T] on the first stage, else hidden [rows, T, hidden], row i continuing
        the sequence in slots[i]; returns hidden [rows, T, hidden] or logits [rows, vocab]."""
        n, T = x.shape[0], x.shape[1]
        pad = self.min_rows - n if T == 1 and n < self.min_rows else 0
        if pad:
            x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
        rows = Rows(list(slots) + [None] * pad, [self.pos[s] for s in slots] + [0] * pad)
        if pad:  # the padding rows' partial sums need not cross the wire
            full = reduce

            def reduce(t):
                return torch.cat([full(t[:n]), t[n:]])

        if self.is_first:
            positions = torch.tensor(rows.pos)[:, None] + torch.arange(T)[None, :]
            x = self.mod.embed(self.ends, x, positions)
        for b in self.blocks:
            x = b(x, rows, reduce)
        for s in slots:
            self.pos[s] += T
        if self.is_last:
            return F.linear(self.ends["norm"](x[:, -1:]), self.ends["head"]).view(x.shape[0], -1)[:n].float()
        return x[:n]
