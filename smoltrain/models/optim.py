"""The optimizers (`--optimizer adamw|sgd`), element by element the same whatever the tensor
layout.

Strategies hold parameters differently (whole tensors, flat shards, a parameter
server's flat buffer); because every operation here is elementwise, all of them
apply the same update to the same parameter value. AdamW runs torch's fused kernel
(`torch._fused_adamw_`, what `torch.optim.AdamW(fused=True)` calls): one pass over each
tensor instead of the ~8 of separate elementwise operations, 3.7x faster on a 135M model's
update, which every step of every rank pays whatever its batch (BENCHMARKS.md,
fine-tuning). The kernel walks memory in order, so it is given contiguous tensors only.
The state is plain tensors, so checkpoints are state dicts and nothing else. `sgd` is
plain SGD (no momentum): the reference DiLoCo's check runs against (`diloco
--inner-steps 1` follows `dp`).
"""

from __future__ import annotations

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
        if not all(p.is_contiguous() for p in self.params):
            raise ValueError("AdamW updates contiguous tensors only (the fused kernel walks memory in order)")
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        self.step_count = 0
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor]) -> None:
        """p *= 1 - lr*wd; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
        p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps): torch.optim.AdamW's update."""
        self.step_count += 1
        if not self.params:
            return
        grads = [g.contiguous() for g in grads]  # a strided gradient would be read in the wrong order
        at = {p.device: torch.tensor(float(self.step_count), device=p.device) for p in self.params}
        steps = [at[p.device] for p in self.params]  # read, not written, by the kernel
        b1, b2 = self.betas
        torch._fused_adamw_(
            self.params, grads, self.m, self.v, [], steps,
            lr=self.lr, beta1=b1, beta2=b2, weight_decay=self.wd, eps=self.eps, amsgrad=False, maximize=False,
        )  # fmt: skip

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
