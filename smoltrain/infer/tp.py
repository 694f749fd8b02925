"""Tensor-parallel decode: every rank runs every layer on its share of heads and MLP columns.

Two all-reduces of the hidden state per layer (after attention, after the MLP), as
the plan counts; embedding and head are replicated, and every rank samples the same
token from the same logits with the same seeded generator, so no token crosses.
"""

from __future__ import annotations

import torch

from smoltrain.infer.engine import Engine, Stop, is_marker


class TensorParallelEngine(Engine):
    armed = False

    def _reduce(self, t):
        t = self.codec.all_reduce(self.comm, t)  # at --wire-dtype (infer.activations)
        if self.armed:  # the first all-reduce of a decode step may carry rank 0's stop marker
            self.armed = False
            if is_marker(t):
                raise Stop
        return t

    def prefill(self, ids, sampler):
        return sampler(self.stage(ids, self._reduce))

    def step(self, tok, sampler):
        self.armed = self.rank != 0
        return sampler(self.stage(torch.tensor([[tok]]), self._reduce))

    def signal_stop(self) -> None:
        self.codec.all_reduce(self.comm, self.marker())
