"""syncps: synchronous parameter server, with a barrier that drops dead workers.

Rank 0 is both the parameter server (a thread holding the master parameters and
the AdamW state, see `smoltrain.strategies.parameter_server`) and a worker; ranks 1..N-1 are
workers. Every step each worker pulls the current parameters with its slice of
the global batch, computes the gradient of its share of the global mean loss and
pushes it; the server sums the gradients in a fixed order and steps. Because the
server steps exactly like one process would, the loss curve matches `--local 1`.

If a worker dies (its connection breaks) or misses the barrier timeout
(`--barrier-timeout`, default 30 s), the server drops it with a `leave` event and
finishes the step with the survivors instead of hanging.

What crosses the wire, per step and per worker other than rank 0: parameters
server -> worker (P*4 bytes) and gradients worker -> server (P*4 bytes): 2P*4
bytes per worker, 2(N-1)P*4 through the server's link. Rank 0's own worker talks
to the server over loopback and is not counted. This strategy runs on its own
authenticated protocol whatever `--backend` says (torch.distributed cannot drop a
member mid-run).
"""

from __future__ import annotations

import threading

import torch

from smoltrain import registry
from smoltrain.models.gpt import loss_sum
from smoltrain.strategies import Context, Strategy, eval_due, mean_loss
from smoltrain.strategies.parameter_server import Member, ParameterServer, flat_params


class SyncParameterServer(Strategy):
    def __init__(self, ctx: Context):
        super().__init__(ctx)
        run = ctx.run
        self.server = None
        if ctx.rank == 0:
            self.server = ParameterServer(
                ctx,
                bind=run.coord_addr,
                port=run.port,
                secret=ctx.secret,
                expected=ctx.world,
                allow_join=registry.get(run.strategy).joiners,
                barrier_timeout=run.barrier_timeout,
                on_step=self._stepped,
                on_save=ctx.server_saver,
            )
            if ctx.server_state:
                self.server.load_state_tensors(ctx.server_state)
            self.thread = threading.Thread(target=self.server.serve, args=(run.start_step, run.steps), daemon=True)
            self.thread.start()
        self.model = ctx.build_model().to(ctx.device)
        self.flat = flat_params(self.model)
        self.wire_buf = torch.empty(self.flat.numel())  # parameters arrive in host memory
        self.params = list(self.model.parameters())
        order = ctx.rank if ctx.rank >= 0 else 1 << 20
        self.member = Member(run.coord_addr, run.port, ctx.secret, ctx.name, order, timeout=run.barrier_timeout * 4)
        self.assignment = None
        self.loss_owner = False  # the server reports the loss

    def _stepped(self, step: int, loss: float) -> None:
        """The server applied `step`: report its loss and, when due, the held-out loss of the
        master parameters (the workers' copies are a step behind)."""
        self.ctx.reporter.loss(step, loss)
        if eval_due(self.ctx.run, step):
            if not hasattr(self, "eval_model"):
                self.eval_model = self.ctx.build_model()
                self.eval_flat = flat_params(self.eval_model)
            self.eval_flat.copy_(self.server.flat)
            held = [mean_loss(self.eval_model, x, y) for x, y in self.ctx.batches.eval_batches()]
            self.ctx.reporter.eval(step, sum(held) / len(held))

    def eval_loss(self, x, y) -> None:
        return None  # the server measures it on the master parameters (_stepped)

    def next_step(self, step: int) -> int | None:
        t = self.ctx.comm_timer
        with t:
            self.assignment = self.member.pull(self.wire_buf)
            if self.assignment is not None:
                self.flat.copy_(self.wire_buf)
        return None if self.assignment is None else int(self.assignment["step"])

    def train_step(self, step: int) -> None:
        a = self.assignment
        x, y = self.ctx.batches.slice(step, a["lo"], a["hi"])
        x, y = x.to(self.ctx.device), y.to(self.ctx.device)
        loss = loss_sum(self.model(x), y, self.ctx.loss_tokens(step))
        loss.backward()
        grad = torch.cat([p.grad.reshape(-1) for p in self.params]).cpu()
        for p in self.params:
            p.grad = None
        with self.ctx.comm_timer:
            self.member.push(step, float(loss.item()), grad)
        return None

    def state_tensors(self) -> dict:
        return {}  # the server's state is saved by the server

    def state_bytes(self) -> dict:
        if self.server:
            st = self.server.state_tensors()
            return {
                "params": st["flat"].numel() * 4 * 2,
                "optimizer": sum(t.numel() * t.element_size() for k, t in st.items() if k.startswith("opt.")),
            }
        return {"params": self.flat.numel() * 4, "optimizer": 0}

    def sent_bytes(self) -> int:
        if not self.server:
            return 0
        me = self.ctx.name
        return sum(n for k, n in self.server.sent.payload.items() if k != me) + sum(
            n for k, n in self.server.received.items() if k != me
        )

    def link_bytes(self) -> list[tuple[str, str, int]] | None:
        """The server measures both directions of every worker's link."""
        if not self.server:
            return []
        me = self.ctx.name
        out = [(me, dst, n) for dst, n in self.server.sent.payload.items() if dst != me]
        out += [(src, me, n) for src, n in self.server.received.items() if src != me]
        return out

    def close(self) -> None:
        self.member.close()
        if self.server:
            self.thread.join(timeout=self.server.barrier_timeout + 10)
            if self.server.error:
                raise RuntimeError(f"parameter server: {self.server.error}")


STRATEGY = SyncParameterServer
