"""Activations on the wire in inference (`--wire-dtype`): pipeline hops and tp all-reduces.

`fp32`, `bf16`, `fp16`: the hidden state cast to that dtype. `int8`: per token, the
largest magnitude scales the row to [-127, 127] (like llama.cpp's Q8_0 buffers, with one
fp32 scale per token instead of per 32 values): hidden + 4 bytes a token, a quarter of
fp32. A tp all-reduce at int8 cannot sum on the wire (every rank has its own scales), so
each rank all-gathers the others' int8 contributions and adds them up in fp32 in rank
order: every rank gets the same bits, and each sends (N-1) x (hidden + 4) bytes per
reduce where a ring all-reduce at fp32 sends 2(N-1)/N x 4 x hidden.

Rank 0's stop marker (NaNs) survives every encoding: NaN in bf16/fp16, and at int8 a NaN
scale, which turns the whole decoded row into NaN.
"""

from __future__ import annotations

import torch

from smoltrain.planner.widths import wire_bytes

TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Codec:
    def __init__(self, wire: str, hidden: int, dtype, device="cpu"):
        self.wire, self.hidden, self.dtype, self.device = wire, hidden, dtype, torch.device(device)

    def nbytes(self, tokens: int) -> int:
        return tokens * wire_bytes(self.hidden, self.wire)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [1, T, hidden] -> what crosses the wire (a CPU tensor)."""
        if self.wire != "int8":
            return x.to(TORCH[self.wire]).cpu().contiguous()
        rows = x.reshape(-1, self.hidden).float().cpu()
        scale = rows.abs().amax(dim=1) / 127
        scale = scale.masked_fill(scale == 0, 1.0)  # an all-zero row; a NaN (the stop marker) stays NaN
        q = torch.round(rows / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return torch.cat([q.reshape(-1).view(torch.uint8), scale.view(torch.uint8)])

    def buffer(self, tokens: int) -> torch.Tensor:
        """An empty tensor to receive `tokens` tokens' encoding into."""
        if self.wire != "int8":
            return torch.empty(1, tokens, self.hidden, dtype=TORCH[self.wire])
        return torch.empty(self.nbytes(tokens), dtype=torch.uint8)

    def decode(self, buf: torch.Tensor) -> torch.Tensor:
        """The encoding -> [1, T, hidden] at the compute dtype, on the compute device."""
        if self.wire != "int8":
            return buf.to(self.device, self.dtype).reshape(1, -1, self.hidden)
        return self._rows(buf).to(self.device, self.dtype)[None]

    def _rows(self, buf: torch.Tensor) -> torch.Tensor:
        """An int8 encoding -> fp32 [T, hidden] on the CPU."""
        tokens = buf.numel() // (self.hidden + 4)
        q = buf[: tokens * self.hidden].view(torch.int8).reshape(tokens, self.hidden)
        return q.float() * buf[tokens * self.hidden :].view(torch.float32)[:, None]

    def all_reduce(self, comm, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of x [rows, T, hidden], crossing the wire at this codec's dtype."""
        if self.wire != "int8":
            t = self.encode(x)
            comm.all_reduce(t)
            return t.to(self.device, self.dtype)
        mine = self.encode(x)
        n = mine.numel()
        out = torch.empty(comm.world_size * n, dtype=torch.uint8)
        comm.all_gather(out, mine)
        total = torch.zeros(x.numel() // self.hidden, self.hidden)  # every row of a batch
        for r in range(comm.world_size):
            total += self._rows(out[r * n : (r + 1) * n])
        return total.to(self.device, self.dtype).reshape(x.shape)
