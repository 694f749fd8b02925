"""One rank of a run: join the group, build the strategy, loop over steps, report.

Started by `smoltrain run` as `smoltrain worker` (locally or over SSH), with the
cluster secret on standard input. Everything else (the run configuration) comes
from the controller over the authenticated control channel, so nothing secret
or long ever sits on a command line.
"""

from __future__ import annotations

import os
import socket
import time
import traceback

import torch

from smoltrain import registry
from smoltrain.models.data import make_batches
from smoltrain.run.channel import ControlClient
from smoltrain.run.checkpoint import load_part, save_part
from smoltrain.run.config import RunConfig
from smoltrain.strategies import Context, Stopwatch, TimedComm, eval_due, load_strategy


class Reporter:
    """What a rank tells the controller; thread-safe (the PS server reports too)."""

    def __init__(self, client: ControlClient, name: str):
        self.client, self.name = client, name

    def _send(self, msg: dict) -> None:
        try:
            self.client.send(dict(msg, who=self.name))
        except (OSError, TimeoutError) as e:
            raise ConnectionError(f"lost the controller: {e}") from None

    def step(self, step, loss, step_s, comm_s, sent, weight=None, loss_tokens=None, wait_s=0.0, update_s=0.0):
        msg = {"type": "step", "step": step, "loss": loss, "step_s": step_s, "comm_s": comm_s, "sent": sent}
        if wait_s:  # waited for peers outside communication calls (diloco's roster sync): not compute
            msg["wait_s"] = wait_s
        if update_s:  # a pipeline stage's optimizer update, part of its compute (run/timings.py)
            msg["update_s"] = update_s
        if loss_tokens is not None:  # targets of the global batch that carry loss (the same on every rank)
            msg["loss_tokens"] = loss_tokens
        if weight is not None:  # the share of the batch this loss stands for (elastic: members change)
            msg["weight"] = weight
        self._send(msg)

    def eval(self, step, loss, weight=None):
        msg = {"type": "eval", "step": step, "loss": loss}
        if weight is not None:  # the part of the held-out batch this share stands for (elastic members)
            msg["weight"] = weight
        self._send(msg)

    def outer(self, step, sync_s, nbytes, wait_s, seconds, digest, tokens):
        keys = ("step", "sync_s", "bytes", "wait_s", "seconds", "digest", "tokens")
        self._send(dict(zip(keys, (step, sync_s, nbytes, wait_s, seconds, digest, tokens)), type="outer"))

    def loss(self, step, loss):
        self._send({"type": "loss", "step": step, "loss": loss})

    def event(self, step, kind, who):
        self._send({"type": "event", "step": step, "kind": kind, "name": who})

    def saved(self, step, part, digest):
        self._send({"type": "saved", "step": step, "part": part, "sha256": digest["sha256"], "bytes": digest["bytes"]})

    def log(self, message):
        self._send({"type": "log", "message": message})

    def done(self, links, state_bytes, threads=None, kernels=None):
        msg = {"type": "done", "links": [list(x) for x in links], "state_bytes": state_bytes, "threads": threads}
        self._send({**msg, "kernels": kernels})

    def error(self, message, peer=None):
        self._send({"type": "error", "message": message, "peer": peer})


def resolve_device(want: str) -> str:
    """`smol_device`: auto picks cuda, then mps, then cpu (smoltrain.host)."""
    from smoltrain.host import resolve_device as resolve

    return resolve(want)


def rank_threads(cfg: RunConfig, rank: int) -> int | None:
    """This rank's torch threads: the controller's figure (0: the host's usable CPUs); 1 for a
    controller that sends none (older) and for joiners."""
    if 0 <= rank < len(cfg.threads):
        return int(cfg.threads[rank]) or None
    return 1


def checkpoint_due(cfg: RunConfig, completed: int) -> bool:
    if not cfg.checkpoint_dir:
        return False
    every = cfg.checkpoint_every
    return completed == cfg.steps or (every > 0 and completed % every == 0)


def worker_main(control_addr: str, control_port: int, secret: bytes, rank: int, join: bool) -> int:
    client = ControlClient(
        control_addr,
        control_port,
        secret,
        {"rank": rank, "join": join, "pid": os.getpid(), "host": socket.gethostname()},
    )
    rep = Reporter(client, client.name)
    try:
        train(client.config, client.rank, client.name, secret, rep, client.corpus)
        return 0
    except BaseException as e:  # tell the controller in one line, keep the trace in the log
        traceback.print_exc()
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        try:
            rep.error(f"{type(e).__name__}: {msg}", peer=blamed_peer(client.config, e))
        except ConnectionError:
            pass
        return 1
    finally:
        client.close()


def _sha(cfg: RunConfig, part: str) -> str | None:
    """The digest complete.json holds for this rank's part (None: a marker from before digests)."""
    return (cfg.resume_sha256 or {}).get(part)


def resume_part(cfg: RunConfig, rank: int) -> str:
    """The checkpoint part this rank resumes from: its own; in an elastic run a rank that had
    left when the checkpoint was written takes a member's (diloco's anchor and outer momentum
    are the same on every member; the local weights and inner optimizer become that member's)."""
    own, listed = f"rank{rank}", cfg.resume_sha256 or {}
    if own in listed or not listed or not registry.get(cfg.strategy).elastic:
        return own
    return min(listed, key=lambda p: (len(p), p))


def blamed_peer(cfg: RunConfig, e: BaseException) -> str | None:
    """The name of the rank this rank's transport blames for `e` (CommError.peer), if any."""
    peer = getattr(e, "peer", None)
    if isinstance(peer, int) and 0 <= peer < len(cfg.names):
        return cfg.names[peer]
    return None


def held_out(strat, batches, comm, timer, rep: Reporter, step: int, device: str) -> None:
    """The held-out loss after `step` (--eval-every), outside the step's time and bytes: what a
    split model sends to evaluate is taken back off the transport's counters."""
    counter = comm.counter if comm else None
    saved = (dict(counter.payload), dict(counter.framing)) if counter else None
    shares = [strat.eval_loss(x.to(device), y.to(device)) for x, y in batches.eval_batches()]
    if counter:
        counter.payload.clear(), counter.payload.update(saved[0])
        counter.framing.clear(), counter.framing.update(saved[1])
        comm.take_seconds()
    timer.take()
    if shares[0] is not None:
        rep.eval(step, sum(shares) / len(shares), strat.share)


def train(cfg: RunConfig, rank: int, name: str, secret: bytes, rep: Reporter, corpus: bytes) -> None:
    from smoltrain import host
    from smoltrain.models import backends

    threads, device = host.setup(
        rank_threads(cfg, rank), cfg.devices[rank] if 0 <= rank < len(cfg.devices) else "cpu", cfg.dtype
    )
    host.keep_freed_memory()
    backends.select(cfg.kernels)  # a backend this host cannot run: the rank's one-line error
    torch.manual_seed(cfg.seed)
    batches = make_batches(cfg, corpus)  # checks the payload against cfg.data_digest
    world = cfg.world_size
    info = registry.get(cfg.strategy, trainable=True)
    ps = info.parameter_server
    comm = None
    if not info.elastic and world > 1:  # elastic strategies form their own groups as members change
        from smoltrain.comm import make_comm

        comm = TimedComm(
            make_comm(
                cfg.backend,
                rank,
                world,
                cfg.coord_addr,
                cfg.port,
                secret,
                timeout=cfg.timeout,
                device=device,
                addrs=list(cfg.addrs) or None,
                integrity=cfg.integrity,
            )
        )
    start = cfg.start_step
    server_state, server_saver = None, None
    if ps and rank == 0:
        if start and cfg.checkpoint_dir:
            server_state = load_part(cfg.checkpoint_dir, start, "server", _sha(cfg, "server"))

        def server_saver(step, server):
            if checkpoint_due(cfg, step + 1):
                rep.saved(step + 1, "server", save_part(cfg.checkpoint_dir, step + 1, "server", server.state_tensors()))

    axes = dict(rank=rank, world=world, comm=comm)
    if cfg.mesh and comm is not None:  # the strategy along its mesh axis, with its replica and tp axes
        from smoltrain.mesh import strategy_axes

        axes = strategy_axes(cfg.mesh, rank, comm)
    ctx = Context(
        **axes,
        run=cfg,
        batches=batches,
        reporter=rep,
        name=name,
        comm_timer=Stopwatch(),
        wait_timer=Stopwatch(),
        update_timer=Stopwatch(),
        device=device,
        secret=secret,
        server_state=server_state,
        server_saver=server_saver,
    )
    strat = load_strategy(cfg.strategy)(ctx)
    if ctx.replica is not None and ctx.replica.name == "diloco":  # a mesh's diloco axis around it
        from smoltrain.strategies.outer import OuterSteps

        strat = OuterSteps(strat)
    if start and not ps:
        part = resume_part(cfg, rank)
        strat.load_state_tensors(load_part(cfg.checkpoint_dir, start, part, _sha(cfg, part)))
    step = start
    try:
        while True:
            t0 = time.perf_counter()
            nxt = strat.next_step(step)
            if nxt is None:
                break
            step = nxt
            with torch.autocast(device, dtype=torch.bfloat16, enabled=cfg.dtype == "bf16"):
                loss = strat.train_step(step)  # bf16 matmuls; parameters, gradients, AdamW state stay fp32
            if cfg.pace:
                time.sleep(max(0.0, cfg.pace - (time.perf_counter() - t0)))
            step_s = time.perf_counter() - t0
            comm_s = (comm.take_seconds() if comm else 0.0) + ctx.comm_timer.take()
            sent = strat.sent_bytes()
            loss_tokens = batches.loss_tokens(step) if strat.loss_owner else None
            loss = loss if strat.loss_owner else None
            waited, updated = ctx.wait_timer.take(), ctx.update_timer.take()
            rep.step(step, loss, step_s, comm_s, sent, strat.weight, loss_tokens, waited, updated)
            if eval_due(cfg, step):
                held_out(strat, batches, comm, ctx.comm_timer, rep, step, device)
            if not ps and checkpoint_due(cfg, step + 1):
                part = f"rank{rank}"
                rep.saved(step + 1, part, save_part(cfg.checkpoint_dir, step + 1, part, strat.state_tensors()))
            step += 1
    finally:
        strat.close()
    rep.done(strat.link_bytes(), strat.state_bytes(), threads, backends.report())
    if comm:
        comm.close()
