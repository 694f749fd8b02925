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
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

from smolnet.errors import UsageError
from smoltrain import registry
from smoltrain.comm.timed import TimedComm  # noqa: F401 (run.worker wraps its comm in it)


@dataclass
class Context:
    """A rank's place in its run: the typed run config plus what only exists at run time."""

    rank: int
    world: int
    run: object  # smoltrain.run.config.RunConfig
    batches: object  # models.data.Batches
    comm: object = None  # TimedComm around a Comm (None for world 1 and the PS strategies)
    device: str = "cpu"
    reporter: object = None  # run.worker.Reporter (events, per-step stats)
    name: str = ""  # this rank's host name in the report
    comm_timer: object = None  # Stopwatch for communication a strategy does outside `comm`
    wait_timer: object = None  # Stopwatch for waiting on peers outside any call (diloco's roster sync)
    update_timer: object = None  # Stopwatch for a pipeline stage's own optimizer update (run/timings.py)
    secret: bytes = b""  # the parameter-server strategies open their own connections
    server_state: dict | None = None  # parameter server: tensors to resume from
    server_saver: object = None  # parameter server: callback(step, server) that checkpoints
    # a mesh (smoltrain.mesh): rank, world and comm above are this strategy's axis; `replica` is the
    # data axis around it (mesh.Axis: index, size, comm), each replica on its slice of the batch
    replica: object = None
    tp: object = None  # a mesh's tp axis inside each pp stage (mesh.Axis), or None

    # the run's settings strategies read most, by their short names
    spec = property(lambda self: self.run.model)
    seq = property(lambda self: self.run.seq)
    lr = property(lambda self: self.run.lr)
    seed = property(lambda self: self.run.seed)
    microbatches = property(lambda self: self.run.microbatches)
    schedule = property(lambda self: self.run.schedule)
    shares = property(lambda self: list(self.run.shares or []))

    @property
    def global_tokens(self) -> int:
        return self.run.global_tokens

    def build_model(self):
        """This run's whole model, the same on every rank: the built-in GPT from the seed, or a
        Hugging Face checkpoint's weights (models.causal), with LoRA adapters when the run has them
        and its blocks checkpointed (models.gpt.run_block) when it asks for that."""
        from smoltrain.models.gpt import build_model

        model = build_model(self.spec, self.seed, getattr(self.run, "quantize", None))
        if getattr(self.run, "lora", None):
            from smoltrain.finetune.lora import LoraConfig, apply

            apply(model, LoraConfig.from_dict(self.run.lora), self.spec.arch, self.seed)
        for block in list(model.units)[1:-1]:  # --checkpoint-activations: blocks rerun in backward
            block.checkpoint = bool(getattr(self.run, "checkpoint_activations", False))
        return model

    @property
    def batch(self) -> int:
        """Sequences per step the strategy trains on: the global batch, or its replica's slice."""
        if self.replica is None:
            return self.run.batch
        lo, hi = self._replica_range()
        return hi - lo

    def _replica_range(self) -> tuple[int, int]:
        """This replica's sequences: a mesh placement's uneven `rows` (by replica speed), else even."""
        from smoltrain.planner.placement import batch_ranges

        rows = self.placement.get("rows")
        return (
            tuple(rows[self.replica.index])
            if rows
            else batch_ranges(self.run.batch, None, self.replica.size)[self.replica.index]
        )

    def strategy_batch(self, step: int):
        """(x, y) the strategy trains on: the global batch, or its replica's slice in a mesh."""
        if self.replica is None:
            return self.batches.global_batch(step)
        return self.batches.slice(step, *self._replica_range())

    def sync_replicas(self, params) -> None:
        """Sum the gradients over the replicas of a mesh's data axis (one flat all-reduce), so
        every replica steps with the gradient of the global batch's mean loss; no-op without one,
        and along diloco, whose replicas step alone and meet at the outer step (strategies.outer)."""
        if self.replica is None or self.replica.size == 1 or self.replica.name == "diloco":
            return
        import torch

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.replica.comm.all_reduce(flat, op="sum")
        off = 0
        for p in params:
            p.grad = flat[off : off + p.numel()].view_as(p).clone()
            off += p.numel()

    def loss_tokens(self, step: int) -> int:
        """Targets of step's global batch that carry loss: the denominator of its mean loss
        (batch*seq for text; fewer where a loss mask leaves prompts out). A mesh's diloco
        worker trains alone on its replica's slice, on that slice's mean loss."""
        if self.replica is not None and self.replica.name == "diloco":
            return targets(self.strategy_batch(step)[1])
        return self.batches.loss_tokens(step)

    # --- this rank's part of the work, as the run's placement says (planner.placement) ---
    @property
    def placement(self) -> dict:
        return self.run.placement or {}

    def batch_range(self, rank: int | None = None) -> tuple[int, int]:
        """[lo, hi) sequences of the global batch: the placement's shares, else --shares, else even."""
        from smoltrain.planner.placement import batch_ranges

        shares = self.placement.get("shares") or self.run.shares
        return batch_ranges(self.batch, list(shares) if shares else None, self.world)[
            self.rank if rank is None else rank
        ]

    def layer_range(self) -> tuple[int, int]:
        """[first, last+1) transformer layers of this stage (mp, pp)."""
        from smoltrain.planner.placement import even_counts, ranges

        cuts = self.placement.get("layers") or ranges(even_counts(self.spec.layers, self.world))
        return tuple(cuts[self.rank])

    def head_range(self, axis=None) -> tuple[tuple[int, int], tuple[int, int]]:
        """([first, last+1) attention heads, [first, last+1) MLP columns) of this rank (tp), or of
        its place along a mesh's tp `axis` inside a pp stage (an even split)."""
        from smoltrain.planner.placement import counts_from_shares, even_counts, ranges

        rank, world = (self.rank, self.world) if axis is None else (axis.index, axis.size)
        heads = self.placement.get("heads") if axis is None else None
        if heads is None:
            g = self.spec.heads // self.spec.kv_heads
            heads = ranges([n * g for n in even_counts(self.spec.kv_heads, world)])
        ffn = (self.placement.get("ffn") if axis is None else None) or ranges(
            counts_from_shares(self.spec.ffn, [hi - lo for lo, hi in heads])
        )
        return tuple(heads[rank]), tuple(ffn[rank])


class Strategy(ABC):
    """One rank's share of the model, its optimizer, and its training step."""

    loss_owner = True  # does this rank's train_step return a loss share?
    weight = None  # elastic members: the part of the batch the loss share just returned stands for
    share = None  # elastic members: the part of the batch (and of the held-out windows) this rank holds now

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
        st = {f"param.{n}": p.detach() for n, p in self.model.named_parameters() if p.requires_grad}
        st.update(self.opt.state_tensors())  # (under LoRA the frozen base is the checkpoint folder's)
        return st

    def load_state_tensors(self, state: dict) -> None:
        import torch

        with torch.no_grad():
            for n, p in self.model.named_parameters():
                if p.requires_grad:
                    p.copy_(state[f"param.{n}"])
        self.opt.load_state_tensors(state)

    def state_bytes(self) -> dict:
        """Bytes this rank keeps between steps: parameters and optimizer state."""
        st = self.state_tensors()
        params = sum(t.numel() * t.element_size() for k, t in st.items() if not k.startswith("opt."))
        opt = sum(t.numel() * t.element_size() for k, t in st.items() if k.startswith("opt."))
        return {"params": params, "optimizer": opt}

    def next_step(self, step: int) -> int | None:
        """The step to run next, or None when the run is over (the parameter server decides for its workers)."""
        return step if step < self.ctx.run.steps else None

    def link_bytes(self) -> list[tuple[str, str, int]]:
        """Payload bytes this rank sent to each peer, by host name, as the transport counted them."""
        comm, names = self.ctx.comm, self.ctx.run.names
        return [(self.ctx.name, names[dst], n) for dst, n in sorted(comm.counter.payload.items())] if comm else []

    def sent_bytes(self) -> int:
        """Payload bytes this rank has sent so far (for the progress line)."""
        return self.ctx.comm.counter.total_payload() if self.ctx.comm else 0

    def close(self) -> None:  # noqa: B027 (most strategies hold nothing to release)
        """Release what the strategy holds beyond the Comm (threads, servers)."""

    def eval_loss(self, x, y) -> float | None:
        """This rank's share of the mean loss on held-out windows (x, y) with the current
        weights (`--eval-every`), or None where other ranks answer; the shares add up. The
        default fits the replicas: each evaluates its slice of the batch with its whole
        `self.model`, so a slow host evaluates as little as it trains on."""
        lo, hi = self.ctx.batch_range()
        return mean_loss(self.model, x[lo:hi], y[lo:hi], targets(y))


def mean_loss(model, x, y, tokens: int | None = None) -> float:
    """Next-byte loss of a whole model on (x, y), summed and divided by `tokens` (default:
    y's own, the mean), without gradients."""
    import torch

    from smoltrain.models.gpt import loss_sum

    if x.shape[0] == 0:
        return 0.0
    with torch.no_grad():
        return float(loss_sum(model(x), y, tokens or targets(y)))


def targets(y) -> int:
    """Targets of y that carry loss (not -100), at least 1: a mean's denominator."""
    return max(1, int((y != -100).sum()))


def trainable(module) -> list:
    """The parameters a strategy trains, sends and updates: those not frozen (LoRA freezes the base)."""
    return [p for p in module.parameters() if p.requires_grad]


def eval_due(run, step: int) -> bool:
    """Is the held-out loss measured after `step` (every --eval-every steps, and at the end)?"""
    k = run.eval_every
    return k > 0 and ((step + 1) % k == 0 or step + 1 == run.steps)


def check_world(strategy: str, spec, world: int) -> None:
    """Refuse splits the model cannot take, before any process starts."""
    info = registry.get(strategy, trainable=True)
    if world < 1:
        raise UsageError("world size must be at least 1")
    if info.splits == "layers" and world > spec.layers:
        raise UsageError(
            f"{strategy}: {spec.layers} layers of {spec.name} do not divide over {world} stages "
            f"(at most one stage per layer)"
        )
    if info.splits == "heads" and (world > spec.kv_heads or world > spec.ffn):
        raise UsageError(
            f"{strategy}: {spec.kv_heads} KV head groups of {spec.name} do not divide over {world} ranks "
            f"(at most one rank per group)"
        )
    if info.splits == "layers" and world > 1 and spec.source and spec.tied_embeddings:
        raise UsageError(
            f"{strategy}: {spec.name} ties its LM head to its embeddings, which would sit on two stages; "
            "train it with dp, syncps, diloco or tp"
        )
    if info.shards_params and spec.tied_embeddings:
        raise UsageError(f"{strategy}: {spec.name} ties its embeddings across units; use an untied model such as tiny")


def load_strategy(name: str) -> type[Strategy]:
    info = registry.get(name, trainable=True)
    return importlib.import_module(f"smoltrain.strategies.{info.module}").STRATEGY


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

    def add(self, seconds: float) -> None:
        """Count seconds timed elsewhere (a part of a call the caller measured itself)."""
        self.seconds += seconds
