"""A stage of a Hugging Face model: layers [first, last), the embedding on the first stage,
the final norm and LM head on the last; under tp, one rank's slice of every layer.

The units are the trainer's own (models.causal.load_block/load_ends: the same blocks, read
by the same checkpoint names, only this stage's layers and this rank's windows); each block
is then packed into its decode view (DECODE: fused and optionally quantised matrices, KV
caches), one layer at a time, so no more than one layer is ever held at full width.

`Stage.forward` takes token ids (first stage) or the previous stage's hidden state for a
batch of rows, one sequence each, and returns the hidden state, or each row's last-position
logits on the last stage. Every sequence has a slot: its own KV cache in each block and
its own position, kept here; `open` starts a new sequence in a slot.

A row's result does not depend on the other rows in its batch (so a request batched with
others gets exactly the tokens it gets alone): attention runs row by row, and a decode
batch of fewer than MIN_ROWS rows is padded to MIN_ROWS, because the CPU's matrix
multiply takes another code path (another summation order) for fewer rows: below 2 rows
for oneDNN's fp32 product, below 4 for MKL's (a tied head). Where nothing is ever
batched (`batched=False`: `generate`, one sequence at a time) nothing is padded, and the
fp32 layers are held for the one-row product (models.quant: numpy's BLAS, 1.3x oneDNN
on a whole decode step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from smoltrain.models import causal, gpt2, llama
from smoltrain.models.hf import Checkpoint, expected_tensors
from smoltrain.models.quant import Linear
from smoltrain.models.split import check_tp

DECODE = {"llama": llama.LlamaDecode, "gpt2": gpt2.GPT2Decode}  # a block's decode view, by HFConfig.family
TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MIN_ROWS = 4


@dataclass
class Rows:
    """The sequences of one forward: slot and first position per row (None: a padding row)."""

    slots: list
    pos: list
    cache: dict = field(default_factory=dict)


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
        quantize: str | None = None,
        device: str = "cpu",
        batched: bool = True,
    ):
        """`quantize` (int8, q4): the matmul weights of these layers (and an untied head), each
        quantised as it is read; `device`: where the weights and the KV cache live; `batched`
        False: one sequence at a time (decode steps of one row)."""
        super().__init__()
        cfg = ckpt.config
        self.cfg, self.first, self.last, self.is_first, self.is_last = cfg, first, last, is_first, is_last
        self.dtype = TORCH[dtype or cfg.dtype]
        self.quantize, self.device = quantize, torch.device(device)
        ckpt.check(stage_tensors(cfg, first, last, is_first, is_last))
        if tp_world > 1:
            check_tp(cfg, tp_world)
        view, one = DECODE[cfg.family], not batched
        self.blocks = [
            view(causal.load_block(ckpt, i, tp_rank, tp_world, self.dtype, self.device), quantize, one, release=True)
            for i in range(first, last)
        ]
        self.embed, head = causal.load_ends(ckpt, is_first, is_last, self.dtype, self.device)
        self.norm = self.head = None
        if head is not None:  # an untied head quantised like the layers; a tied one is the table, unpacked
            self.norm, w = head.final_norm, head.lm_head.weight.detach()
            self.head = Linear(w, None, self.dtype, None if cfg.tied else quantize, pack=not cfg.tied, one_row=one)
        self.pos: dict[int, int] = {}  # slot -> positions its sequence has so far
        self.min_rows = MIN_ROWS if batched else 1  # decode batches are padded to this many rows

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads here: every matmul weight (at its width, scales
        included), norms, and one row of each embedding table."""
        n = sum(b.weight_bytes() for b in self.blocks)
        if self.embed is not None:  # embedding tables: one row per token
            n += sum(p.shape[1] * p.element_size() for p in self.embed.parameters())
        if self.head is not None:
            n += self.head.nbytes + sum(p.numel() * p.element_size() for p in self.norm.parameters())
        return int(n)

    def open(self, slot: int, max_len: int) -> None:
        """Start a new sequence of at most max_len positions in this slot (its old one is dropped)."""
        for b in self.blocks:
            b.open(slot, max_len, self.dtype)
        self.pos[slot] = 0

    @torch.no_grad()
    def forward(self, x, slots: list[int], reduce=lambda t: t):
        """x: token ids [rows, T] on the first stage, else hidden [rows, T, hidden], row i continuing
        the sequence in slots[i]; returns hidden [rows, T, hidden] or logits [rows, vocab]."""
        x = x.to(self.device)
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
            positions = torch.tensor(rows.pos, device=self.device)[:, None] + torch.arange(T, device=self.device)
            x = self.embed(x, positions)
        for b in self.blocks:
            x = b(x, rows, reduce)
        for s in slots:
            self.pos[s] += T
        if self.is_last:
            return self.head(self.norm(x[:, -1:])).view(x.shape[0], -1)[:n].float()
        return x[:n]
