"""fsdp: fully sharded data parallel (ZeRO-3): parameters, gradients and optimizer state sharded.

The model is cut into units (the embeddings, each block, the head). Each unit's
parameters are flattened into one buffer, padded with zeros to a multiple of N
elements, and cut into N equal shards: rank r keeps only shard r of the
parameters and of the AdamW moments, about 1/N of dp's memory.

One step, per unit, in this order:
  forward:   all-gather the unit's parameters, run it (no autograd), keep only
             the unit's input activation, drop the gathered parameters;
  backward:  (last unit first) all-gather the parameters again, recompute the
             unit from its saved input with autograd, backpropagate the incoming
             gradient, reduce-scatter (sum) the parameter gradients so rank r gets
             the summed gradient of its shard, drop the gathered parameters;
  update:    AdamW on the local shard only.

What crosses the wire, per step and per rank, with U = padded parameter count:
all-gather forward (N-1)/N*U*4 bytes, all-gather backward (N-1)/N*U*4 bytes,
reduce-scatter (N-1)/N*U*4 bytes: 3(N-1)/N of the (padded) fp32 parameter bytes,
1.5x dp. Padding is at most N-1 elements per unit. Each rank trains on its slice
of the global batch, and losses are shares of the global mean, as in dp.
"""

from __future__ import annotations

import torch

from smoltrain.models.gpt import loss_sum
from smoltrain.models.optim import make_optimizer
from smoltrain.strategies import Context, Strategy, targets


class ShardedUnit:
    """One unit: the module (parameters empty between uses) and this rank's shard."""

    def __init__(self, module: torch.nn.Module, rank: int, world: int, comm, device):
        self.module, self.comm, self.world, self.device = module.to(device), comm, world, device
        self.params = list(module.parameters())
        self.shapes = [p.shape for p in self.params]
        self.numel = sum(p.numel() for p in self.params)
        self.padded = -(-self.numel // world) * world
        self.shard_numel = self.padded // world
        flat = torch.zeros(self.padded, device=device)
        flat[: self.numel] = torch.cat([p.detach().reshape(-1) for p in self.params])
        self.shard = flat[rank * self.shard_numel : (rank + 1) * self.shard_numel].clone()
        self.grad_shard = torch.zeros_like(self.shard)
        self.free()

    def gather(self) -> None:
        full = torch.empty(self.padded, device=self.device)
        if self.world > 1:
            self.comm.all_gather(full, self.shard)
        else:
            full.copy_(self.shard)
        off = 0
        for p, shape in zip(self.params, self.shapes):
            n = shape.numel()
            p.data = full[off : off + n].view(shape)
            off += n

    def free(self) -> None:
        for p in self.params:
            p.data = torch.empty(0, device=self.device)
            p.grad = None

    def reduce_grads(self) -> None:
        flat = torch.zeros(self.padded, device=self.device)
        flat[: self.numel] = torch.cat([p.grad.reshape(-1) for p in self.params])
        if self.world > 1:
            self.comm.reduce_scatter(self.grad_shard, flat, op="sum")
        else:
            self.grad_shard.copy_(flat)


class FullyShardedDataParallel(Strategy):
    def __init__(self, ctx: Context):
        super().__init__(ctx)
        model = ctx.build_model()
        units = list(model.units)
        self.loss_owner = ctx.tp is None or ctx.tp.index == 0  # a mesh's tp axis: its rank 0 reports
        if ctx.tp is not None:  # fsdp x tp: each block a tp slice, the slices sharded over fsdp
            from smoltrain.strategies.tp import split_blocks

            units = split_blocks(units, model, *ctx.head_range(ctx.tp), ctx.tp.comm, ctx.tp.index == 0)
        self.units = [ShardedUnit(u, ctx.rank, ctx.world, ctx.comm, ctx.device) for u in units]
        self.opt = make_optimizer(ctx.run.optimizer, [u.shard for u in self.units], ctx.lr)
        self.lo, self.hi = ctx.batch_range()  # uneven by the placement; shards stay even

    def train_step(self, step: int) -> float | None:
        x, y = self.ctx.batches.slice(step, self.lo, self.hi)
        x, y = x.to(self.ctx.device), y.to(self.ctx.device)
        acts = [x]
        with torch.no_grad():
            for u in self.units:
                u.gather()
                acts.append(u.module(acts[-1]))
                u.free()
        loss_value, grad = 0.0, None
        for i in reversed(range(len(self.units))):
            u = self.units[i]
            u.gather()
            inp = acts[i] if i == 0 else acts[i].detach().requires_grad_(True)
            out = u.module(inp)
            if i == len(self.units) - 1:
                loss = loss_sum(out, y, self.ctx.loss_tokens(step))
                loss.backward()
                loss_value = float(loss.item())
            else:
                out.backward(grad)
            if self.ctx.tp is not None:
                from smoltrain.strategies.tp import sum_partial_grads

                sum_partial_grads([u.module], self.ctx.tp.comm)
            grad = inp.grad if i > 0 else None
            u.reduce_grads()
            u.free()
            acts[i + 1] = None
        self.opt.step([u.grad_shard for u in self.units])
        return loss_value if self.loss_owner else None

    def eval_loss(self, x, y) -> float | None:
        """Every rank gathers each unit in turn, as in forward, and runs its slice of the
        held-out batch; its share of the mean adds up with the others' at the controller."""
        h = x[self.lo : self.hi]
        with torch.no_grad():
            for u in self.units:
                u.gather()
                h = u.module(h)
                u.free()
            loss = float(loss_sum(h, y[self.lo : self.hi], targets(y)))
            return loss if self.loss_owner else None

    def state_tensors(self) -> dict:
        st = {f"shard.{i}": u.shard for i, u in enumerate(self.units)}
        st.update(self.opt.state_tensors())
        return st

    def load_state_tensors(self, state: dict) -> None:
        for i, u in enumerate(self.units):
            u.shard.copy_(state[f"shard.{i}"])
        self.opt.load_state_tensors(state)


STRATEGY = FullyShardedDataParallel
