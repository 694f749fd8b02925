"""The optimizers (`--optimizer adamw|sgd`), written out, element by element the same
whatever the tensor layout.

Strategies hold parameters differently (whole tensors, flat shards, a parameter
server's flat buffer); because every operation here is elementwise, all of them
apply the same update to the same parameter value. The state is plain tensors, so
checkpoints are state dicts and nothing else. `sgd` is plain SGD (no momentum): the
reference DiLoCo's check runs against (`diloco --inner-steps 1` follows `dp`).
"""

from __future__ import annotations

import math

import torch


class AdamW:
    def __init__(
        self,
        params: list[torch.Tensor],
        lr: float = 1e-3,
        betas=(0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        self.params = list(params)
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        self.step_count = 0
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor]) -> None:
        self.step_count += 1
        b1, b2 = self.betas
        bc1 = 1 - b1**self.step_count
        bc2_sqrt = math.sqrt(1 - b2**self.step_count)
        for p, g, m, v in zip(self.params, grads, self.m, self.v):
            if self.wd:
                p.mul_(1 - self.lr * self.wd)
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v.sqrt() / bc2_sqrt).add_(self.eps)
            p.addcdiv_(m, denom, value=-self.lr / bc1)

    def state_tensors(self, prefix: str = "opt") -> dict[str, torch.Tensor]:
        out = {f"{prefix}.step": torch.tensor([self.step_count], dtype=torch.int64)}
        for i, (m, v) in enumerate(zip(self.m, self.v)):
            out[f"{prefix}.{i}.m"] = m
            out[f"{prefix}.{i}.v"] = v
        return out

    def load_state_tensors(self, state: dict[str, torch.Tensor], prefix: str = "opt") -> None:
        self.step_count = int(state[f"{prefix}.step"][0])
        for i, (m, v) in enumerate(zip(self.m, self.v)):
            m.copy_(state[f"{prefix}.{i}.m"])
            v.copy_(state[f"{prefix}.{i}.v"])


class SGD:
    """p -= lr * g; nothing kept between steps but the step count."""

    def __init__(self, params: list[torch.Tensor], lr: float = 1e-3):
        self.params, self.lr, self.step_count = list(params), lr, 0

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor]) -> None:
        self.step_count += 1
        for p, g in zip(self.params, grads):
            p.add_(g, alpha=-self.lr)

    def state_tensors(self, prefix: str = "opt") -> dict[str, torch.Tensor]:
        return {f"{prefix}.step": torch.tensor([self.step_count], dtype=torch.int64)}

    def load_state_tensors(self, state: dict[str, torch.Tensor], prefix: str = "opt") -> None:
        self.step_count = int(state[f"{prefix}.step"][0])


OPTIMIZERS = {"adamw": AdamW, "sgd": SGD}


def make_optimizer(name: str, params: list[torch.Tensor], lr: float):
    """The run's `--optimizer` over these parameters (names checked before the run starts)."""
    return OPTIMIZERS[name](params, lr=lr)
