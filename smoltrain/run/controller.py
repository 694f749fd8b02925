"""The controller side of `smoltrain run`: place ranks, start workers, gather what they measure
(the run report made of it: smoltrain.run.report; what is refused before it starts:
smoltrain.run.preflight; the launch that builds it: smoltrain.run.launch).

Ranks are placed on `--local N` loopback processes (names rank0..rank{N-1}) or on
the inventory's `cluster` hosts (coordinator first, so it is rank 0), started over
SSH with the secret on standard input. Every worker dials back to the control
channel; the controller shows progress and writes the run report from what the
workers measured. A worker that fails stops the run with its one-line reason
(except in edp/syncps, where a worker may leave and the run goes on).
"""

from __future__ import annotations

import math
import queue
import socket
import sys
import time
from dataclasses import dataclass

from smolnet.errors import SmolError, UsageError
from smolnet.launcher import ProcessGroup, remote_log
from smoltrain import registry
from smoltrain.run import WORKER_IMPORTS, blame, checkpoint
from smoltrain.run.channel import ControlServer, dead_after
from smoltrain.run.config import RunConfig
from smoltrain.run.report import step_loss


@dataclass
class Placement:
    name: str
    address: str
    host: object = None  # smolnet Host, or None for --local


def rank_placements(local: int | None, inventory: str | None) -> tuple[list[Placement], list | None]:
    """(placements, inventory hosts or None) for `--local N` or `-i INVENTORY`: the coordinator
    is rank 0, the other hosts follow in inventory order. `run`, `generate` and `serve` share it."""
    if local is not None:
        if local < 1:
            raise UsageError("--local needs at least 1 rank")
        return [Placement(f"rank{r}", "127.0.0.1") for r in range(local)], None
    if not inventory:
        raise UsageError("give --local N or -i INVENTORY")
    from smolnet.inventory import load_inventory

    inv = load_inventory(inventory)
    hosts = [inv.coordinator] + [h for h in inv.hosts if h.name != inv.coordinator.name]
    return [Placement(h.name, h.cluster_ip, h) for h in hosts], hosts


def route_source(addr: str) -> str:
    """This machine's address on the route to addr (where workers can reach the controller)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((addr, 9))
        return s.getsockname()[0]
    except OSError:
        return "0.0.0.0"
    finally:
        s.close()


class Controller:
    def __init__(
        self,
        cfg: RunConfig,
        placements: list[Placement],
        secret: bytes,
        console,
        log_dir: str,
        external: bool = False,
        corpus: bytes = b"",
    ):
        self.cfg, self.placements, self.secret, self.console = cfg, placements, secret, console
        self.corpus = corpus
        self.log_dir, self.external = log_dir, external
        self.world = len(placements)
        self.names = [p.name for p in placements]
        self.strategy = cfg.strategy
        self.info = registry.get(cfg.strategy)
        self.joined = 0
        self.group = ProcessGroup(secret, log_dir, WORKER_IMPORTS)  # the workers, started by start_workers
        self.connected: dict[str, dict] = {}  # name -> hello
        self.finished: set[str] = set()
        self.closed: set[str] = set()
        self.left: set[str] = set()  # dropped by the parameter server (syncps/edp)
        self.steps: dict[int, dict] = {}
        self.evals: dict[int, dict] = {}  # step -> who -> held-out loss share (--eval-every)
        self.outer: dict[int, dict] = {}  # outer step -> who -> {sync_s, bytes, wait_s} (diloco)
        self.events: list[dict] = []
        self.links: dict[tuple[str, str], int] = {}
        self.state_bytes: dict[str, dict] = {}
        self.threads: dict[str, int] = {}  # torch threads each rank ran at (its `done` says)
        self.kernels: dict[str, dict] = {}  # the decode kernels each rank chose (models.backends)
        self.saved: dict[int, dict] = {}  # step -> part -> {"sha256", "bytes"}
        self.marked: set[int] = set()  # steps whose checkpoint is complete
        self.sent: dict[str, int] = {}
        self.shown = cfg.start_step - 1
        self.views: blame.Views | None = None  # every rank's view, gathered once something fails
        self.blame_by = 0.0
        self.blamed: str | None = None
        self.server: ControlServer | None = None  # its heartbeat thread knows if we were stopped

    # --- configs handed to workers ---
    def config_for(self, hello: dict) -> tuple[RunConfig, int, str]:
        """The run configuration, rank and name for a worker that said hello."""
        if hello.get("join"):
            if not self.info.joiners:
                joiners = ", ".join(n for n in registry.names() if registry.get(n).joiners)
                raise ValueError(f"{self.strategy} does not admit joiners (only {joiners} does)")
            self.joined += 1
            name, rank = f"join{self.joined}", -1
        else:
            rank = int(hello.get("rank", -1))
            if not 0 <= rank < self.world or self.names[rank] in self.connected:
                raise ValueError(f"rank {rank} is not expected or already connected")
            name = self.names[rank]
        return self.cfg, rank, name

    # --- starting and stopping workers ---
    def start_workers(self, control_addr: str, port: int) -> None:
        for r, p in enumerate(self.placements):
            argv = ["-m", "smoltrain", "worker", "--control", f"{control_addr}:{port}", "--rank", str(r)]
            python = sys.executable if p.host is None else p.host.python
            self.group.start(p.name, [python, *argv], host=p.host, log=remote_log(self.log_dir, p.name))

    @property
    def procs(self) -> dict[str, object]:
        """name -> Popen (local) or (Remote, Proc): the workers this controller started."""
        return self.group.procs

    def stop_workers(self) -> None:
        self.group.stop(spare=self.finished)

    def log_tail(self, name: str) -> str:
        return self.group.log_tail(name)

    # --- the message loop ---
    def handle(self, who: str | None, msg: dict, progress) -> None:
        kind = msg.get("type")
        if kind == "log" or who is None:
            self.console.log(f"{who or 'control'}: {msg.get('message')}", markup=False)  # text from a peer
        elif kind == "connected":
            self.connected[who] = msg["hello"]
            self.console.print(f"worker {who} pid {msg['hello'].get('pid')} on {msg['hello'].get('host')}")
        elif kind == "step":
            rec = self.steps.setdefault(msg["step"], {"parts": {}, "step_s": 0.0, "comm_s": 0.0})
            rec["step_s"] = max(rec["step_s"], msg["step_s"])
            rec["comm_s"] = max(rec["comm_s"], msg["comm_s"])
            own = (msg["step_s"], msg["comm_s"], msg.get("wait_s") or 0.0, msg.get("update_s") or 0.0)
            rec.setdefault("by", {})[who] = own  # per-rank timings (run/timings.py)
            if msg.get("loss_tokens") is not None:
                rec["loss_tokens"] = msg["loss_tokens"]
            if msg.get("loss") is not None:
                rec["parts"][who] = msg["loss"]
                if msg.get("weight") is not None:
                    rec.setdefault("weights", {})[who] = msg["weight"]
                if not math.isfinite(msg["loss"]):
                    raise SmolError(f"{who}: loss is {msg['loss']} at step {msg['step'] + 1} (diverged: lower --lr?)")
            self.sent[who] = msg.get("sent", 0)
        elif kind == "loss":
            rec = self.steps.setdefault(msg["step"], {"parts": {}, "step_s": 0.0, "comm_s": 0.0})
            rec["parts"]["server"] = msg["loss"]
        elif kind == "eval":
            rec = self.evals.setdefault(msg["step"], {"parts": {}})
            rec["parts"][who] = msg["loss"]
            if msg.get("weight") is not None:
                rec.setdefault("weights", {})[who] = msg["weight"]
        elif kind == "outer":
            self.outer.setdefault(msg["step"], {})[who] = {
                k: msg[k] for k in ("sync_s", "bytes", "wait_s", "seconds", "digest", "tokens")
            }
        elif kind == "event":
            self.events.append({"step": msg["step"], "kind": msg["kind"], "who": msg["name"]})
            if msg["kind"] == "leave":
                self.left.add(msg["name"])
                for step in sorted(self.saved):  # a checkpoint that waited for the member that left
                    self._checkpoint_done(step)
            self.console.print(f"event: {msg['kind']} {msg['name']} at step {msg['step']}")
        elif kind == "saved":
            parts = self.saved.setdefault(msg["step"], {})
            parts[msg["part"]] = {"sha256": str(msg["sha256"]), "bytes": int(msg["bytes"])}
            self._checkpoint_done(msg["step"])
        elif kind == "done":
            self.finished.add(who)
            for src, dst, n in msg["links"]:
                self.links[(src, dst)] = self.links.get((src, dst), 0) + int(n)
            self.state_bytes[who] = msg.get("state_bytes", {})
            if isinstance(msg.get("threads"), int):
                self.threads[who] = msg["threads"]
            if isinstance(msg.get("kernels"), dict):
                self.kernels[who] = msg["kernels"]
        elif kind == "error":
            if self.info.elastic and who != self.names[0]:
                self.console.log(f"{who} failed: {msg['message']}", markup=False)
            else:
                self._gather(who, error=msg)
        elif kind == "closed":
            self.closed.add(who)
            if who not in self.finished and not (self.info.elastic and who != self.names[0]):
                self._gather(who, died=True)
        self._show(progress)

    def _checkpoint_done(self, step: int) -> None:
        """Mark the checkpoint of `step` complete once the part of every member still in the run
        is on disk: a member an elastic run dropped writes none, so the marker lists the parts there are."""
        parts = self.saved.get(step)
        gone = {f"rank{self.names.index(n)}" for n in self.left if n in self.names}
        if parts is None or step in self.marked or not set(self.info.checkpoint_parts(self.world)) - gone <= set(parts):
            return
        self.marked.add(step)
        checkpoint.mark_complete(self.cfg.checkpoint_dir, step, checkpoint.identity(self.cfg), parts)
        checkpoint.prune(self.cfg.checkpoint_dir, self.cfg.keep_checkpoints)
        self.events.append({"step": step, "kind": "checkpoint", "who": "all"})

    def _show(self, progress) -> None:
        need = self.info.loss_reports(self.world)
        if self.cfg.mesh:  # one share per place on the mesh's data axes
            from smoltrain.mesh import loss_shares

            need = loss_shares(self.cfg)
        while (
            self.shown + 1 in self.steps
            and len(self.steps[self.shown + 1]["parts"]) >= need
            and self.steps[self.shown + 1]["step_s"] > 0
        ):
            self.shown += 1
            rec = self.steps[self.shown]
            loss = step_loss(rec)
            tps = self.cfg.global_tokens / max(rec["step_s"], 1e-9)
            mb = sum(self.sent.values()) / 1e6
            line = f"step {self.shown + 1}/{self.cfg.steps} loss {loss:.4f} tok/s {tps:,.0f} sent {mb:.2f} MB"
            if progress is not None:
                progress.update(progress.task_ids[0], completed=self.shown + 1, description=line)
            else:
                self.console.print(line)

    def all_done(self) -> bool:
        expected = set(self.names) | set(self.connected)
        return all(n in self.finished or n in self.closed or n in self.left for n in expected) and set(
            self.names
        ) <= set(self.connected)

    def check_processes(self) -> None:
        for name, status in self.group.dead().items():
            if name not in self.connected:
                raise SmolError(f"{name}: worker exited with status {status} ({self.log_tail(name) or 'no log'})")

    def run(self, bind: str, control_addr: str, connect_timeout: float, idle_timeout: float) -> dict:
        try:
            server = ControlServer(
                bind,
                self.secret,
                self.config_for,
                port=self.cfg.control_port,
                corpus=self.corpus,
                heartbeat_s=self.cfg.heartbeat_s,
            )
        except OSError as e:  # a --control-port another program holds
            raise UsageError(
                f"--control-port {self.cfg.control_port}: cannot listen on {bind}: {e.strerror or e}"
            ) from None
        self.server = server
        self.console.print(f"control channel {control_addr}:{server.port}")
        started = time.monotonic()
        try:
            if not self.external:
                self.start_workers(control_addr, server.port)
            progress = None
            if self.console.is_terminal:
                from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

                progress = Progress(
                    TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=self.console
                )
                progress.add_task("starting", total=self.cfg.steps, completed=self.cfg.start_step)
                progress.start()
            try:
                last = time.monotonic()
                while not self.all_done():
                    self.check_liveness(server)
                    try:
                        who, msg = server.messages.get(timeout=0.5)
                    except queue.Empty:
                        self.check_processes()
                        now = time.monotonic()
                        if len(self.connected) < self.world and now - started > connect_timeout:
                            missing = [n for n in self.names if n not in self.connected]
                            raise SmolError(
                                f"{', '.join(missing)}: never connected within {connect_timeout:.0f}s "
                                f"({self.log_tail(missing[0]) or 'host unreachable?'})"
                            ) from None
                        if now - last > idle_timeout:
                            raise SmolError(
                                f"no word from any worker for {idle_timeout:.0f}s (a stalled link? "
                                "check it with `smolnet matrix`)"
                            ) from None
                        continue
                    if who is not None:  # only authenticated workers hold the clock
                        last = time.monotonic()
                    self.handle(who, msg, progress)
            finally:
                if progress is not None:
                    progress.stop()
        except BaseException:
            self.stop_workers()
            raise
        finally:
            server.close()
        for name in self.left:  # dropped, perhaps stalled: it will not finish by itself
            self.group.kill(name)
        self.group.wait(timeout=30)  # the others finish by themselves; stop_workers kills the rest
        self.stop_workers()
        return self.report()

    # --- failures: gather every rank's view, then blame (smoltrain.run.blame) ---
    def _gather(self, who: str, error: dict | None = None, died: bool = False) -> None:
        if self.views is None:
            self.views = blame.Views(list(self.names))
            self.blame_by = time.monotonic() + max(2.0, 2 * self.cfg.heartbeat_s)
        if error is not None:
            peer = error.get("peer")
            self.views.error(who, error.get("message", "failed"), peer if isinstance(peer, str) else None)
        if died and who not in self.views.errors:
            self.views.died[who] = self.log_tail(who)
        self._decide()

    def _decide(self, force: bool = False) -> None:
        v = self.views
        stalled = self.server.stalled() if self.server is not None else 0.0
        if stalled > dead_after(self.cfg.heartbeat_s) - self.cfg.heartbeat_s / 2:  # the workers' limit
            v.stalled = stalled
        alive = {n for n in self.names if n in self.connected and n not in self.finished and n not in self.left}
        if force or v.stalled or v.died or v.silent or v.complete(alive) or time.monotonic() > self.blame_by:
            who, why = blame.culprit(v)
            self.blamed = who
            raise SmolError(f"{who}: {why}")

    def check_liveness(self, server) -> None:
        """Workers whose authenticated heartbeats stopped (SIGSTOP, a cut link) fail the run."""
        exempt = self.left | self.finished | (set(self.connected) - {self.names[0]} if self.info.elastic else set())
        silent = server.silent([n for n in self.connected if n not in exempt])
        if silent:
            if self.views is None:
                self.views = blame.Views(list(self.names))
                self.blame_by = time.monotonic()
            self.views.silent.update(silent)
        if self.views is not None:
            self._decide()

    def report(self, partial: bool = False) -> dict:
        """The run report (smoltrain.run.report); `partial`: only the steps that finished."""
        from smoltrain.run.report import run_report

        return run_report(self, partial)
