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
planner.diloco counts the same bytes and picks H from the links. Membership is decided
at each outer step (smoltrain.strategies.roster): a rank that died is dropped there
(`leave`) and the rest rebuild their ring; a newcomer is admitted there (`join`), gets
the anchor and outer momentum from rank 0 and trains from the next step.

Unequal hosts: each rank trains its placement's share of every batch, so all end their H
inner steps together. Under `--placement auto` the roster also re-balances the shares at
every outer step from each rank's measured pace (a calibration a few percent off, or a host
slowed by other work, would otherwise keep the rest waiting every outer step): a rank then
trains floor(n/H) or one more sequences of each step, n its sequences for the outer step.
"""

from __future__ import annotations

import time

import torch

from smoltrain.comm import CommError, make_comm
from smoltrain.comm.quantized import all_reduce_as
from smoltrain.models.gpt import loss_sum
from smoltrain.models.optim import make_optimizer
from smoltrain.strategies import Context, Strategy, mean_loss, targets, trainable
from smoltrain.strategies.outer import digest, outer_update
from smoltrain.strategies.parameter_server import flat_params
from smoltrain.strategies.roster import Member, Roster


class DiLoCo(Strategy):
    def __init__(self, ctx: Context):
        super().__init__(ctx)
        run = ctx.run
        self.H, self.steps = run.inner_steps, run.steps
        self.model = ctx.build_model().to(ctx.device)
        self.params = trainable(self.model)
        self.flat = flat_params(self.params)  # the trained weights (LoRA: the adapters), one buffer
        self.opt = make_optimizer(run.optimizer, self.params, ctx.lr)  # inner, never shared
        self.anchor = self.flat.detach().clone()  # the shared weights of the last outer step
        self.momentum = torch.zeros_like(self.flat)  # the outer Nesterov buffer (shared)
        self.joiner = ctx.rank < 0
        self.lo, self.hi = (0, 0) if self.joiner else ctx.batch_range()
        self.share = 0.0 if self.joiner else (self.hi - self.lo) / ctx.batch  # of the batch, from this step on
        self.weight = self.share  # the part of the batch the last reported loss stands for (Reporter.step)
        self.plan: list[tuple[int, int]] | None = None  # (lo, hi) per inner step of this outer step, when paced
        self.tokens = 0  # trained on since the last outer step
        self.clock = 0.0  # seconds of inner steps since the last outer step
        self.group, self.epoch, self.names = None, 0, list(run.names)
        self.sent: dict[str, int] = {}  # payload bytes to each peer over the groups so far
        self.roster = Roster(ctx, ctx.world, (run.steps - 1) // self.H) if ctx.rank == 0 else None
        order = ctx.rank if ctx.rank >= 0 else 1 << 20
        self.member = Member(run, ctx.secret, ctx.name, order, timeout=2 * run.barrier_timeout + run.timeout)

    # --- the loop ---
    def next_step(self, step: int) -> int | None:
        if self.joiner and self.group is None:  # wait for the outer step that admits this rank
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
        t_in, sent0, waited, sync_s = time.perf_counter(), self.sent_bytes(), 0.0, 0.0
        with self.ctx.comm_timer:
            while True:
                if roster is None:
                    t = time.perf_counter()
                    roster = self.member.sync(outer, self.tokens, self.clock)
                    waited += time.perf_counter() - t
                ok = True
                try:
                    t = time.perf_counter()
                    delta = self.regroup(roster)
                    sync_s = time.perf_counter() - t
                except CommError as e:
                    self.ctx.reporter.log(f"{self.ctx.name}: outer step {outer} failed ({e}); regrouping")
                    ok = False
                    self.close_group()  # now, so peers still inside the collective fail too instead of waiting
                if self.member.commit(outer, ok):
                    break
                self.close_group()  # someone failed: every rank builds a fresh ring and redoes the step
                roster = None
        outer_update(self.anchor, self.momentum, self.flat, delta, self.ctx.run.outer_lr, self.ctx.run.outer_momentum)
        seconds = self.clock + time.perf_counter() - t_in  # this rank's inner steps and the sync
        self.ctx.reporter.outer(
            self.step_of(outer), sync_s, self.sent_bytes() - sent0, waited, seconds, digest(self.anchor), self.tokens
        )
        self.tokens, self.clock = 0, 0.0

    def step_of(self, outer: int) -> int:
        return min((outer + 1) * self.H, self.steps) - 1

    def regroup(self, roster: dict) -> torch.Tensor:
        """Join this outer step's group (a new ring when it changed), bring newcomers the shared
        state, and all-reduce the token-weighted pseudo-gradient; returns the average."""
        names = roster["names"]
        if self.group is None or roster["epoch"] != self.epoch:
            self.close_group()
            self.names, self.epoch = list(names), roster["epoch"]
            if len(names) > 1:
                run = self.ctx.run
                self.group = make_comm(
                    run.backend,
                    names.index(self.ctx.name),
                    len(names),
                    run.coord_addr,
                    run.port,
                    self.ctx.secret,
                    timeout=run.timeout,
                    device=self.ctx.device,
                    addrs=roster["addrs"],
                    integrity=run.integrity,
                )
        self.lo, self.hi = roster["ranges"][self.ctx.name]
        self.plan = None
        if roster.get("paced"):  # the next outer step's slices, re-balanced by measured pace
            from smoltrain.planner.placement import paced_ranges

            paced = roster["paced"]
            counts = [int(paced["counts"][n]) for n in names]
            self.plan = paced_ranges(self.ctx.batch, int(paced["steps"]), counts)[names.index(self.ctx.name)]
            self.lo, self.hi = self.plan[0]
        if roster["joined"] and self.group is not None:  # newcomers start from the shared state
            shared = torch.cat([self.anchor, self.momentum]).cpu()
            self.group.broadcast(shared, 0)
            if self.ctx.name in roster["joined"]:
                self.anchor.copy_(shared[: self.flat.numel()])
                self.momentum.copy_(shared[self.flat.numel() :])
                self.flat.copy_(self.anchor)
        delta = (self.anchor - self.flat).cpu()
        delta.mul_(self.tokens / roster["tokens"] if roster["tokens"] else 0.0)
        if self.group is not None:
            all_reduce_as(self.group, delta, self.ctx.run.sync_dtype)
        self.share = (self.hi - self.lo) / self.ctx.batch
        return delta.to(self.flat.device)

    def close_group(self) -> None:
        if self.group is not None:
            for dst, n in self.group.counter.payload.items():
                self.sent[self.names[dst]] = self.sent.get(self.names[dst], 0) + n
            self.group.close()
            self.group = None

    # --- what the runner asks ---
    def eval_loss(self, x, y) -> float:
        """This rank's slice of the held-out batch (the slice it trains on, so the work
        follows each host's speed), with the shared weights of the last outer step."""
        local = self.flat.clone()
        self.flat.copy_(self.anchor)
        try:
            return mean_loss(self.model, x[self.lo : self.hi], y[self.lo : self.hi], targets(y))
        finally:
            self.flat.copy_(local)

    def state_tensors(self) -> dict:
        st = super().state_tensors()
        st.update({"outer.anchor": self.anchor, "outer.momentum": self.momentum})
        return st

    def load_state_tensors(self, state: dict) -> None:
        super().load_state_tensors(state)
        self.anchor.copy_(state["outer.anchor"])
        self.momentum.copy_(state["outer.momentum"])

    def sent_bytes(self) -> int:
        return sum(self.sent.values()) + (self.group.counter.total_payload() if self.group else 0)

    def link_bytes(self) -> list[tuple[str, str, int]]:
        self.close_group()
        return [(self.ctx.name, dst, n) for dst, n in sorted(self.sent.items()) if n]

    def close(self) -> None:
        self.member.close()
        if self.roster is not None:
            self.roster.thread.join(timeout=self.ctx.run.barrier_timeout + 10)
            if self.roster.error:
                raise RuntimeError(f"roster: {self.roster.error}")


STRATEGY = DiLoCo
