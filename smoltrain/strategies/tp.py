"""tp: Megatron tensor parallelism: column- and row-parallel attention and MLP.

Every rank sees the whole global batch and holds every layer, but only 1/N of
each block's matrices:
  attention: q, k, v are column-parallel (rank r computes its heads, a
             contiguous range the placement sizes by speed, H/N each when even,
             in full); the output projection is row-parallel
             (rank r multiplies its heads' slice of the input dimension);
  MLP:       fc is column-parallel (hidden units in the heads' proportion), proj row-parallel.
A row-parallel product leaves each rank with a partial sum of the output, so:
  g = all-reduce forward, identity backward (after each row-parallel layer);
  f = identity forward, all-reduce backward (before each column-parallel layer),
because the input gradient of a column-parallel layer is likewise a partial sum.

What crosses the wire: per layer 2 all-reduces (sum) of the activations forward
(attention out, MLP out) and 2 of their gradients backward (the f's before
attention and MLP), each of B*T*hidden*4 bytes, so every rank sends
4 * 2(N-1)/N * B*T*hidden*4 bytes per layer per step. The embeddings, LayerNorms
and LM head are replicated: their inputs and incoming gradients are identical on
every rank, so their gradients are too and nothing else crosses.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from smoltrain.models.gpt import MLP, Attention, loss_sum
from smoltrain.models.optim import make_optimizer
from smoltrain.strategies import Context, Strategy, mean_loss, trainable


class _AllReduceBackward(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, op="sum")
        return grad, None


class _AllReduceForward(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, comm):
        x = x.contiguous().clone()
        comm.all_reduce(x, op="sum")
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ParallelBlock(nn.Module):
    """A transformer block holding rank r's slice of attention heads and MLP units."""

    def __init__(self, full, heads: tuple[int, int], ffn: tuple[int, int], comm):
        super().__init__()
        self.comm = comm
        self.ln1, self.ln2 = full.ln1, full.ln2
        a = full.attn
        cols = slice(heads[0] * a.head_dim, heads[1] * a.head_dim)
        self.attn = Attention(a.q.in_features, heads[1] - heads[0], a.head_dim)
        units = slice(*ffn)
        self.mlp = MLP(full.mlp.fc.in_features, ffn[1] - ffn[0])
        with torch.no_grad():
            for name in ("q", "k", "v"):  # column-parallel: output rows
                getattr(self.attn, name).weight.copy_(getattr(a, name).weight[cols])
            self.attn.out.weight.copy_(a.out.weight[:, cols])  # row-parallel: input columns
            self.mlp.fc.weight.copy_(full.mlp.fc.weight[units])
            self.mlp.proj.weight.copy_(full.mlp.proj.weight[:, units])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _AllReduceBackward.apply(self.ln1(x), self.comm)
        x = x + _AllReduceForward.apply(self.attn(h), self.comm)
        h = _AllReduceBackward.apply(self.ln2(x), self.comm)
        return x + _AllReduceForward.apply(self.mlp(h), self.comm)


class TensorParallel(Strategy):
    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.loss_owner = ctx.rank == 0  # every rank computes the same loss; one reports it
        full = ctx.build_model()
        units = list(full.units)
        if ctx.world > 1:
            heads, ffn = ctx.head_range()  # the placement's split: uneven by speed, whole KV groups
            units = [units[0]] + [self._split(b, heads, ffn) for b in units[1:-1]] + [units[-1]]
        self.model = nn.Sequential(*units).to(ctx.device)
        self.params = trainable(self.model)
        self.opt = make_optimizer(ctx.run.optimizer, self.params, ctx.lr)

    def _split(self, block, heads, ffn):
        return split_block(block, heads, ffn, self.ctx.comm, keep_bias=self.ctx.rank == 0)

    def train_step(self, step: int) -> float | None:
        x, y = self.ctx.strategy_batch(step)  # a mesh's dp replica: its slice
        x, y = x.to(self.ctx.device), y.to(self.ctx.device)
        loss = loss_sum(self.model(x), y, self.ctx.loss_tokens(step))
        loss.backward()
        sum_partial_grads(self.model, self.ctx.comm)
        self.ctx.sync_replicas(self.params)  # a mesh's dp axis: sum over the replicas
        self.opt.step([p.grad for p in self.params])
        for p in self.params:
            p.grad = None
        return float(loss.item()) if self.loss_owner else None

    def eval_loss(self, x, y) -> float | None:
        """Every rank runs the split forward (its all-reduces); rank 0 answers (of replica 0 in a mesh)."""
        if self.ctx.replica is not None and self.ctx.replica.index:
            return None
        loss = mean_loss(self.model, x, y)
        return loss if self.loss_owner else None


def split_block(block, heads, ffn, comm, keep_bias: bool):
    """Rank's tp slice of a block; a Hugging Face block slices itself (models.causal: its biases
    once, where keep_bias). Also pp x tp's stages (a mesh) split their blocks with it."""
    if not hasattr(block, "sized"):  # the built-in GPT's block (models.blocks.Block's tp_slice needs `sized`)
        return ParallelBlock(block, heads, ffn, comm)
    enter, leave = (lambda t: _AllReduceBackward.apply(t, comm)), (lambda t: _AllReduceForward.apply(t, comm))
    return block.tp_slice(heads, ffn, enter, leave, keep_bias=keep_bias)


def split_blocks(units, full, heads, ffn, comm, keep_bias: bool) -> list:
    """`units` (some of full.units) with each block replaced by its tp slice, the embeddings and
    head kept whole: how a mesh's tp axis enters pp's stages and fsdp's units."""
    ends = {id(full.units[0]), id(full.units[-1])}
    return [u if id(u) in ends else split_block(u, heads, ffn, comm, keep_bias) for u in units]


def sum_partial_grads(units, comm) -> None:
    """Weights every rank holds whole but each uses with its own heads only (Qwen3's q/k norms,
    the uncut factor of a LoRA adapter): their gradients are partial sums, all-reduced in one
    buffer (the plan counts the q/k norms'; the planner does not know LoRA yet)."""
    partial = [p for b in units for p in getattr(b, "partial_grads", []) if p.requires_grad]
    if not partial:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in partial])
    comm.all_reduce(flat, op="sum")
    off = 0
    for p in partial:
        p.grad.copy_(flat[off : off + p.numel()].view_as(p))
        off += p.numel()


STRATEGY = TensorParallel
