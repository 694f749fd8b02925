"""One rank's part of batched decoding; the one-process reference here, pp and tp in their own modules.

Rank 0 runs the step loop (`batching.lead`): it issues each step (a prompt's prefill, or
one decode step for a batch of requests) and collects the step's sampled tokens. The
other ranks `follow`: each step starts with rank 0's header (what the step is), and a
prefill's request (its prompt length and sampling settings) comes from the controller
over the control channel (`batching.Admissions`).

Every rank counts what it sent and the CPU time it spent, by kind of step, so a report
can say what a decode step costs per token.
"""

from __future__ import annotations

import threading
import time

import torch

from smoltrain.infer.batching import DECODE, HEADER_FIELDS, IDLE, PREFILL, QUIT, Item
from smoltrain.infer.sampling import Sampler
from smoltrain.models.stage import Stage

SNAPSHOT_WAIT_S = 2.0  # seconds `stats` waits for a step still counting (Engine.snapshot)


class Engine:
    """`local`: one process holds every layer; no network. The reference the others must equal."""

    depth = 1  # steps rank 0 keeps in flight
    lanes = 1  # batches the active requests are dealt into

    def __init__(self, stage: Stage, comm=None, rank: int = 0, world: int = 1, wire: str | None = None):
        from smoltrain.comm.timed import TimedComm
        from smoltrain.infer.activations import Codec

        self.stage, self.rank, self.world = stage, rank, world
        self.comm = TimedComm(comm) if comm is not None else None
        # what hidden states cross the wire as (--wire-dtype; default: the compute dtype)
        wire = wire or {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[stage.dtype]
        self.codec = Codec(wire, stage.cfg.hidden, stage.dtype, stage.device)
        self.samplers: dict[int, Sampler] = {}
        # held while a step runs and its counters change: a `stats` request (another thread) waits
        # for it, so a rank whose last step of a request is still counting is not read half-way
        self.stepping = threading.RLock()
        self.counters = {
            "prefill_bytes": 0,
            "decode_bytes": 0,
            "idle_bytes": 0,
            "prefill_steps": 0,
            "decode_steps": 0,
            "decode_rows": 0,
            "decode_cpu_s": 0.0,
            # of a decode step: its wall time, and the CPU, wall time and calls of its messages
            "decode_wall_s": 0.0,
            "decode_comm_cpu_s": 0.0,
            "decode_comm_wall_s": 0.0,
            "decode_comm_calls": 0,
            "decode_wait_s": 0.0,  # of decode_wall_s: a pp rank's wait for its turn (the step's input)
        }
        self._out: list[int] = []

    def sent(self) -> int:
        return self.comm.counter.total_payload() if self.comm is not None else 0

    def counted(self, kind: int, rows: int, fn, step: bool = True, wait: bool = False):
        """Run fn, charging what it sent (and, for decode, its CPU and wall time, and of them
        its messages') to this kind of step; `step` False: a part of a step counted already
        (a pp rank's receive before its stage runs)."""
        with self.stepping:
            b0, c0, w0 = self.sent(), time.process_time(), time.perf_counter()
            m0 = self.comm.mark() if self.comm is not None else (0.0, 0.0, 0)
            out = fn()
            name = {PREFILL: "prefill", DECODE: "decode"}.get(kind, "idle")
            self.counters[f"{name}_bytes"] += self.sent() - b0
            if kind == DECODE:
                self.charge(time.process_time() - c0, time.perf_counter() - w0, m0, wait)
                self.counters["decode_steps"] += step
                self.counters["decode_rows"] += rows if step else 0
            elif kind == PREFILL:
                self.counters["prefill_steps"] += step
            return out

    def snapshot(self, wait_s: float = SNAPSHOT_WAIT_S) -> tuple[dict, dict]:
        """(counters, bytes sent per peer) between steps: what `stats` reports. A step still
        counting is waited for, up to `wait_s`: a long prompt's prefill holds the step for
        longer, and a health check that waited it out would call the model down (CI: a long
        prompt's replica read "no stats from the ranks within 10s"); then the figures so far."""
        held = self.stepping.acquire(timeout=wait_s)
        try:
            return dict(self.counters), (self.comm.bytes_sent() if self.comm is not None else {})
        finally:
            if held:
                self.stepping.release()

    def charge(self, cpu: float, wall: float, m0: tuple, wait: bool = False) -> None:
        """Add a stretch of decode work (its CPU and wall seconds, and the comm's marks at its
        start) to the decode counters; `wait`: a wait for the step's input."""
        c = self.counters
        c["decode_cpu_s"] += cpu
        c["decode_wall_s"] += wall
        c["decode_wait_s"] += wall if wait else 0.0
        if self.comm is not None:
            cpu1, wall1, n1 = self.comm.mark()
            c["decode_comm_cpu_s"] += cpu1 - m0[0]
            c["decode_comm_wall_s"] += wall1 - m0[1]
            c["decode_comm_calls"] += n1 - m0[2]

    def open(self, slot: int, req) -> None:
        self.stage.open(slot, len(req.prompt_ids) + req.max_new_tokens)
        self.samplers[slot] = Sampler(req.temperature, req.top_p, req.seed)

    def sample(self, slots: list[int], logits: torch.Tensor) -> list[int]:
        return [self.samplers[s](logits[i]) for i, s in enumerate(slots)]

    # --- rank 0 ---
    def issue(self, item: Item) -> None:
        def run():
            if item.kind == PREFILL:
                self.open(item.slots[0], item.req)
            self._out = self.sample(item.slots, self.stage(torch.tensor(item.ids), item.slots))

        self.counted(item.kind, len(item.slots), run)

    def collect(self, item: Item) -> list[int]:
        return self._out

    def pass_header(self, h: torch.Tensor) -> None:
        """Rank 0's header on its way to the other ranks (pp: down the chain; tp: a broadcast)."""

    def _signal(self, kind: int) -> None:
        h = self.empty_header()
        h[0] = kind
        self.counted(kind, 0, lambda: self.pass_header(h))

    def keepalive(self) -> None:
        self._signal(IDLE)

    def quit(self) -> None:
        self._signal(QUIT)

    @staticmethod
    def header(item: Item) -> torch.Tensor:
        return torch.tensor(item.header(), dtype=torch.int64)

    @staticmethod
    def empty_header() -> torch.Tensor:
        return torch.zeros(HEADER_FIELDS, dtype=torch.int64)


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
