"""One threaded listener for every smolcluster port: handshakes in parallel, strangers capped.

Why: a listener that authenticates one connection at a time is stopped by one silent TCP
connection, and one that gives every connection a thread is stopped by a few hundred. Here
each unauthenticated connection gets its own short-lived thread and a short pre-authentication
deadline; at most `max_pending` of them (and `max_per_source` from one address) exist at once.
When a cap is reached the oldest pending stranger is evicted (a legitimate handshake takes
milliseconds, an idle one is the likely attacker); only when every pending connection is
younger than `min_age` does the listener shed the new one with an explicit "busy" (never a
misleading "secret rejected"). Only connections that passed the secret reach the handler.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from smolnet import wire

log = logging.getLogger("smolnet.server")

PREAUTH_TIMEOUT = 3.0
MAX_PENDING = 64
MAX_PER_SOURCE = 16
MIN_AGE = 0.5


class _Pending:
    __slots__ = ("sock", "source", "since")

    def __init__(self, sock: socket.socket, source: str):
        self.sock, self.source, self.since = sock, source, time.monotonic()


class AuthListener:
    """Accepts on `listener`, runs the server handshake concurrently, calls handler(sock, peer)."""

    def __init__(
        self,
        listener: socket.socket,
        secret: bytes,
        handler,
        name: str = "listener",
        preauth_timeout: float = PREAUTH_TIMEOUT,
        max_pending: int = MAX_PENDING,
        max_per_source: int = MAX_PER_SOURCE,
        min_age: float = MIN_AGE,
        stats: dict | None = None,
        with_key: bool = False,
    ):
        self.listener, self.secret, self.handler, self.name = listener, secret, handler, name
        self.preauth_timeout, self.max_pending = preauth_timeout, max_pending
        self.max_per_source, self.min_age = max_per_source, min_age
        self.with_key = with_key  # handler(sock, peer, session_key) instead of handler(sock, peer)
        self.pending: list[_Pending] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.stats = stats if stats is not None else {}  # may be shared with the owner's own counters
        for k in ("accepted", "authenticated", "rejected", "timed_out", "evicted", "busy"):
            self.stats.setdefault(k, 0)
        self.port = listener.getsockname()[1]
        self.thread = threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True)

    @classmethod
    def serve(cls, bind: str, port: int, secret: bytes, handler, backlog: int = 128, **kw) -> AuthListener:
        """Bind, listen and start in one call."""
        sock = socket.create_server((bind, port), backlog=backlog)
        srv = cls(sock, secret, handler, **kw)
        srv.start()
        return srv

    def start(self) -> AuthListener:
        self.thread.start()
        return self

    def close(self) -> None:
        self.stopping.set()
        try:
            self.listener.close()
        except OSError:
            pass
        with self.lock:
            for p in self.pending:
                _shut(p.sock)

    # -- admission ---------------------------------------------------------------------
    def _admit(self, sock: socket.socket, source: str) -> _Pending | None:
        """Room for one more stranger: evict the oldest idle one at a cap, or refuse (busy)."""
        now = time.monotonic()
        with self.lock:
            same = [p for p in self.pending if p.source == source]
            pool = (
                same
                if len(same) >= self.max_per_source
                else (self.pending if len(self.pending) >= self.max_pending else None)
            )
            if pool is not None:
                oldest = min(pool, key=lambda p: p.since)
                if now - oldest.since < self.min_age:
                    self.stats["busy"] += 1
                    return None
                self.pending.remove(oldest)
                self.stats["evicted"] += 1
                _shut(oldest.sock)
            entry = _Pending(sock, source)
            self.pending.append(entry)
            return entry

    def _forget(self, entry: _Pending) -> bool:
        with self.lock:
            if entry in self.pending:
                self.pending.remove(entry)
                return True
            return False  # evicted meanwhile

    def _accept_loop(self) -> None:
        self.listener.settimeout(0.5)
        while not self.stopping.is_set():
            try:
                sock, peer = self.listener.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self.stopping.is_set():
                    return
                log.warning("%s: accept failed: %s", self.name, e)
                time.sleep(0.05)
                continue
            self.stats["accepted"] += 1
            entry = self._admit(sock, peer[0])
            if entry is None:
                _say_busy(sock)
                continue
            try:
                threading.Thread(target=self._greet, args=(entry, peer), name=f"{self.name}-auth", daemon=True).start()
            except RuntimeError:  # out of threads: shed this one, keep serving
                self._forget(entry)
                self.stats["busy"] += 1
                _say_busy(sock)

    def _greet(self, entry: _Pending, peer) -> None:
        sock = entry.sock
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            key = wire.server_handshake(sock, self.secret, timeout=self.preauth_timeout)
        except wire.AuthError as e:
            self.stats["rejected"] += 1
            log.warning("%s: %s:%s rejected: %s", self.name, peer[0], peer[1], e)
            self._forget(entry)
            sock.close()
            return
        except (wire.WireError, OSError, TimeoutError) as e:
            self.stats["timed_out"] += 1
            log.info("%s: %s:%s dropped before authenticating: %s", self.name, peer[0], peer[1], e)
            self._forget(entry)
            sock.close()
            return
        if not self._forget(entry):  # evicted after all, at the last moment
            sock.close()
            return
        self.stats["authenticated"] += 1
        try:
            if self.with_key:
                self.handler(sock, peer, key)
            else:
                self.handler(sock, peer)
        except Exception as e:  # a handler bug costs one connection, never the listener
            log.exception("%s: handler failed for %s: %s", self.name, peer[0], e)
            sock.close()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _say_busy(sock: socket.socket) -> None:
    try:
        sock.setblocking(False)
        sock.send(wire.MAGIC_BUSY)
    except OSError:
        pass
    finally:
        sock.close()
