"""diloco: low-communication data parallel (DiLoCo, Douillard et al. 2023).

Every rank holds the whole model and trains it alone on its slice of each global batch
with the inner optimizer (`--optimizer`, AdamW by default, at `--lr`). Every H inner
steps (`--inner-steps`; one outer step) the ranks average their pseudo-gradients

    delta_r = anchor - local weights_r        (anchor: the weights of the last outer step)

weighted by the tokens each rank trained on since, with one ring all-reduce, and every
rank applies the same outer step to the anchor: SGD with Nesterov momentum

    m <- mu * m + delta;   anchor <- anchor - outer_lr * (delta + mu * m);   weights <- anchor

(`--outer-lr`, `--outer-momentum`; strategies.outer). The all-reduce hands every rank the
same bits, so all hold bit-identical weights after each outer step. The inner optimizer's
state stays local. With H = 1, plain SGD, outer lr 1 and momentum 0 this is exactly `dp`.
On a mesh (`--mesh diloco=2,pp=2`) each diloco worker is a whole pipeline or tp group
instead: strategies.outer.OuterSteps, with fixed members and even shares.

What crosses the wire, per outer step: one ring all-reduce of the parameters in
`--sync-dtype` (fp32, bf16, fp16, or int8 with one fp32 scale per 1024 elements,
smoltrain.comm.quantized), 2(N-1)/N of their bytes from each rank; nothing between.
planner.diloco counts the same bytes and picks H from the links.

Membership and shares are decided at each outer step (strategies.roster, which says how): a
rank that died is dropped there (`leave`) and the rest rebuild their ring; a newcomer is
admitted there (`join`) and gets the shared state. Unequal hosts: each rank trains its
placement's share of every batch, so all end their H inner steps together; under
`--placement auto` the shares are counted over the outer step's H batches rather than each
batch, the first outer step's from the plan's compute (whole sequences per batch can leave a
host behind by a second a step, minutes at a large H), and the roster re-balances them at every
outer step from each rank's measured pace (a calibration a few percent off, or a host slowed by
other work, would otherwise keep the rest waiting every outer step).
"""

from __future__ import annotations

import time

import torch

from smoltrain.comm.quantized import all_reduce_as
from smoltrain.models.gpt import loss_sum
from smoltrain.models.optim import make_optimizer
from smoltrain.planner.pacing import paced_counts, placed_paces
from smoltrain.strategies import Context, Strategy, mean_loss, targets, trainable
from smoltrain.strategies.outer import Anchored, digest, outer_update
from smoltrain.strategies.roster import Member, Ring, Roster, member_timeout, slices


class DiLoCo(Anchored, Strategy):
    def __init__(self, ctx: Context):
        super().__init__(ctx)
        run = ctx.run
        self.H, self.steps = run.inner_steps, run.steps
        self.model = ctx.build_model().to(ctx.device)
        self.params = trainable(self.model)
        self.keep_anchor(self.params)  # the trained weights (LoRA: the adapters) as one buffer
        self.opt = make_optimizer(run.optimizer, self.params, ctx.lr)  # inner, never shared
        self.joiner = ctx.rank < 0
        self.lo, self.hi = (0, 0) if self.joiner else ctx.batch_range()
        self.share = 0.0 if self.joiner else (self.hi - self.lo) / ctx.batch  # of the batch, from this step on
        self.weight = self.share  # the part of the batch the last reported loss stands for (Reporter.step)
        self.plan: list[tuple[int, int]] | None = None  # (lo, hi) per inner step of this outer step, when paced
        if not self.joiner:
            self.pace_first_outer_step(run.start_step)
        self.tokens = 0  # trained on since the last outer step
        self.clock = 0.0  # seconds of inner steps since the last outer step
        self.ring = Ring(ctx)  # this outer step's all-reduce group, and the bytes sent so far
        self.roster = Roster(ctx, ctx.world, (run.steps - 1) // self.H) if ctx.rank == 0 else None
        order = ctx.rank if ctx.rank >= 0 else 1 << 20
        self.member = Member(run, ctx.secret, ctx.name, order, timeout=member_timeout(run))

    def pace_first_outer_step(self, start: int) -> None:
        """Under `--placement auto`, the first outer step laid out by the plan's paces
        (planner.pacing, as the plan predicts it), alike on every rank, so all end its H inner steps together."""
        names, outer = list(self.ctx.run.names), start // self.H
        got = paced_counts(
            placed_paces(self.ctx.run.placement, self.ctx.batch), names, self.step_of(outer) + 1 - start, self.ctx.batch
        )
        if got is not None and start % self.H == 0:
            self.plan, self.lo, self.hi = slices({"names": names, "paced": got}, self.ctx.batch, self.ctx.name)
            self.share = (self.hi - self.lo) / self.ctx.batch

    # --- the loop ---
    def next_step(self, step: int) -> int | None:
        if self.joiner and self.ring.comm is None:  # wait for the outer step that admits this rank
            with self.ctx.wait_timer:
                roster = self.member.admitted(timeout=None)
            if roster is None:
                return None
            self.outer_step(roster["outer"], roster)
            step = min((roster["outer"] + 1) * self.H, self.steps)
        return step if step < self.steps else None

    def train_step(self, step: int) -> float:
        t0 = time.perf_counter()
        if self.plan is not None and 0 <= step % self.H < len(self.plan):  # paced: this step's slice
            self.lo, self.hi = self.plan[step % self.H]
            self.share = (self.hi - self.lo) / self.ctx.batch
        loss_value, self.weight = 0.0, self.share
        if self.hi > self.lo:
            x, y = self.ctx.batches.slice(step, self.lo, self.hi)
            x, y = x.to(self.ctx.device), y.to(self.ctx.device)
            loss = loss_sum(self.model(x), y, targets(y))  # the mean over this rank's own tokens
            loss.backward()
            self.opt.step([p.grad for p in self.params])
            for p in self.params:
                p.grad = None
            loss_value = float(loss.item())
            self.tokens += targets(y)
        self.clock += time.perf_counter() - t0
        if (step + 1) % self.H == 0 or step + 1 == self.steps:
            self.outer_step(step // self.H)
        return loss_value * self.weight

    # --- one outer step: who is in, the all-reduce, the outer update ---
    def outer_step(self, outer: int, roster: dict | None = None) -> None:
        t_in, sent0 = time.perf_counter(), self.sent_bytes()
        log = lambda text: self.ctx.reporter.log(f"{self.ctx.name}: {text}")  # noqa: E731
        delta, waited, sync_s = self.member.outer_step(
            outer, self.tokens, self.clock, self.regroup, self.ring, log, roster
        )
        # the wait at the sync for late peers is neither compute nor communication (run/timings.py);
        # the all-reduce, the commit round and any redo are communication
        self.ctx.wait_timer.add(waited)
        self.ctx.comm_timer.add(time.perf_counter() - t_in - waited)
        outer_update(self.anchor, self.momentum, self.flat, delta, self.ctx.run.outer_lr, self.ctx.run.outer_momentum)
        seconds = self.clock + time.perf_counter() - t_in  # this rank's inner steps and the sync
        self.ctx.reporter.outer(
            self.step_of(outer), sync_s, self.sent_bytes() - sent0, waited, seconds, digest(self.anchor), self.tokens
        )
        self.tokens, self.clock = 0, 0.0

    def step_of(self, outer: int) -> int:
        return min((outer + 1) * self.H, self.steps) - 1

    def regroup(self, roster: dict) -> torch.Tensor:
        """Join this outer step's ring, bring newcomers the shared state, and all-reduce the
        token-weighted pseudo-gradient; returns the average."""
        self.ring.join(roster)
        group = self.ring.comm
        self.plan, self.lo, self.hi = slices(roster, self.ctx.batch, self.ctx.name)
        if roster["joined"] and group is not None:  # newcomers start from the shared state
            shared = torch.cat([self.anchor, self.momentum]).cpu()
            group.broadcast(shared, 0)
            if self.ctx.name in roster["joined"]:
                self.anchor.copy_(shared[: self.flat.numel()])
                self.momentum.copy_(shared[self.flat.numel() :])
                self.flat.copy_(self.anchor)
        delta = (self.anchor - self.flat).cpu()
        delta.mul_(self.tokens / roster["tokens"] if roster["tokens"] else 0.0)
        if group is not None:
            all_reduce_as(group, delta, self.ctx.run.sync_dtype)
        self.share = (self.hi - self.lo) / self.ctx.batch
        return delta.to(self.flat.device)

    # --- what the runner asks ---
    def eval_loss(self, x, y) -> float:
        """This rank's slice of the held-out batch (the slice it trains on, so the work
        follows each host's speed), with the shared weights of the last outer step."""
        return self.at_anchor(lambda: mean_loss(self.model, x[self.lo : self.hi], y[self.lo : self.hi], targets(y)))

    def state_tensors(self) -> dict:
        return {**super().state_tensors(), **self.anchor_tensors()}

    def load_state_tensors(self, state: dict) -> None:
        super().load_state_tensors(state)
        self.load_anchor(state)

    def sent_bytes(self) -> int:
        return self.ring.sent_bytes()

    def link_bytes(self) -> list[tuple[str, str, int]]:
        self.ring.close()
        return [(self.ctx.name, dst, n) for dst, n in sorted(self.ring.sent.items()) if n]

    def close(self) -> None:
        self.member.close()
        if self.roster is not None:
            self.roster.thread.join(timeout=self.ctx.run.barrier_timeout + 10)
            if self.roster.error:
                raise RuntimeError(f"roster: {self.roster.error}")


STRATEGY = DiLoCo
