"""The training strategies, one readable file each, and what they share.

Every strategy is a `Strategy`: it builds its part of the model from the seed,
and `train_step(step)` runs one optimizer step and returns this rank's share of
the global mean loss (or None when another rank holds the loss). The runner owns
the step loop, timing, checkpoints and reporting, so a strategy file holds only
what crosses the wire and why.

Strategies call the `Comm` interface (send/recv/collectives); none of them opens
a socket itself, except the parameter-server pair (`syncps`, `edp`), whose
membership protocol lives in `smoltrain.strategies.parameter_server`.
"""
from __future__ import annotations

import importlib
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from smolnet.errors import UsageError

STRATEGIES = ("dp", "fsdp", "syncps", "edp", "mp", "pp", "tp")
SYNCHRONOUS = ("dp", "fsdp", "syncps", "mp", "pp", "tp")  # reproduce the --local 1 curve


@dataclass
class Context:
    """Everything a strategy needs to know about its run and its place in it."""
    rank: int
    world: int
    spec: object            # ModelSpec
    batches: object         # data.Batches
    batch: int
    seq: int
    lr: float
    seed: int
    comm: object = None     # TimedComm around a Comm (None for world 1 and the PS strategies)
    shares: list = field(default_factory=list)
    microbatches: int = 1
    schedule: str = "1f1b"
    device: str = "cpu"
    cfg: dict = field(default_factory=dict)
    reporter: object = None  # runner.Reporter (events, per-step stats)
    name: str = ""           # this rank's host name in the report
    comm_timer: object = None  # Stopwatch for communication a strategy does outside `comm`

    @property
    def global_tokens(self) -> int:
        return self.batch * self.seq


class Strategy(ABC):
    """One rank's share of the model, its optimizer, and its training step."""

    loss_owner = True  # does this rank's train_step return a loss share?

    def __init__(self, ctx: Context):
        self.ctx = ctx

    @abstractmethod
    def train_step(self, step: int) -> float | None:
        """One optimizer step; returns this rank's share of the loss (or None)."""

    def state_tensors(self) -> dict:
        """Parameters and optimizer state this rank holds (for checkpoints).

        The default fits strategies whose rank holds `self.model` (whole, a stage or a
        shard of layers) and `self.opt`; sharded ones override it.
        """
        st = {f"param.{n}": p.detach() for n, p in self.model.named_parameters()}
        st.update(self.opt.state_tensors())
        return st

    def load_state_tensors(self, state: dict) -> None:
        import torch

        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(state[f"param.{n}"])
        self.opt.load_state_tensors(state)

    def state_bytes(self) -> dict:
        """Bytes this rank keeps between steps: parameters and optimizer state."""
        st = self.state_tensors()
        params = sum(t.numel() * t.element_size() for k, t in st.items() if not k.startswith("opt."))
        opt = sum(t.numel() * t.element_size() for k, t in st.items() if k.startswith("opt."))
        return {"params": params, "optimizer": opt}

    def sent_bytes(self) -> int:
        """Payload bytes this rank has sent so far (for the progress line)."""
        return self.ctx.comm.counter.total_payload() if self.ctx.comm else 0

    def close(self) -> None:
        pass


def check_world(strategy: str, spec, world: int) -> None:
    """Refuse splits the model cannot take, before any process starts."""
    if strategy not in STRATEGIES:
        raise UsageError(f"unknown strategy {strategy!r} (choose from {', '.join(STRATEGIES)})")
    if world < 1:
        raise UsageError("world size must be at least 1")
    if strategy == "pp" and spec.layers % world:
        raise UsageError(f"pp: {spec.layers} layers of {spec.name} do not divide over {world} stages")
    if strategy == "mp" and world > spec.layers:
        raise UsageError(f"mp: {spec.name} has {spec.layers} layers, fewer than {world} ranks")
    if strategy == "tp" and (spec.heads % world or spec.ffn % world):
        raise UsageError(f"tp: {spec.heads} heads / ffn {spec.ffn} of {spec.name} do not divide over {world} ranks")
    if strategy == "fsdp" and spec.tied_embeddings:
        raise UsageError(f"fsdp: {spec.name} ties its embeddings across units; use an untied model such as tiny")


def load_strategy(name: str) -> type[Strategy]:
    if name not in STRATEGIES:
        raise UsageError(f"unknown strategy {name!r} (choose from {', '.join(STRATEGIES)})")
    return importlib.import_module(f"smoltrain.strategies.{name}").STRATEGY


class Stopwatch:
    """`with watch:` adds the elapsed seconds; `take()` returns and resets them."""

    def __init__(self):
        self.seconds, self._t0 = 0.0, 0.0

    def __enter__(self):
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds += time.perf_counter() - self._t0

    def take(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s


class TimedComm:
    """A Comm that also adds up the seconds spent inside its calls (comm_s)."""

    _timed = ("send", "recv", "broadcast", "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "barrier")

    def __init__(self, comm):
        self._comm = comm
        self._lock = threading.Lock()
        self.seconds = 0.0
        for name in self._timed:
            setattr(self, name, self._wrap(getattr(comm, name)))

    def _wrap(self, fn):
        def call(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                dt = time.perf_counter() - t0
                with self._lock:
                    self.seconds += dt
        return call

    def take_seconds(self) -> float:
        with self._lock:
            s, self.seconds = self.seconds, 0.0
        return s

    def __getattr__(self, name):
        return getattr(self._comm, name)
