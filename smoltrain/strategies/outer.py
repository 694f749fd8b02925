"""The DiLoCo outer step, and diloco as a mesh axis around another strategy.

diloco (strategies/diloco.py) trains whole replicas and, every H inner steps, averages their
pseudo-gradients and applies the outer optimizer (`outer_update`, shared with it). On a mesh
(`--mesh diloco=2,pp=2`, `diloco=2,tp=2`, `diloco=2,pp=2,tp=2`) each diloco worker is the
whole inner strategy instead of one rank: `OuterSteps` wraps this rank's inner strategy
(its pipeline stage, its tp slice), which trains its replica's slice of every batch with
its own inner optimizer, on its replica's mean loss (Context.loss_tokens); no gradient
crosses between replicas (Context.sync_replicas leaves a diloco axis alone).

Every H inner steps each rank all-reduces the pseudo-gradient of what it holds (anchor minus
its weights: a stage's units, a tp slice) over its diloco group, the ranks at the same place
in the other replicas, which hold the same slices. Each is weighted by the tokens its replica
trained on since the last outer step, counted from the batches (every rank knows the global
batch), so nothing else crosses. Every rank then applies the same outer step, and each
diloco group ends it with identical bits. With H = 1, sgd, outer lr 1 and momentum 0 this is
dp along the axis (tests/test_mesh.py checks it against `--local 1`).

What crosses the diloco axis, per outer step: one ring all-reduce of each rank's trainable
parameters at `--sync-dtype`, inside its group; planner.mesh_traffic counts it amortised over
H. A mesh's members are fixed and its shares even: the 1-D strategy's dropping and admitting
of members and its pace-based shares (strategies/roster.py) do not apply here.
"""

from __future__ import annotations

import hashlib
import time

import torch

from smoltrain.comm.quantized import all_reduce_as
from smoltrain.strategies import Strategy
from smoltrain.strategies.parameter_server import flat_params


def outer_update(anchor, momentum, flat, delta, lr: float, mu: float) -> None:
    """SGD with Nesterov momentum on the averaged pseudo-gradient `delta` (consumed):
    m <- mu*m + delta; anchor <- anchor - lr*(delta + mu*m); the weights become the anchor."""
    with torch.no_grad():
        momentum.mul_(mu).add_(delta)
        anchor.sub_(delta.add_(momentum, alpha=mu), alpha=lr)
        flat.copy_(anchor)


def digest(anchor: torch.Tensor) -> str:
    """The shared weights' fingerprint in the run report: equal on every rank of a group."""
    return hashlib.sha256(memoryview(anchor.cpu().numpy())).hexdigest()[:16]


class Anchored:
    """What both diloco forms keep beside the weights they train (`flat`, one buffer): the
    shared anchor of the last outer step and the outer Nesterov momentum, checkpointed with them."""

    def keep_anchor(self, params) -> None:
        self.flat = flat_params(params)
        self.anchor = self.flat.detach().clone()
        self.momentum = torch.zeros_like(self.flat)

    def at_anchor(self, fn):
        """fn() with the shared weights of the last outer step in place of this rank's (held-out loss)."""
        local = self.flat.clone()
        self.flat.copy_(self.anchor)
        try:
            return fn()
        finally:
            self.flat.copy_(local)

    def anchor_tensors(self) -> dict:
        return {"outer.anchor": self.anchor, "outer.momentum": self.momentum}

    def load_anchor(self, state: dict) -> None:
        self.anchor.copy_(state["outer.anchor"])
        self.momentum.copy_(state["outer.momentum"])


class OuterSteps(Anchored, Strategy):
    """A mesh's diloco axis around this rank's inner strategy (pp, tp, or pp with tp)."""

    def __init__(self, inner: Strategy):
        super().__init__(inner.ctx)
        self.inner, self.H, self.axis = inner, inner.ctx.run.inner_steps, inner.ctx.replica
        self.loss_owner = inner.loss_owner
        self.keep_anchor(inner.params)  # what this rank holds, one buffer its optimizer steps in
        self.clock = 0.0  # seconds of inner steps since the last outer step

    def train_step(self, step: int) -> float | None:
        t0 = time.perf_counter()
        loss = self.inner.train_step(step)  # the replica's mean loss on its slice
        self.clock += time.perf_counter() - t0
        if (step + 1) % self.H == 0 or step + 1 == self.ctx.run.steps:
            self.outer_step(step)
        if loss is None:
            return None
        return loss * self.ctx.loss_tokens(step) / self.ctx.batches.loss_tokens(step)  # its share of the global mean

    def outer_step(self, step: int) -> None:
        """All-reduce the token-weighted pseudo-gradient over the diloco group; the outer update."""
        run, inner = self.ctx.run, range(step - step % self.H, step + 1)
        mine = sum(self.ctx.loss_tokens(s) for s in inner)
        total = sum(self.ctx.batches.loss_tokens(s) for s in inner)
        sent0, t = self.sent_bytes(), time.perf_counter()
        delta = (self.anchor - self.flat).cpu().mul_(mine / total)
        all_reduce_as(self.axis.comm, delta, run.sync_dtype)
        sync_s = time.perf_counter() - t
        delta = delta.to(self.flat.device)
        outer_update(self.anchor, self.momentum, self.flat, delta, run.outer_lr, run.outer_momentum)
        sent = self.sent_bytes() - sent0
        self.ctx.reporter.outer(step, sync_s, sent, 0.0, self.clock + sync_s, digest(self.anchor), mine)
        self.clock = 0.0

    def eval_loss(self, x, y) -> float | None:
        """The inner strategy's held-out loss with the shared weights of the last outer step."""
        return self.at_anchor(lambda: self.inner.eval_loss(x, y))

    def state_tensors(self) -> dict:
        return {**self.inner.state_tensors(), **self.anchor_tensors()}

    def load_state_tensors(self, state: dict) -> None:
        self.inner.load_state_tensors(state)
        self.load_anchor(state)

    def next_step(self, step: int) -> int | None:
        return self.inner.next_step(step)

    def close(self) -> None:
        self.inner.close()
