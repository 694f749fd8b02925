"""The control channel between `smoltrain run` (the controller) and its workers.

Each worker dials the controller, proves it knows the cluster secret, says who it
is (`hello`), and receives the run configuration as JSON with the training
corpus as the frame's payload (so every host trains on the controller's exact
bytes, with no shared storage and no per-host differences). From then on it streams
small JSON messages: per-step stats, events, log lines, checkpoint notices, and
finally its measured link bytes (`done`) or an `error`. Control traffic is not
training traffic: none of it is counted in the run report's bytes.
"""

from __future__ import annotations

import hashlib
import os
import queue
import socket
import sys
import threading
import time

from smolnet import wire
from smolnet.server import AuthListener, shut
from smoltrain.run.config import ConfigError, RunConfig

MSG = 1  # every control frame: a JSON header; only the config frame has a payload (the corpus)
MAX_CORPUS = 256 << 20
MISSED_BEATS = 5  # a peer silent for this many heartbeat intervals is stopped or cut off


def dead_after(heartbeat_s: float) -> float:
    return MISSED_BEATS * heartbeat_s


class _Peer:
    def __init__(self, sock: socket.socket, session: wire.Session):
        self.sock, self.lock, self.seen, self.session = sock, threading.Lock(), time.monotonic(), session


class ControlServer:
    """Controller side: accepts workers, hands out configs, queues their messages.

    Only authenticated frames count as a sign of life: strangers never reach the queue, and
    `silent()` names every worker whose heartbeats stopped. The controller beats back, so a
    worker cut off from it notices too."""

    def __init__(
        self, bind: str, secret: bytes, config_for, port: int = 0, corpus: bytes = b"", heartbeat_s: float = 1.0
    ):
        self.secret, self.config_for, self.corpus = secret, config_for, corpus
        self.heartbeat_s = heartbeat_s
        self.messages: queue.Queue = queue.Queue()
        self.closing = False
        self.peers: dict[str, _Peer] = {}
        self.asleep: float | None = None  # when the heartbeat thread last went to sleep
        self.stalled_s = 0.0  # the longest gap between two beats: this process itself was stopped
        self.listener = AuthListener.serve(bind, port, secret, self._serve, name="control", with_key=True)
        self.port = self.listener.port
        threading.Thread(target=self._beat, daemon=True).start()

    def _serve(self, sock: socket.socket, addr, key: bytes) -> None:
        who = None
        ses = wire.Session(key, client=False)  # every frame's header MACed, in sequence
        try:
            kind, hello, _ = wire.recv_frame(sock, timeout=10.0, max_payload=0, session=ses)
            if kind != MSG or hello.get("type") != "hello":
                raise wire.WireError("first message is not a hello")
            cfg, rank, name = self.config_for(hello)
            who = name
            peer = _Peer(sock, ses)
            with peer.lock:
                wire.send_frame(
                    sock,
                    MSG,
                    {
                        "type": "config",
                        "config": cfg.to_wire(),
                        "rank": rank,
                        "name": name,
                        "corpus_sha256": hashlib.sha256(self.corpus).hexdigest(),
                    },
                    payload=self.corpus,
                    timeout=60.0,
                    session=ses,
                )
            peer.seen = time.monotonic()
            self.peers[who] = peer
            self.messages.put((who, {"type": "connected", "hello": hello}))
            while not self.closing:
                try:
                    kind, msg, _ = wire.recv_frame(sock, timeout=3600.0, max_payload=0, session=ses)
                except TimeoutError:
                    continue
                peer.seen = time.monotonic()
                if msg.get("type") != "heartbeat":
                    self.messages.put((who, msg))
        except (OSError, wire.WireError, TimeoutError, ValueError, KeyError) as e:
            if who is None:  # an authenticated peer that is not one of ours: worth a line
                self.messages.put((None, {"type": "log", "message": f"control: refused {addr[0]}: {e}"}))
        finally:
            sock.close()
            if who is not None:
                self.peers.pop(who, None)  # gone, not silent: "closed" says so
                self.messages.put((who, {"type": "closed"}))

    def _beat(self) -> None:
        while not self.closing:
            self.asleep = time.monotonic()
            time.sleep(self.heartbeat_s)
            self.stalled_s = max(self.stalled_s, time.monotonic() - self.asleep)
            self.asleep = None
            for peer in list(self.peers.values()):
                if peer.lock.acquire(blocking=False):  # never queue behind a stuck send
                    try:
                        wire.send_frame(
                            peer.sock, MSG, {"type": "heartbeat"}, timeout=self.heartbeat_s, session=peer.session
                        )
                    except (OSError, TimeoutError, wire.WireError):
                        pass
                    finally:
                        peer.lock.release()

    def stalled(self) -> float:
        """The longest gap between two of this controller's beats so far (one heartbeat when all
        is well; the length of a SIGSTOP or a suspended machine when not): near dead_after its
        workers gave up on it, and their silence or exit is no fault of theirs."""
        asleep = self.asleep
        now = time.monotonic() - asleep if asleep is not None else 0.0
        return max(self.stalled_s, now)

    def silent(self, names=None) -> dict[str, float]:
        """Connected workers whose last authenticated frame is older than dead_after: seconds."""
        now, limit = time.monotonic(), dead_after(self.heartbeat_s)
        return {
            who: now - p.seen
            for who, p in list(self.peers.items())
            if (names is None or who in names) and now - p.seen > limit
        }

    def close(self) -> None:
        self.closing = True
        self.listener.close()
        for p in list(self.peers.values()):
            shut(p.sock)


class ControlClient:
    """Worker side: one connection to the controller, safe to use from several threads.

    Beats every heartbeat interval; a watchdog ends this process when the controller has been
    silent for dead_after (cut off, stopped or gone), since nobody else would ever stop it."""

    def __init__(self, addr: str, port: int, secret: bytes, hello: dict, timeout: float = 60.0, on_lost=None):
        self.sock, key = wire.connect(addr, port, secret, timeout=timeout, what="controller", keyed=True)
        self.session = wire.Session(key, client=True)
        self.lock = threading.Lock()
        self.finished = False
        wire.send_frame(self.sock, MSG, dict(hello, type="hello"), timeout=10.0, session=self.session)
        kind, msg, self.corpus = wire.recv_frame(self.sock, timeout=60.0, max_payload=MAX_CORPUS, session=self.session)
        if kind != MSG or msg.get("type") != "config":
            raise wire.WireError("controller did not send a config")
        if msg.get("corpus_sha256") != hashlib.sha256(self.corpus).hexdigest():  # the header MAC covers this
            raise wire.WireError("the corpus does not match the controller's authenticated digest")
        self.config = RunConfig.from_wire(msg.get("config"))
        self.rank, self.name = msg.get("rank"), msg.get("name")
        if not isinstance(self.rank, int) or not isinstance(self.name, str):
            raise ConfigError("controller sent a config without this worker's rank and name")
        self.on_lost = on_lost or _exit_lost
        self.heartbeat_s = self.config.heartbeat_s
        threading.Thread(target=self._watch, daemon=True).start()
        threading.Thread(target=self._beat, daemon=True).start()

    def _watch(self) -> None:
        limit = dead_after(self.heartbeat_s)
        while True:
            try:
                wire.recv_frame(self.sock, timeout=limit, max_payload=0, session=self.session)
            except TimeoutError:
                return self.on_lost(f"no heartbeat from the controller for {limit:g}s (cut off or stopped)")
            except (OSError, wire.WireError) as e:
                if not self.finished:
                    self.on_lost(f"lost the controller: {e}")
                return

    def _beat(self) -> None:
        while not self.finished:
            time.sleep(self.heartbeat_s)
            if self.lock.acquire(blocking=False):
                try:
                    wire.send_frame(
                        self.sock, MSG, {"type": "heartbeat"}, timeout=self.heartbeat_s, session=self.session
                    )
                except (OSError, TimeoutError, wire.WireError):
                    pass
                finally:
                    self.lock.release()

    def send(self, msg: dict) -> None:
        if msg.get("type") in ("done", "error"):
            self.finished = True  # the controller may hang up on us from now on
        with self.lock:
            wire.send_frame(self.sock, MSG, msg, timeout=30.0, session=self.session)

    def close(self) -> None:
        self.finished = True
        self.sock.close()


def _exit_lost(why: str) -> None:
    print(f"smoltrain worker: {why}; exiting", file=sys.stderr, flush=True)
    os._exit(3)
