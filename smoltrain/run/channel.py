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

import queue
import socket
import threading

from smolnet import wire
from smoltrain.run.config import ConfigError, RunConfig

MSG = 1  # every control frame: a JSON header; only the config frame has a payload (the corpus)
MAX_CORPUS = 256 << 20


class ControlServer:
    """Controller side: accepts workers, hands out configs, queues their messages."""

    def __init__(self, bind: str, secret: bytes, config_for, port: int = 0, corpus: bytes = b""):
        self.secret, self.config_for, self.corpus = secret, config_for, corpus
        self.messages: queue.Queue = queue.Queue()
        self.listener = socket.create_server((bind, port))
        self.listener.settimeout(0.5)
        self.port = self.listener.getsockname()[1]
        self.closing = False
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def _accept_loop(self) -> None:
        while not self.closing:
            try:
                sock, addr = self.listener.accept()
            except (socket.timeout, OSError):
                continue
            threading.Thread(target=self._serve, args=(sock, addr), daemon=True).start()

    def _serve(self, sock: socket.socket, addr) -> None:
        who = None
        try:
            wire.server_handshake(sock, self.secret, timeout=10.0)
            kind, hello, _ = wire.recv_frame(sock, timeout=10.0, max_payload=0)
            if kind != MSG or hello.get("type") != "hello":
                raise wire.WireError("first message is not a hello")
            cfg, rank, name = self.config_for(hello)
            who = name
            self.conns.append(sock)
            wire.send_frame(sock, MSG, {"type": "config", "config": cfg.to_wire(), "rank": rank, "name": name},
                            payload=self.corpus, timeout=60.0)
            self.messages.put((who, {"type": "connected", "hello": hello}))
            while not self.closing:
                try:
                    kind, msg, _ = wire.recv_frame(sock, timeout=3600.0, max_payload=0)
                except TimeoutError:
                    continue
                self.messages.put((who, msg))
        except (OSError, wire.WireError, TimeoutError, ValueError, KeyError) as e:
            if who is None:
                self.messages.put((None, {"type": "log", "message": f"control: refused {addr[0]}: {e}"}))
        finally:
            sock.close()
            if who is not None:
                self.messages.put((who, {"type": "closed"}))

    def close(self) -> None:
        self.closing = True
        self.listener.close()
        for s in list(self.conns):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class ControlClient:
    """Worker side: one connection to the controller, safe to use from several threads."""

    def __init__(self, addr: str, port: int, secret: bytes, hello: dict, timeout: float = 60.0):
        self.sock = wire.connect(addr, port, secret, timeout=timeout, what="controller")
        self.lock = threading.Lock()
        wire.send_frame(self.sock, MSG, dict(hello, type="hello"), timeout=10.0)
        kind, msg, self.corpus = wire.recv_frame(self.sock, timeout=60.0, max_payload=MAX_CORPUS)
        if kind != MSG or msg.get("type") != "config":
            raise wire.WireError("controller did not send a config")
        self.config = RunConfig.from_wire(msg.get("config"))
        self.rank, self.name = msg.get("rank"), msg.get("name")
        if not isinstance(self.rank, int) or not isinstance(self.name, str):
            raise ConfigError("controller sent a config without this worker's rank and name")

    def send(self, msg: dict) -> None:
        with self.lock:
            wire.send_frame(self.sock, MSG, msg, timeout=30.0)

    def close(self) -> None:
        self.sock.close()
