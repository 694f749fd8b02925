"""One rank's decode loop; the one-process reference here, pp and tp in their own modules.

Prefill runs the whole prompt at once, then each decode step feeds the last token.
Rank 0 alone decides when to stop (token budget, end-of-sequence, a cancelled
request) and tells the other ranks in band, at no extra cost in bytes per token:
instead of the next step's first message (pp: the hidden state; tp: the first
all-reduce contribution) it sends NaNs of the same shape, which no real hidden state
contains. A rank that sees them raises `Stop` and the request ends everywhere.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from smolnet.errors import SmolError
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


class Stop(SmolError):
    """Rank 0's stop marker arrived: the request is over."""


def is_marker(t: torch.Tensor) -> bool:
    return bool(torch.isnan(t.reshape(-1)[0]))


class Engine:
    """`local`: one process holds every layer; no network. The reference the others must equal."""

    def __init__(self, stage: Stage, comm=None, rank: int = 0, world: int = 1, wire: str | None = None):
        from smoltrain.infer.activations import Codec

        self.stage, self.comm, self.rank, self.world = stage, comm, rank, world
        # what hidden states cross the wire as (--wire-dtype; default: the compute dtype)
        wire = wire or {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[stage.dtype]
        self.codec = Codec(wire, stage.cfg.hidden, stage.dtype, stage.device)

    def sent(self) -> int:
        return self.comm.counter.total_payload() if self.comm is not None else 0

    # what the strategies override
    def prefill(self, ids: torch.Tensor, sampler) -> int | None:
        return sampler(self.stage(ids))

    def step(self, tok: int | None, sampler) -> int | None:
        return sampler(self.stage(torch.tensor([[tok]])))

    def signal_stop(self) -> None:
        pass

    def marker(self) -> torch.Tensor:
        return torch.full((1, 1, self.stage.cfg.hidden), float("nan"), dtype=self.stage.dtype)

    def generate(self, req: Request, emit=lambda tok: None, cancelled=lambda: False) -> dict:
        """Run one request on this rank; rank 0 emits each new token as it comes. Returns this rank's stats."""
        r = self.rank
        self.stage.reset(len(req.prompt_ids) + req.max_new_tokens)
        sampler = Sampler(req.temperature, req.top_p, req.seed)
        out_ids: list[int] = []
        t0, sent0 = time.perf_counter(), self.sent()
        tok = self.prefill(torch.tensor([req.prompt_ids], dtype=torch.int64), sampler)
        t_first, cpu_first = time.perf_counter(), time.process_time()
        if r == 0:
            out_ids.append(tok)
            emit(tok)
        prefill_sent = step_sent = self.sent()
        steps = 0
        while True:
            step_sent = self.sent()  # the stop marker is not a decode step's traffic
            if r == 0 and (len(out_ids) >= req.max_new_tokens or tok in req.stop_ids or cancelled()):
                self.signal_stop()
                break
            try:
                tok = self.step(tok, sampler)
            except Stop:
                break
            steps += 1
            if r == 0:
                out_ids.append(tok)
                emit(tok)
        t_end = time.perf_counter()
        return {
            "rank": r,
            "output_ids": out_ids,
            "prefill_tokens": len(req.prompt_ids),
            "prefill_s": t_first - t0,
            "decode_steps": steps,
            "decode_s": t_end - t_first,
            "decode_cpu_s": time.process_time() - cpu_first,
            "prefill_bytes": prefill_sent - sent0,
            "decode_bytes": step_sent - prefill_sent,
        }


def make_engine(
    strategy: str, stage: Stage, comm=None, rank: int = 0, world: int = 1, wire: str | None = None
) -> Engine:
    if world == 1 or strategy == "local":
        return Engine(stage)
    if strategy == "pp":
        from smoltrain.infer.pp import PipelineEngine

        return PipelineEngine(stage, comm, rank, world, wire)
    if strategy == "tp":
        from smoltrain.infer.tp import TensorParallelEngine

        return TensorParallelEngine(stage, comm, rank, world, wire)
    raise ValueError(f"unknown inference strategy {strategy!r}")
