"""Pipeline-parallel decode: each rank holds a run of layers and passes the hidden states on.

Every step crosses the stages in order: rank 0 embeds and runs its layers, each stage
sends the step's header and its output (one hidden state per row) to the next, the
last stage samples each row's token and sends the ids (one int64 per row) back to rank
0. Per generated token a hop carries `hidden * dtype bytes` (at `--wire-dtype`,
infer.activations) plus the header shared by the step's rows, and 8 bytes come back, as
the plan counts.

Rank 0 keeps one step per lane in flight (a lane per stage): while stage 1 runs lane
A's step, stage 0 runs lane B's, so with requests in several lanes every stage has work.
"""

from __future__ import annotations

import time

import torch

from smoltrain.infer.batching import DECODE, IDLE, PREFILL, QUIT, slots_of
from smoltrain.infer.engine import Engine


class PipelineEngine(Engine):
    def __init__(self, stage, comm, rank: int, world: int, wire: str | None = None):
        super().__init__(stage, comm, rank, world, wire)
        self.depth = self.lanes = world

    # --- rank 0 ---
    def issue(self, item) -> None:
        def run():
            if item.kind == PREFILL:
                self.stage.open(item.slots[0], len(item.req.prompt_ids) + item.req.max_new_tokens)
            out = self.stage(torch.tensor(item.ids), item.slots)
            self.pass_header(self.header(item))
            self.comm.send(self.codec.encode(out), 1)

        self.counted(item.kind, len(item.slots), run)

    def collect(self, item) -> list[int]:
        toks = torch.zeros(len(item.slots), dtype=torch.int64)
        self.counted(item.kind, len(item.slots), lambda: self.comm.recv(toks, self.world - 1), False, True)
        return toks.tolist()

    def pass_header(self, h) -> None:
        self.comm.send(h, 1)

    # --- ranks 1.. ---
    def follow(self, admissions) -> None:
        r, last = self.rank, self.rank == self.world - 1
        while True:
            h = self.empty_header()
            c0, w0, m0 = time.process_time(), time.perf_counter(), self.comm.mark()
            self.comm.recv(h, r - 1)  # the wait for the step's header, charged once its kind is known
            with self.stepping:  # the step's counters whole before a stats request reads them
                kind, mask, T, rid = h.tolist()
                if kind == DECODE:
                    self.charge(time.process_time() - c0, time.perf_counter() - w0, m0, wait=True)
                slots = slots_of(mask)
                if kind in (IDLE, QUIT):
                    if not last:
                        self.counted(kind, 0, lambda h=h: self.comm.send(h, r + 1))
                    if kind == QUIT:
                        return
                    continue
                if kind == PREFILL:
                    req = admissions.take(rid)
                    if last:
                        self.open(slots[0], req)
                    else:
                        self.stage.open(slots[0], len(req.prompt_ids) + req.max_new_tokens)
                T = T if kind == PREFILL else 1
                buf = self.codec.buffer(len(slots) * T)

                def run(h=h, buf=buf, slots=slots, T=T):
                    self.comm.recv(buf, r - 1)
                    out = self.stage(self.codec.decode(buf).reshape(len(slots), T, -1), slots)
                    if last:
                        self.comm.send(torch.tensor(self.sample(slots, out), dtype=torch.int64), 0)
                    else:
                        self.comm.send(h, r + 1)
                        self.comm.send(self.codec.encode(out), r + 1)

                self.counted(kind, len(slots), run)
