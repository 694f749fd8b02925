"""One rank's decode loop, for the one-process reference (`local`), pp and tp.

pp: rank 0 embeds, each stage sends its hidden state to the next, the last stage
samples and sends the token id (one int64) back to rank 0. tp: every rank runs every
layer on its heads, two all-reduces per layer, and samples the same token from the
same logits with the same seeded generator.

Rank 0 alone decides when to stop (token budget, end-of-sequence, a cancelled
request) and tells the others in-band, at no extra cost in bytes per token: instead
of the next step's hidden state (pp) or first all-reduce contribution (tp) it sends
NaNs of the same shape, which no real hidden state contains.
"""
from __future__ import annotations

from smolnet.errors import SmolError

import time
from dataclasses import dataclass, field

import torch

from smoltrain.infer.sampling import Sampler
from smoltrain.models.stage import Stage


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class _Stop(SmolError):
    """The request was cancelled (client gone); ends generation early."""


class Engine:
    def __init__(self, stage: Stage, strategy: str = "local", comm=None, rank: int = 0, world: int = 1):
        self.stage, self.strategy, self.comm, self.rank, self.world = stage, strategy, comm, rank, world
        self.armed = False

    def sent(self) -> int:
        return self.comm.counter.total_payload() if self.comm is not None else 0

    def _reduce(self, t):
        if self.strategy != "tp" or self.world == 1:
            return t
        t = t.contiguous()
        self.comm.all_reduce(t)
        if self.armed:
            self.armed = False
            if torch.isnan(t.view(-1)[0]):
                raise _Stop
        return t

    def generate(self, req: Request, emit=lambda tok: None, cancelled=lambda: False) -> dict:
        """Run one request on this rank; rank 0 emits each new token as it comes. Returns this rank's stats."""
        st, r, N = self.stage, self.rank, self.world
        pp = self.strategy == "pp" and N > 1
        st.reset(len(req.prompt_ids) + req.max_new_tokens)
        sampler = Sampler(req.temperature, req.top_p, req.seed)
        h, dt = st.cfg.hidden, st.dtype
        tokbuf = torch.zeros(1, dtype=torch.int64)
        out_ids: list[int] = []
        t0 = time.perf_counter()
        sent0 = self.sent()
        # prefill: the whole prompt at once
        T = len(req.prompt_ids)
        if pp and r > 0:
            x = torch.zeros(1, T, h, dtype=dt)
            self.comm.recv(x, r - 1)
        else:
            x = torch.tensor([req.prompt_ids], dtype=torch.int64)
        out = st(x, self._reduce)
        tok = None
        if pp:
            if st.is_last:
                tokbuf[0] = sampler(out)
                self.comm.send(tokbuf, 0)
            else:
                self.comm.send(out, r + 1)
            if r == 0:
                self.comm.recv(tokbuf, N - 1)
                tok = int(tokbuf[0])
        else:
            tok = sampler(out)
        t_first = time.perf_counter()
        if r == 0:
            out_ids.append(tok)
            emit(tok)
        prefill_sent = step_sent = self.sent()
        steps = 0
        while True:
            step_sent = self.sent()
            if r == 0:
                if len(out_ids) >= req.max_new_tokens or tok in req.stop_ids or cancelled():
                    if N > 1:
                        nan = torch.full((1, 1, h), float("nan"), dtype=dt)
                        self.comm.send(nan, 1) if pp else self.comm.all_reduce(nan)
                    break
            if pp:
                if r == 0:
                    self.comm.send(st(torch.tensor([[tok]]), self._reduce), 1)
                    self.comm.recv(tokbuf, N - 1)
                    tok = int(tokbuf[0])
                else:
                    x = torch.zeros(1, 1, h, dtype=dt)
                    self.comm.recv(x, r - 1)
                    if torch.isnan(x.view(-1)[0]):
                        if not st.is_last:
                            self.comm.send(x, r + 1)
                        break
                    out = st(x, self._reduce)
                    if st.is_last:
                        tokbuf[0] = sampler(out)
                        self.comm.send(tokbuf, 0)
                    else:
                        self.comm.send(out, r + 1)
            else:
                self.armed = r != 0 and N > 1
                try:
                    tok = sampler(st(torch.tensor([[tok]]), self._reduce))
                except _Stop:
                    break
            steps += 1
            if r == 0:
                out_ids.append(tok)
                emit(tok)
        t_end = time.perf_counter()
        return {"rank": r, "output_ids": out_ids, "prefill_tokens": T, "prefill_s": t_first - t0,
                "decode_steps": steps, "decode_s": t_end - t_first,
                "prefill_bytes": prefill_sent - sent0, "decode_bytes": step_sent - prefill_sent}
