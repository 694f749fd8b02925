"""Tensor-parallel decode: every rank runs every layer on its share of heads and MLP columns.

Each step starts with rank 0's header, broadcast (what the step is: which slots, or
which request's prompt); then two all-reduces of the rows' hidden states per layer
(after attention, after the MLP; at `--wire-dtype`, infer.activations), as the plan
counts. Embedding and head are
replicated, and every rank samples the same tokens from the same logits with the same
seeded generators, so no token crosses and every rank knows each slot's last token.
"""

from __future__ import annotations

import torch

from smoltrain.infer.batching import DECODE, IDLE, PREFILL, QUIT, slots_of
from smoltrain.infer.engine import Engine


class TensorParallelEngine(Engine):
    def __init__(self, stage, comm, rank: int, world: int, wire: str | None = None):
        super().__init__(stage, comm, rank, world, wire)
        self.last: dict[int, int] = {}  # slot -> its last token (ranks other than 0 embed it)

    def _reduce(self, t):
        return self.codec.all_reduce(self.comm, t)

    def _step(self, kind: int, slots: list[int], ids, req=None) -> list[int]:
        if kind == PREFILL:
            self.open(slots[0], req)
        toks = self.sample(slots, self.stage(torch.tensor(ids), slots, self._reduce))
        self.last.update(zip(slots, toks))
        return toks

    # --- rank 0 ---
    def issue(self, item) -> None:
        def run():
            self.pass_header(self.header(item))
            self._out = self._step(item.kind, item.slots, item.ids, item.req)

        self.counted(item.kind, len(item.slots), run)

    def pass_header(self, h) -> None:
        self.comm.broadcast(h, 0)

    # --- ranks 1.. ---
    def follow(self, admissions) -> None:
        while True:
            h = self.empty_header()
            b0 = self.sent()
            self.comm.broadcast(h, 0)
            with self.stepping:  # the step's counters whole before a stats request reads them
                kind, mask, _, rid = h.tolist()
                slots = slots_of(mask)
                if kind in (IDLE, QUIT):
                    self.counters["idle_bytes"] += self.sent() - b0
                    if kind == QUIT:
                        return
                    continue
                self.counters["decode_bytes" if kind == DECODE else "prefill_bytes"] += self.sent() - b0
                if kind == PREFILL:
                    req = admissions.take(rid)
                    self.counted(kind, 1, lambda s=slots, r=req: self._step(PREFILL, s, [r.prompt_ids], r))
                else:
                    ids = [[self.last[s]] for s in slots]
                    self.counted(kind, len(slots), lambda s=slots, i=ids: self._step(DECODE, s, i))
