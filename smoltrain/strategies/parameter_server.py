"""Parameter server with membership: the coordinator side of `syncps` and `edp`.

Rank 0 runs a `ParameterServer` thread holding the master parameters (one flat
fp32 buffer) and the AdamW state. Each worker, rank 0's own included, is a
`Member` connected over an authenticated smolnet.wire connection. One step:

  server -> every member:  PARAMS {step, lo, hi} + the flat parameters
  member -> server:        GRADS {step, loss}    + the flat gradient of its
                           sequences [lo, hi) of the global batch
  server: sums the gradients in a fixed member order, applies AdamW.

Membership: the server waits (with a timeout) for the expected members before
the first step. A member whose connection breaks (SIGKILL), or whose gradients
miss the barrier timeout, is dropped with a `leave` event; the step finishes with
the survivors, their gradient rescaled by B / (sequences they covered). With
`allow_join` (edp), a newcomer may connect at any time: it is admitted at the
next step boundary (a `join` event) and, like everyone, first receives the
current parameters. Rank 0's own worker talks to the server over loopback; that
is not a link, so it is not counted. Nothing here waits without a deadline.
"""

from __future__ import annotations

import socket
import threading
import time

import torch

from smolnet import wire
from smolnet.server import AuthListener
from smoltrain.comm.base import ByteCounter
from smoltrain.models.optim import make_optimizer
from smoltrain.planner.placement import named_batch_ranges

HELLO, PARAMS, GRADS, STOP = 1, 2, 3, 4


def flat_params(model) -> torch.Tensor:
    """Move a model's parameters (or these parameters) into one flat buffer; they become views of it."""
    params = list(model.parameters()) if isinstance(model, torch.nn.Module) else list(model)
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    off = 0
    for p in params:
        p.data = flat[off : off + p.numel()].view(p.shape)
        off += p.numel()
    return flat


def _send_tensor(sock, kind: int, meta: dict, t: torch.Tensor, timeout: float, session=None) -> int:
    wire.send_frame(sock, kind, meta, memoryview(t.numpy()).cast("B"), timeout=timeout, session=session)
    return t.numel() * t.element_size()


def _recv_tensor(sock, kind: int, into: torch.Tensor, timeout: float, session=None) -> dict:
    deadline = time.monotonic() + timeout
    got, meta, n = wire.recv_frame_header(sock, timeout, max_payload=into.numel() * 4, session=session)
    if got != kind or n != into.numel() * 4:
        raise wire.WireError(f"expected frame {kind} with {into.numel() * 4} bytes, got frame {got} with {n}")
    wire.recv_exact_into(sock, memoryview(into.numpy()).cast("B"), deadline)
    return meta


class _Conn:
    def __init__(self, name: str, order: int, sock: socket.socket, session: wire.Session):
        self.name, self.order, self.sock, self.session = name, order, sock, session


class ParameterServer:
    def __init__(
        self,
        ctx,
        bind: str,
        port: int,
        secret: bytes,
        expected: int,
        allow_join: bool,
        barrier_timeout: float = 30.0,
        start_timeout: float = 60.0,
        on_step=None,
        on_save=None,
    ):
        self.ctx, self.secret, self.expected, self.allow_join = ctx, secret, expected, allow_join
        self.barrier_timeout, self.start_timeout = barrier_timeout, start_timeout
        self.on_step, self.on_save = on_step, on_save  # callbacks (step, loss) and (step, tensors)
        self.flat = flat_params(ctx.build_model())
        self.opt = make_optimizer(ctx.run.optimizer, [self.flat], ctx.lr)
        self.sent = ByteCounter()  # payload bytes to each member, keyed by name
        self.received: dict[str, int] = {}  # payload bytes from each member
        self.members: list[_Conn] = []
        self.pending: list[_Conn] = []
        self.admitted = 0
        self.lock = threading.Lock()
        self.stopping = False
        self.error: BaseException | None = None
        # handshakes run concurrently, strangers capped (smolnet.server): none can hold the door
        self.listener = AuthListener.serve(bind, port, secret, self._greet, name="parameter server", with_key=True)

    # --- membership ---
    def _greet(self, sock: socket.socket, addr, key: bytes) -> None:
        ses = wire.Session(key, client=False)  # frame headers MACed, in sequence
        try:
            kind, meta, _ = wire.recv_frame(sock, timeout=10.0, max_payload=0, session=ses)
            if kind != HELLO or not isinstance(meta.get("name"), str):
                raise wire.WireError("first frame is not a HELLO")
            with self.lock:
                late = self.admitted >= self.expected and not self.allow_join
                if not late:
                    self.pending.append(_Conn(meta["name"], int(meta.get("order", 1 << 30)), sock, ses))
                    self.admitted += 1
            if late:
                raise wire.WireError("syncps does not admit workers after the start")
        except (OSError, wire.WireError, TimeoutError, ValueError) as e:
            self.ctx.reporter.log(f"parameter server: refused {addr[0]}: {e}")
            sock.close()

    def _drop(self, m: _Conn, step: int, why: str) -> None:
        self.ctx.reporter.log(f"parameter server: dropping {m.name} at step {step}: {why}")
        self.ctx.reporter.event(step, "leave", m.name)
        m.sock.close()
        self.members.remove(m)

    def _admit(self, step: int, first: bool) -> None:
        with self.lock:
            new, self.pending = self.pending, []
        for m in sorted(new, key=lambda c: (c.order, c.name)):
            self.members.append(m)
            if not first or m.order >= self.expected:  # a newcomer, not one of the starting ranks
                self.ctx.reporter.event(step, "join", m.name)
        self.members.sort(key=lambda c: (c.order, c.name))

    # --- training ---
    def serve(self, start: int, steps: int) -> None:
        try:
            self._serve(start, steps)
        except BaseException as e:
            self.error = e
            self.ctx.reporter.log(f"parameter server failed: {e}")
        finally:
            self.close()

    def _serve(self, start: int, steps: int) -> None:
        deadline = time.monotonic() + self.start_timeout
        while len(self.pending) < self.expected:
            if time.monotonic() > deadline:
                if not self.allow_join or not self.pending:
                    raise TimeoutError(f"only {len(self.pending)} of {self.expected} workers connected")
                break
            time.sleep(0.02)
        self._admit(start, first=True)
        grad = torch.zeros_like(self.flat)
        buf = torch.empty_like(self.flat)  # one receive buffer, reused for every member (planner/capacity.py)
        for step in range(start, steps):
            self._admit(step, first=False)
            if not self.members:
                raise RuntimeError("every worker has left")
            ranges = named_batch_ranges(self.ctx.batch, [m.name for m in self.members], self.ctx.run.placement)
            for m in list(self.members):
                lo, hi = ranges[m.name]
                try:
                    n = _send_tensor(
                        m.sock, PARAMS, {"step": step, "lo": lo, "hi": hi}, self.flat, self.barrier_timeout, m.session
                    )
                    self.sent.add(m.name, n)
                except (OSError, wire.WireError, TimeoutError) as e:
                    self._drop(m, step, f"send failed: {e}")
            deadline = time.monotonic() + self.barrier_timeout
            grad.zero_()
            covered, loss = 0, 0.0
            for m in list(self.members):
                try:
                    meta = _recv_tensor(m.sock, GRADS, buf, max(0.01, deadline - time.monotonic()), m.session)
                    if meta.get("step") != step:
                        raise wire.WireError(f"gradients for step {meta.get('step')}, expected {step}")
                except (OSError, wire.WireError, TimeoutError) as e:
                    self._drop(m, step, f"no gradients before the barrier timeout ({e})")
                    continue
                self.received[m.name] = self.received.get(m.name, 0) + buf.numel() * 4
                grad += buf
                loss += float(meta.get("loss", 0.0))
                lo, hi = ranges[m.name]
                covered += hi - lo
            if covered == 0:
                raise RuntimeError(f"no worker delivered gradients at step {step}")
            if covered != self.ctx.batch:  # survivors stand for the whole batch
                grad *= self.ctx.batch / covered
                loss *= self.ctx.batch / covered
            self.opt.step([grad])
            if self.on_step:
                self.on_step(step, loss)
            if self.on_save:
                self.on_save(step, self)
        for m in list(self.members):
            try:
                wire.send_frame(m.sock, STOP, {"step": steps}, timeout=5.0, session=m.session)
            except (OSError, wire.WireError, TimeoutError):
                pass

    def state_tensors(self) -> dict:
        st = {"flat": self.flat}
        st.update(self.opt.state_tensors())
        return st

    def load_state_tensors(self, state: dict) -> None:
        self.flat.copy_(state["flat"])
        self.opt.load_state_tensors(state)

    def close(self) -> None:
        self.stopping = True
        close_all(self.listener, self.members + self.pending)


def close_all(listener, conns) -> None:
    """Stop admitting and drop every member's connection (the parameter server, diloco's roster)."""
    try:
        listener.close()
    except OSError:
        pass
    for m in conns:
        m.sock.close()


class Member:
    """A worker's connection to the parameter server."""

    def __init__(self, addr: str, port: int, secret: bytes, name: str, order: int, timeout: float = 60.0):
        self.timeout = timeout
        self.sock, key = wire.connect(
            addr, port, secret, timeout=timeout, what="parameter server", retry_every=0.1, keyed=True
        )
        self.session = wire.Session(key, client=True)
        wire.send_frame(self.sock, HELLO, {"name": name, "order": order}, timeout=10.0, session=self.session)

    def pull(self, flat: torch.Tensor) -> dict | None:
        """The next step's assignment with the current parameters, or None at the end."""
        deadline = time.monotonic() + self.timeout
        kind, meta, n = wire.recv_frame_header(
            self.sock, self.timeout, max_payload=flat.numel() * 4, session=self.session
        )
        if kind == STOP:
            return None
        if kind != PARAMS or n != flat.numel() * 4:
            raise wire.WireError(f"expected PARAMS with {flat.numel() * 4} bytes, got frame {kind} with {n}")
        wire.recv_exact_into(self.sock, memoryview(flat.numpy()).cast("B"), deadline)
        return meta

    def push(self, step: int, loss: float, grad: torch.Tensor) -> None:
        _send_tensor(self.sock, GRADS, {"step": step, "loss": loss}, grad, self.timeout, self.session)

    def close(self) -> None:
        self.sock.close()
