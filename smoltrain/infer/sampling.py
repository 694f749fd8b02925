"""Picking the next token: greedy at temperature 0, else temperature and nucleus (top-p) sampling.

Sampling draws from a generator seeded per request, so every tp rank (which sees the
same logits) draws the same token, and a seeded run repeats itself.
"""

from __future__ import annotations

import torch


class Sampler:
    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0):
        if temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        self.temperature, self.top_p = temperature, top_p
        self.gen = torch.Generator().manual_seed(int(seed))

    def __call__(self, logits: torch.Tensor) -> int:
        if self.temperature == 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.top_p < 1.0:
            p, idx = torch.sort(probs, descending=True)
            keep = torch.cumsum(p, 0) - p < self.top_p  # the smallest prefix reaching top_p
            p = torch.where(keep, p, torch.zeros_like(p))
            return int(idx[torch.multinomial(p / p.sum(), 1, generator=self.gen)])
        return int(torch.multinomial(probs, 1, generator=self.gen))
