"""mp: naive model parallelism: consecutive layers on consecutive ranks.

Rank r holds a run of units (rank 0 also the embeddings, the last rank also the
LM head) and only their optimizer state; the run's placement says which layers
(any count per stage, cut by speed and memory). One step with the whole global batch:
  forward:  rank 0 embeds and runs its layers, sends the boundary activation
            (B x T x hidden fp32) straight to rank 1, which runs its layers and
            sends on, ...; the last rank computes the loss;
  backward: the last rank sends the gradient of its input activation to the
            rank before it, and so back to rank 0.
Transfers go peer to peer between neighbours, never through a hub, and only one
rank computes at a time (that idle time is what `pp` removes).

What crosses the wire, per step and per boundary: B*T*hidden*4 bytes forward
(rank r -> r+1) and the same backward (r+1 -> r). The loss lives on the last
rank, which reports it to the controller over the control channel (not a
strategy transfer, so not counted).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from smoltrain.models.gpt import loss_sum
from smoltrain.models.optim import make_optimizer
from smoltrain.strategies import Context, Strategy, targets, trainable


class StageStrategy(Strategy):
    """Shared by mp and pp: this rank's units, optimizer, and neighbour sends."""

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        full = ctx.build_model()
        self.first, self.last = ctx.rank == 0, ctx.rank == ctx.world - 1
        lo, hi = ctx.layer_range()  # the placement's cut (uneven by speed, or as even as it goes)
        units = [full.units[i] for i in range(0 if self.first else lo + 1, hi + 1 + (1 if self.last else 0))]
        if ctx.tp is not None:  # a mesh's tp axis inside the stage: its blocks are tp slices
            from smoltrain.strategies.tp import split_blocks

            units = split_blocks(units, full, *ctx.head_range(ctx.tp), ctx.tp.comm, ctx.tp.index == 0)
        self.stage = nn.Sequential(*units).to(ctx.device)
        self.loss_owner = self.last and (ctx.tp is None or ctx.tp.index == 0)  # tp: its rank 0 reports
        self.params = trainable(self.stage)
        self.opt = make_optimizer(ctx.run.optimizer, self.params, ctx.lr)

    def act_shape(self, n_seq: int) -> tuple[int, int, int]:
        return (n_seq, self.ctx.seq, self.ctx.spec.hidden)

    def recv_from(self, src: int, n_seq: int) -> torch.Tensor:
        t = torch.empty(self.act_shape(n_seq), device=self.ctx.device)
        self.ctx.comm.recv(t, src)
        return t

    def send_to(self, t: torch.Tensor, dst: int) -> None:
        self.ctx.comm.send(t.detach().contiguous(), dst)

    def apply_update(self) -> None:
        if self.ctx.tp is not None:
            from smoltrain.strategies.tp import sum_partial_grads

            sum_partial_grads(self.stage, self.ctx.tp.comm)
        self.ctx.sync_replicas(self.params)  # a mesh's dp axis: sum over the replicas
        with self.ctx.update_timer or contextlib.nullcontext():  # stages update in parallel: timed apart
            self.opt.step([p.grad for p in self.params])
            for p in self.params:
                p.grad = None

    def eval_loss(self, x, y) -> float | None:
        """The held-out batch down the chain of stages, forward only; the last stage answers
        (of replica 0 in a mesh)."""
        if self.ctx.replica is not None and self.ctx.replica.index:
            return None
        with torch.no_grad():
            out = self.stage(x if self.first else self.recv_from(self.ctx.rank - 1, x.shape[0]))
            if not self.last:
                self.send_to(out, self.ctx.rank + 1)
                return None
            loss = float(loss_sum(out, y, targets(y)))
            return loss if self.loss_owner else None

    def state_tensors(self) -> dict:
        st = {f"param.{n}": p.detach() for n, p in self.stage.named_parameters() if p.requires_grad}
        st.update(self.opt.state_tensors())
        return st

    def load_state_tensors(self, state: dict) -> None:
        with torch.no_grad():
            for n, p in self.stage.named_parameters():
                if p.requires_grad:
                    p.copy_(state[f"param.{n}"])
        self.opt.load_state_tensors(state)


class ModelParallel(StageStrategy):
    def train_step(self, step: int) -> float | None:
        r, b = self.ctx.rank, self.ctx.batch
        x, y = self.ctx.strategy_batch(step)  # a mesh's dp replica: its slice
        x, y = x.to(self.ctx.device), y.to(self.ctx.device)
        inp = x if self.first else self.recv_from(r - 1, b).requires_grad_(True)
        out = self.stage(inp)
        if self.last:
            loss = loss_sum(out, y, self.ctx.loss_tokens(step))
            loss.backward()
        else:
            self.send_to(out, r + 1)
            grad = self.recv_from(r + 1, b)
            out.backward(grad)
        if not self.first:
            self.send_to(inp.grad, r - 1)
        self.apply_update()
        return float(loss.item()) if self.loss_owner else None


STRATEGY = ModelParallel
