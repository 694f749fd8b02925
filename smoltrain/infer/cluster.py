"""The controller side of inference: start the ranks, hand them the config, drive requests.

Ranks start as in `smoltrain run` (loopback processes for `--local N`, SSH for the
inventory's hosts, the secret on standard input) but run `smoltrain.infer.worker`,
which stays up between requests so `serve` pays the model load once. Requests go to
every rank (rank 0 batches them; the others need a prompt's settings when rank 0 starts
it); a dispatcher thread hands rank 0's tokens to each request's callback. A rank that
dies or goes silent ends every open request with its one-line reason, never a hang.
"""

from __future__ import annotations

import logging
import queue
import shutil
import socket
import sys
import threading
import time

from smolnet import wire
from smolnet.launcher import ProcessGroup, remote_log
from smolnet.server import AuthListener
from smoltrain.infer.config import InferConfig
from smoltrain.infer.runner import MAX_IDS, RankDied, RequestFailed, Runner, pack_ids, unpack_ids
from smoltrain.run import WORKER_IMPORTS

MSG = 1
log = logging.getLogger("smoltrain.infer")
__all__ = ["Cluster", "RankDied"]


class Cluster(Runner):
    def __init__(
        self,
        cfg: InferConfig,
        placements,
        secret: bytes,
        log_dir: str,
        bind: str = "127.0.0.1",
        control_addr: str = "127.0.0.1",
        own_logs: bool = False,
    ):
        self.cfg, self.placements, self.secret, self.log_dir = cfg, placements, secret, log_dir
        self.own_logs = own_logs  # a folder made for this cluster goes on a clean close; a caller's stays
        super().__init__()
        self.bind, self.control_addr = bind, control_addr
        self.world = cfg.world_size
        remote = all(p.host is not None and not p.host.local for p in placements)
        # ranks on other hosts start from the warm server there that the training workers and
        # calibrate's probes use (smolnet.warm); local ranks stay direct children of this process
        # (serve watches them as its children)
        self.group = ProcessGroup(secret, log_dir, WORKER_IMPORTS if remote else None)  # started by _launch
        self.socks: dict[int, socket.socket] = {}
        self.sessions: dict[int, wire.Session] = {}  # every control frame MACed, payload too
        self.messages: queue.Queue = queue.Queue()
        self.replies: queue.Queue = queue.Queue()  # answers to `stats`
        self.send_lock = threading.Lock()
        self.stats_lock = threading.Lock()
        self.closing = False

    # --- start ---
    def start(self, timeout: float = 120.0) -> None:
        """Handshakes run in parallel behind smolnet.server.AuthListener, so a few silent (or
        hostile) connections cannot hold up the ranks' registration."""
        listener = socket.create_server((self.bind, 0))
        hellos: queue.Queue = queue.Queue()
        server = AuthListener(listener, self.secret, self._greet(hellos), name="inference control", with_key=True)
        try:
            server.start()
            self._launch(server.port)
            deadline = time.monotonic() + timeout
            while len(self.socks) < self.world:
                self._check_procs()
                if time.monotonic() > deadline:
                    missing = [self.cfg.names[r] for r in range(self.world) if r not in self.socks]
                    raise RankDied(
                        f"{', '.join(missing)}: never connected within {timeout:.0f}s "
                        f"({self.log_tail(self.cfg.names.index(missing[0])) or 'host unreachable?'})"
                    )
                try:
                    rank, sock, ses = hellos.get(timeout=0.5)
                except queue.Empty:
                    continue
                try:
                    if rank in self.socks:
                        raise wire.WireError(f"rank {rank} is already registered")
                    config = {"type": "config", "config": self.cfg.to_wire()}
                    wire.send_frame(sock, MSG, config, timeout=10.0, session=ses)
                except (OSError, wire.WireError, TimeoutError) as e:
                    log.warning("inference control: dropped a registration of rank %s: %s", rank, e)
                    sock.close()
                    continue
                self.socks[rank], self.sessions[rank] = sock, ses
                threading.Thread(target=self._read, args=(rank, sock), daemon=True).start()
        finally:
            server.close()
            while not hellos.empty():
                hellos.get_nowait()[1].close()
        ready = set()
        while len(ready) < self.world:
            rank, msg = self._next(timeout)
            if msg.get("type") == "ready":
                ready.add(rank)
        threading.Thread(target=self._dispatch, daemon=True).start()

    def _greet(self, hellos: queue.Queue):
        """An authenticated connection's hello (MACed, as is every frame after it) to `hellos`."""

        def greet(sock: socket.socket, peer, key: bytes) -> None:
            ses = wire.Session(key, client=False, full=True)
            try:
                _, hello, _ = wire.recv_frame(sock, timeout=10.0, max_payload=0, session=ses)
                rank = hello.get("rank")
                if hello.get("type") != "hello" or not isinstance(rank, int) or not 0 <= rank < self.world:
                    raise wire.WireError(f"unexpected hello {str(hello)[:120]}")
            except (OSError, wire.WireError, TimeoutError) as e:
                log.warning("inference control: dropped %s:%s: %s", peer[0], peer[1], e)
                sock.close()
                return
            hellos.put((rank, sock, ses))

        return greet

    def _launch(self, port: int) -> None:
        for r, p in enumerate(self.placements):
            argv = ["-m", "smoltrain.infer.worker", "--control", f"{self.control_addr}:{port}", "--rank", str(r)]
            python = sys.executable if p.host is None else p.host.python
            self.group.start(p.name, [python, *argv], host=p.host, log=remote_log(self.log_dir, p.name))

    @property
    def procs(self) -> list:
        """The ranks started so far, in rank order: Popen (local) or (Remote, Proc)."""
        return list(self.group.procs.values())

    def _check_procs(self) -> None:
        for name, status in self.group.dead().items():  # the first rank that died
            r = self.group.names().index(name)
            raise RankDied(f"{self.cfg.names[r]}: exited with status {status} ({self.log_tail(r) or 'no log'})")

    def log_tail(self, r: int) -> str:
        return self.group.log_tail(self.placements[r].name) if r < len(self.placements) else ""

    def _read(self, rank: int, sock: socket.socket) -> None:
        while True:
            try:
                _, msg, payload = wire.recv_frame(
                    sock, timeout=None, max_payload=4 * MAX_IDS, session=self.sessions[rank]
                )
                if payload:  # token ids (a `done`'s output) travel as the payload, never in the JSON
                    msg["ids"] = unpack_ids(payload)
            except (OSError, wire.WireError, TimeoutError, ValueError) as e:
                if isinstance(e, wire.WireError) and not isinstance(e, wire.PeerClosed):  # forged, altered: dropped
                    log.warning("inference control: %s: frame dropped, connection closed: %s", self.cfg.names[rank], e)
                self.messages.put((rank, {"type": "closed"}))
                return
            self.messages.put((rank, msg))

    def _poll(self, timeout: float):
        """The next message from any rank, or None after timeout; a failed or closed rank raises RankDied."""
        if self.dead:
            raise RankDied(self.dead)
        try:
            rank, msg = self.messages.get(timeout=timeout)
        except queue.Empty:
            return None
        name = self.cfg.names[rank]
        if msg.get("type") == "error":
            self.dead = f"{name}: {msg.get('message')}"
        elif msg.get("type") == "closed":
            time.sleep(0.2)  # let its error message, if any, arrive first
            while not self.messages.empty():
                r, m = self.messages.get_nowait()
                if m.get("type") == "error":
                    self.dead = f"{self.cfg.names[r]}: {m.get('message')}"
                    break
            else:
                self.dead = f"{name}: rank exited ({self.log_tail(rank) or 'no log'})"
        else:
            return rank, msg
        raise RankDied(self.dead)

    def _next(self, timeout: float):
        """The next message from any rank; silence for `timeout` raises RankDied."""
        deadline = time.monotonic() + timeout
        while True:
            got = self._poll(min(0.5, max(0.01, deadline - time.monotonic())))
            if got is not None:
                return got
            if time.monotonic() > deadline:
                self.dead = f"no word from the ranks for {timeout:.0f}s"
                raise RankDied(self.dead)

    # --- requests ---
    def _dispatch(self) -> None:
        """Rank 0's tokens and ends to their requests; a dead or silent rank fails them all."""
        heard = time.monotonic()
        while not self.closing:
            try:
                got = self._poll(1.0)
                if got is None:
                    self._check_procs()
            except RankDied as e:
                return self._fail(str(e))
            if got is not None:
                rank, msg = got
                kind = msg.get("type")
                if kind == "tokens" and rank == 0:
                    heard = time.monotonic()
                    self._tokens(msg.get("items") or [])
                elif kind == "done" and rank == 0:
                    heard = time.monotonic()
                    stats = dict(msg.get("stats") or {}, output_ids=msg.get("ids") or [])
                    self._done(msg["rid"], msg.get("reason"), stats)
                elif kind == "stats":
                    self.replies.put((rank, msg))
            if not self.handles:
                heard = time.monotonic()
            elif time.monotonic() - heard > self.cfg.timeout:
                return self._fail(f"no token from the ranks for {self.cfg.timeout:.0f}s")

    def _admit(self, req) -> None:
        """Every rank gets the request; its prompt ids as the frame's payload. Packed once, before
        anything is sent: a request that cannot be packed fails alone (RequestFailed)."""
        meta = {"type": "admit", "request": {k: v for k, v in req.to_dict().items() if k != "prompt_ids"}}
        ids = pack_ids(req.prompt_ids)
        try:
            wire.pack_header(MSG, meta, len(ids))
        except (wire.WireError, TypeError, ValueError) as e:
            raise RequestFailed(f"the request cannot be sent to the ranks: {e}") from None
        for r in reversed(range(self.world)):  # rank 0 last: the others have it before it starts
            self._send(r, meta, ids)

    def cancel(self, rid: int) -> None:
        """Rank 0 ends the request at its next step."""
        try:
            self._send(0, {"type": "cancel", "rid": rid})
        except RankDied:
            pass

    def health(self) -> None:
        """Every rank still runs and answers on its control channel."""
        try:
            self._check_procs()
            self.stats(timeout=min(10.0, self.cfg.timeout))
        except RankDied as e:
            self._fail(str(e))
            raise

    def stats(self, timeout: float = 10.0) -> list[dict]:
        with self.stats_lock:
            return self._stats(timeout)

    def _stats(self, timeout: float) -> list[dict]:
        while not self.replies.empty():
            self.replies.get_nowait()
        for r in range(self.world):
            self._send(r, {"type": "stats"})
        got: dict[int, dict] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.world:
            try:
                rank, msg = self.replies.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise RankDied(f"no stats from the ranks within {timeout:.0f}s") from None
            links = [tuple(x) for x in msg["links"]]
            got[rank] = {"stats": msg["stats"], "links": links, "machine": msg.get("machine") or {}}
        return [got[r] for r in range(self.world)]

    def _send(self, rank: int, msg: dict, payload: bytes = b"") -> None:
        if self.dead:
            raise RankDied(self.dead)
        try:
            with self.send_lock:
                wire.send_frame(self.socks[rank], MSG, msg, payload, timeout=10.0, session=self.sessions[rank])
        except (OSError, wire.WireError, TimeoutError) as e:
            self._fail(f"{self.cfg.names[rank]}: control connection lost ({e})")
            raise RankDied(self.dead) from None

    def close(self) -> None:
        failed = self.dead  # before the ranks quit (their exit reads as `dead` from here on)
        self.closing = True
        for r, s in list(self.socks.items()):
            try:
                wire.send_frame(s, MSG, {"type": "quit"}, timeout=2.0, session=self.sessions[r])
            except Exception:
                pass
        self.group.wait(timeout=30)  # the ranks quit by themselves (slowly on a loaded host); stop kills what did not
        self.group.stop()
        for s in self.socks.values():
            s.close()
        if not self.own_logs:
            return
        quit_badly = self.group.dead()  # ranks that served every request, then exited non-zero
        if not failed and not quit_badly:  # as `run`: kept when a rank failed
            shutil.rmtree(self.log_dir, ignore_errors=True)
        elif not failed:
            said = ", ".join(f"{self.cfg.names[self.group.names().index(n)]} status {s}" for n, s in quit_badly.items())
            log.warning("inference ranks exited badly on close (%s); their logs: %s", said, self.log_dir)
