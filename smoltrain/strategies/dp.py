"""dp: data parallel, ring all-reduce of gradients in buckets, overlapped with backward.

Every rank holds the whole model and optimizer and trains on its slice of the
global batch (the placement makes slices uneven: a slow host gets fewer sequences).
Each rank's loss is its sum of token losses divided by the *global* token count,
so summing gradients over ranks gives exactly the gradient of the global mean
loss, whatever the shares.

What crosses the wire, per step: the gradients, once, as a ring all-reduce
(sum). Parameters are grouped into buckets of about `bucket_mb` (last layers
first, the order backward produces them); a bucket is handed to a background
thread the moment its last gradient is accumulated, so the all-reduce of the late
layers runs while autograd still computes the early ones. Buckets are reduced in
a fixed order on every rank. Each rank sends 2(N-1)/N of the gradient bytes
(4 bytes per parameter in fp32) per step; nothing else crosses. The step's
comm_s is the time spent inside those all-reduces, most of it hidden behind
backward, so comm_s + compute can exceed step_s.

That overlap needs a core the rank's torch threads leave free (host.spare_core, the
plan's `comm_core`). Without one the transport's thread and backward take turns on
the same core, and the buckets go after backward instead, on the main thread: on the
whole-core sim (one core per host) overlapped steps measured 0.99-1.26x their plan and
reduced-after steps 0.97-1.05x, 5-20% faster (BENCHMARKS.md).
"""

from __future__ import annotations

import threading

import torch

from smoltrain.host import spare_core
from smoltrain.models.gpt import loss_sum
from smoltrain.models.optim import make_optimizer
from smoltrain.strategies import Context, Strategy, trainable

WAIT_S = 120.0  # no bucket wait is unbounded


class Bucket:
    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.flat = torch.zeros(sum(p.numel() for p in params), device=params[0].device)
        self.ready = threading.Event()
        self.done = threading.Event()
        self.pending = len(params)


class DataParallel(Strategy):
    def __init__(self, ctx: Context, bucket_mb: float = 1.0, overlap: bool | None = None):
        """`overlap`: reduce buckets during backward (None: where a core is spare for it)."""
        super().__init__(ctx)
        self.model = ctx.build_model().to(ctx.device)
        self.params = trainable(self.model)
        self.opt = make_optimizer(ctx.run.optimizer, self.params, ctx.lr)
        self.lo, self.hi = ctx.batch_range()
        # Buckets in reverse parameter order: roughly the order backward finishes them.
        self.buckets, cur, size = [], [], 0
        for p in reversed(self.params):
            cur.append(p)
            size += p.numel() * 4
            if size >= bucket_mb * 1e6:
                self.buckets.append(Bucket(cur))
                cur, size = [], 0
        if cur:
            self.buckets.append(Bucket(cur))
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.error: BaseException | None = None
        self.overlap = ctx.world > 1 and (spare_core(torch.get_num_threads()) if overlap is None else overlap)
        if self.overlap:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, p: torch.Tensor) -> None:
        b = self.bucket_of[id(p)]
        b.pending -= 1
        if b.pending == 0:
            torch.cat([q.grad.reshape(-1) for q in b.params], out=b.flat)
            b.ready.set()

    def _reduce_buckets(self) -> None:
        """Background thread: all-reduce bucket 0, 1, ... as each becomes ready."""
        try:
            for b in self.buckets:
                if not b.ready.wait(WAIT_S):
                    raise TimeoutError("a gradient bucket never became ready")
                self.ctx.comm.all_reduce(b.flat, op="sum")
                b.done.set()
        except BaseException as e:  # reported by the main thread
            self.error = e
            for b in self.buckets:
                b.done.set()

    def train_step(self, step: int) -> float:
        x, y = self.ctx.batches.slice(step, self.lo, self.hi)
        x, y = x.to(self.ctx.device), y.to(self.ctx.device)
        for b in self.buckets:
            b.pending = len(b.params)
            b.ready.clear()
            b.done.clear()
        worker = None
        if self.overlap:
            worker = threading.Thread(target=self._reduce_buckets, daemon=True)
            worker.start()
        loss = loss_sum(self.model(x), y, self.ctx.loss_tokens(step))
        loss.backward()
        if worker is not None:
            worker.join(WAIT_S)
            if self.error or worker.is_alive():
                raise self.error or TimeoutError("gradient all-reduce did not finish")
        elif self.ctx.world > 1:  # no core to spare: the same buckets, in the same order, now
            for b in self.buckets:
                torch.cat([q.grad.reshape(-1) for q in b.params], out=b.flat)
                self.ctx.comm.all_reduce(b.flat, op="sum")
        if self.ctx.world > 1:
            for b in self.buckets:  # copy the summed gradients back
                off = 0
                for p in b.params:
                    p.grad.copy_(b.flat[off : off + p.numel()].view_as(p))
                    off += p.numel()
        self.opt.step([p.grad for p in self.params])
        for p in self.params:
            p.grad = None
        return float(loss.item())


STRATEGY = DataParallel
