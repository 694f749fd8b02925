"""pp: pipeline parallelism over M microbatches, GPipe or 1F1B schedule.

Stages are cut as in `mp` (the placement's layer ranges, any count per stage), but
the global batch is split into M microbatches, so stage r can work on microbatch
m while stage r+1 works on m-1. Gradients of all microbatches accumulate before
one optimizer step, so the result is the same as one big batch.

  gpipe: every stage runs all M forwards, then all M backwards. Simple, but holds
         the activations of all M microbatches.
  1f1b:  stage r runs (S - r - 1) warm-up forwards, then alternates one forward
         and one backward, then drains the remaining backwards: at most S
         microbatches in flight. In the steady state a stage both sends to and
         receives from the same neighbour: one Comm.send_recv, both at once. (Ordered
         by parity, even stage sends first, the later stage of a pair held its
         gradient until the next activation had come: a second hand-off per
         microbatch on the critical path, each one a wake-up of both ends, and of a
         tp group's every rank in a pp x tp mesh.)

What crosses the wire, per step and per boundary: each microbatch's boundary
activation forward (b_m*T*hidden*4 bytes, r -> r+1) and its gradient backward
(r+1 -> r): 2*B*T*hidden*4 bytes in all, for any M. The loss lives on the last
stage, which reports it to the controller (not counted as a strategy transfer).
"""

from __future__ import annotations

import torch

from smolnet.errors import UsageError
from smoltrain.models.gpt import loss_sum
from smoltrain.planner.placement import split_batch
from smoltrain.strategies import Context
from smoltrain.strategies.mp import StageStrategy


class PipelineParallel(StageStrategy):
    def __init__(self, ctx: Context):
        super().__init__(ctx)
        if ctx.microbatches > ctx.batch:
            raise UsageError(f"pp: --microbatches {ctx.microbatches} exceeds --batch {ctx.batch}")
        self.mb = split_batch(ctx.batch, [1.0] * ctx.microbatches)

    # --- one microbatch, forward and backward, with the neighbour transfers ---
    def _input(self, m: int) -> torch.Tensor:
        lo, hi = self.mb[m]
        if self.first:
            return self.x[lo:hi]
        return self.recv_from(self.ctx.rank - 1, hi - lo).requires_grad_(True)

    def _forward(self, m: int, inp: torch.Tensor) -> torch.Tensor:
        lo, hi = self.mb[m]
        out = self.stage(inp)
        self.inputs[m] = inp
        if self.last:
            out = loss_sum(out, self.y[lo:hi], self.total)
            self.loss += float(out.item())
        self.outputs[m] = out
        return out

    def _backward(self, m: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        out = self.outputs.pop(m)
        out.backward(grad)
        inp = self.inputs.pop(m)
        return None if self.first else inp.grad

    def _exchange(self, peer: int, send: torch.Tensor, recv_seqs: int) -> torch.Tensor:
        """Send to and receive from the same neighbour at once."""
        got = torch.empty(self.act_shape(recv_seqs), device=self.ctx.device)
        self.ctx.comm.send_recv(send.detach().contiguous(), peer, got, peer)
        return got

    def _seqs(self, m: int) -> int:
        lo, hi = self.mb[m]
        return hi - lo

    # --- schedules ---
    def _gpipe(self) -> None:
        r, M = self.ctx.rank, len(self.mb)
        for m in range(M):
            out = self._forward(m, self._input(m))
            if not self.last:
                self.send_to(out, r + 1)
        for m in range(M):
            grad = None if self.last else self.recv_from(r + 1, self._seqs(m))
            g_in = self._backward(m, grad)
            if not self.first:
                self.send_to(g_in, r - 1)

    def _1f1b(self) -> None:
        r, S, M = self.ctx.rank, self.ctx.world, len(self.mb)
        warmup = min(S - r - 1, M)
        for m in range(warmup):
            out = self._forward(m, self._input(m))
            if not self.last:
                self.send_to(out, r + 1)
        steady = M - warmup
        inp = self._input(warmup) if steady > 0 else None
        for i in range(steady):
            f, b = warmup + i, i  # forward microbatch f, then backward the oldest, b
            out = self._forward(f, inp)
            grad = None if self.last else self._exchange(r + 1, out, self._seqs(b))
            g_in = self._backward(b, grad)
            if i == steady - 1:
                if not self.first:
                    self.send_to(g_in, r - 1)
            elif self.first:
                inp = self._input(f + 1)
            else:
                inp = self._exchange(r - 1, g_in, self._seqs(f + 1)).requires_grad_(True)
        for b in range(steady, M):
            grad = None if self.last else self.recv_from(r + 1, self._seqs(b))
            g_in = self._backward(b, grad)
            if not self.first:
                self.send_to(g_in, r - 1)

    def train_step(self, step: int) -> float | None:
        x, y = self.ctx.strategy_batch(step)  # a mesh's dp replica: its slice
        self.x, self.y = x.to(self.ctx.device), y.to(self.ctx.device)
        self.total = self.ctx.loss_tokens(step)
        self.inputs, self.outputs, self.loss = {}, {}, 0.0
        if self.ctx.schedule == "gpipe" or self.ctx.world == 1:
            self._gpipe()
        else:
            self._1f1b()
        self.apply_update()
        return self.loss if self.loss_owner else None


STRATEGY = PipelineParallel
