"""Decode on a pp x tp mesh (`--mesh pp=P,tp=T`): pipeline stages whose layers are tensor-split.

The ranks sit on the mesh as smoltrain.mesh lays them out; each stage is one tp group, and
its tp rank 0 is the stage's door: it alone receives the step's header and hidden states
from the previous stage's door (over the pp group) and hands them to its tp peers with a
broadcast over the tp group, so a hop between stages carries one copy of the hidden state,
as in pp alone. Inside a stage every layer makes tp's two all-reduces (at `--wire-dtype`).
Stage 0 has no previous stage: world rank 0 leads, broadcasting the header and, for a
decode step, each row's last token (8 bytes a row) to its tp peers. Every rank of the last
stage holds the head and samples the same tokens with the same seeded generators; its door
sends them back to rank 0. Rank 0 keeps one step per stage in flight, as pp does.
"""

from __future__ import annotations

import torch

from smoltrain.infer.batching import DECODE, IDLE, PREFILL, QUIT, slots_of
from smoltrain.infer.engine import Engine
from smoltrain.infer.mesh_layout import place


class MeshEngine(Engine):
    def __init__(self, stage, comm, rank: int, world: int, mesh: str, wire: str | None = None):
        from smoltrain.mesh import axis_comms, parse

        super().__init__(stage, comm, rank, world, wire)
        self.s, self.stages, self.t, _ = place(mesh, rank)
        comms = axis_comms(parse(mesh, world), comm)  # every rank builds every group, in order
        self.pp, self.tp = comms["pp"], comms["tp"]
        self.depth = self.lanes = self.stages
        self.last = self.s == self.stages - 1

    def _reduce(self, t):
        return self.codec.all_reduce(self.tp, t)

    def _onward(self, h, out) -> None:
        """The stage's output on its way: the next stage's door, or (last stage) the tokens to rank 0."""
        if self.last:
            toks = self.sample(self.slots, out)
            if self.t == 0:
                self.pp.send(torch.tensor(toks, dtype=torch.int64), 0)
        elif self.t == 0:
            self.pp.send(h, self.s + 1)
            self.pp.send(self.codec.encode(out), self.s + 1)

    # --- rank 0 ---
    def issue(self, item) -> None:
        def run():
            h = self.header(item)
            self.tp.broadcast(h, 0)
            ids = torch.tensor(item.ids)
            if item.kind == DECODE:
                self.tp.broadcast(ids.reshape(-1).to(torch.int64), 0)
            if item.kind == PREFILL:
                self.stage.open(item.slots[0], len(item.req.prompt_ids) + item.req.max_new_tokens)
            self.slots = item.slots
            self._onward(h, self.stage(ids, item.slots, self._reduce))

        self.counted(item.kind, len(item.slots), run)

    def collect(self, item) -> list[int]:
        toks = torch.zeros(len(item.slots), dtype=torch.int64)
        self.pp.recv(toks, self.stages - 1)
        return toks.tolist()

    def pass_header(self, h) -> None:
        self.tp.broadcast(h, 0)
        self.pp.send(h, 1)

    # --- every other rank ---
    def follow(self, admissions) -> None:
        s, door = self.s, self.t == 0
        while True:
            h = self.empty_header()
            b0 = self.sent()
            if door:
                self.pp.recv(h, s - 1)
            self.tp.broadcast(h, 0)
            with self.stepping:  # the step's counters whole before a stats request reads them
                kind, mask, T, rid = h.tolist()
                self.slots = slots = slots_of(mask)
                if kind in (IDLE, QUIT):
                    if door and not self.last:
                        self.pp.send(h, s + 1)
                    self.counters["idle_bytes"] += self.sent() - b0
                    if kind == QUIT:
                        return
                    continue
                self.counters["decode_bytes" if kind == DECODE else "prefill_bytes"] += self.sent() - b0
                req = admissions.take(rid) if kind == PREFILL else None
                self.counted(kind, len(slots), lambda h=h, k=kind, T=T, r=req: self._step(h, k, T, r))

    def _step(self, h, kind: int, T: int, req) -> None:
        slots = self.slots
        if kind == PREFILL and self.last:
            self.open(slots[0], req)  # the stage's cache and the request's sampler
        elif kind == PREFILL:
            self.stage.open(slots[0], len(req.prompt_ids) + req.max_new_tokens)
        if self.s == 0:  # tokens in: the prompt (every rank has the request), or each row's last token
            if kind == PREFILL:
                x = torch.tensor([req.prompt_ids])
            else:
                x = torch.zeros(len(slots), dtype=torch.int64)
                self.tp.broadcast(x, 0)
                x = x[:, None]
        else:
            buf = self.codec.buffer(len(slots) * (T if kind == PREFILL else 1))
            if self.t == 0:
                self.pp.recv(buf, self.s - 1)
            self.tp.broadcast(buf, 0)
            x = self.codec.decode(buf).reshape(len(slots), T if kind == PREFILL else 1, -1)
        self._onward(h, self.stage(x, slots, self._reduce))
