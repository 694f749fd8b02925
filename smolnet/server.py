"""One threaded listener for every smolcluster port: handshakes in parallel, strangers capped.

Why: a listener that authenticates one connection at a time is stopped by one silent TCP
connection, and one that gives every connection a thread is stopped by a few hundred. Here
each unauthenticated connection gets its own short-lived thread and a short pre-authentication
deadline; at most `max_pending` of them (and `max_per_source` from one address) exist at once.

At a cap a pending stranger is evicted to make room: from the newcomer's own address at the
per-address cap, else from the address holding the most (so one address's strangers never
starve another's), the oldest first, but never one that has already answered the challenge
(its 64 bytes are waiting, or it is being verified): a cluster member answers within a round
trip, an idle or garbage connection never does. The evicted connection is told "busy" (the
wire's busy marker in place of the challenge or the server's proof), never a misleading
"secret rejected", and clients retry busy with backoff. Only when every pending connection has
answered does a newcomer itself get "busy". Even a sustained flood from a member's own address
therefore leaves it a turn: it is evicted only if `max_per_source` strangers arrive from its
address within its round trip, and then it retries. Only connections that passed the secret
reach the handler.
"""

from __future__ import annotations

import fcntl
import logging
import socket
import struct
import termios
import threading
import time

from smolnet import wire

log = logging.getLogger("smolnet.server")

PREAUTH_TIMEOUT = 3.0
MAX_PENDING = 64
MAX_PER_SOURCE = 16
ANSWER_BYTES = wire.NONCE_BYTES + wire.MAC_BYTES  # what a client sends in answer to the challenge


class _Pending:
    __slots__ = ("sock", "source", "since", "verifying")

    def __init__(self, sock: socket.socket, source: str):
        self.sock, self.source, self.since, self.verifying = sock, source, time.monotonic(), False

    def answered(self) -> bool:
        """Being verified, or its whole answer to the challenge waits in the socket buffer."""
        if self.verifying:
            return True
        try:
            buf = fcntl.ioctl(self.sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
        except (OSError, ValueError):
            return False
        return struct.unpack("i", buf)[0] >= ANSWER_BYTES


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
        stats: dict | None = None,
        with_key: bool = False,
    ):
        self.listener, self.secret, self.handler, self.name = listener, secret, handler, name
        self.preauth_timeout, self.max_pending = preauth_timeout, max_pending
        self.max_per_source = max_per_source
        self.quiet = _Quiet(log)  # a garbage flood must not become a log flood
        self.with_key = with_key  # handler(sock, peer, session_key) instead of handler(sock, peer)
        self.pending: list[_Pending] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.stats = stats if stats is not None else {}  # may be shared with the owner's own counters
        for k in ("accepted", "authenticated", "rejected", "timed_out", "evicted", "busy"):
            self.stats.setdefault(k, 0)
        self.port = listener.getsockname()[1]
        listener.settimeout(0.5)  # here, not in the thread: a close() right after start() must not race it
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
        # a bare close leaves the socket listening while the accept thread polls it (up to 0.5 s), and
        # a group rebuilt on this port at once would have its first connections taken and reset here
        shut(self.listener, close=True)
        with self.lock:
            for p in self.pending:
                shut(p.sock)

    # -- admission ---------------------------------------------------------------------
    def _admit(self, sock: socket.socket, source: str) -> _Pending | None:
        """Room for one more stranger: evict one that has not answered, or refuse (busy)."""
        with self.lock:
            same = [p for p in self.pending if p.source == source]
            if len(same) >= self.max_per_source:
                pools = [same]
            elif len(self.pending) >= self.max_pending:
                by_source: dict[str, list[_Pending]] = {}
                for p in self.pending:
                    by_source.setdefault(p.source, []).append(p)
                # the greediest address first (ties: the one with the oldest stranger)
                pools = sorted(by_source.values(), key=lambda ps: (-len(ps), min(p.since for p in ps)))
            else:
                pools = []
            if pools:
                victim = next(
                    (p for pool in pools for p in sorted(pool, key=lambda p: p.since) if not p.answered()), None
                )
                if victim is None:
                    self.stats["busy"] += 1
                    return None
                self.pending.remove(victim)
                self.stats["evicted"] += 1
                _evict(victim.sock)
            entry = _Pending(sock, source)
            self.pending.append(entry)
            return entry

    def _hold(self, entry: _Pending) -> bool:
        """The client answered: from now on nobody evicts it (False: it was evicted already)."""
        with self.lock:
            entry.verifying = entry in self.pending
            return entry.verifying

    def _forget(self, entry: _Pending) -> bool:
        with self.lock:
            if entry in self.pending:
                self.pending.remove(entry)
                return True
            return False  # evicted meanwhile

    def _accept_loop(self) -> None:
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
            key = wire.server_handshake(
                sock, self.secret, timeout=self.preauth_timeout, answered=lambda: self._hold(entry)
            )
        except wire.AuthError as e:
            self.stats["rejected"] += 1
            self.quiet.warning(f"{self.name}: {peer[0]}:{peer[1]} rejected: {e}")
            self._forget(entry)
            sock.close()
            return
        except (wire.WireError, OSError, TimeoutError) as e:
            self.stats["timed_out"] += 1
            log.info("%s: %s:%s dropped before authenticating: %s", self.name, peer[0], peer[1], e)
            self._forget(entry)
            sock.close()
            return
        if not self._forget(entry):  # cannot happen once held, but never serve an evicted socket
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


class _Quiet:
    """At most one warning a second; the ones held back are counted in the next."""

    def __init__(self, logger):
        self.log, self.next, self.held = logger, 0.0, 0

    def warning(self, msg: str) -> None:
        now = time.monotonic()
        if now < self.next:
            self.held += 1
            return
        more = f" (and {self.held} more like it)" if self.held else ""
        self.log.warning("%s%s", msg, more)
        self.next, self.held = now + 1.0, 0


def _evict(sock: socket.socket) -> None:
    """Tell an evicted stranger "busy" (in place of the challenge or of the server's proof; the
    client reads either as busy), then wake its handshake thread, which closes it."""
    try:
        sock.send(wire.BUSY_PROOF, socket.MSG_DONTWAIT)
    except OSError:
        pass
    shut(sock)


def shut(sock: socket.socket, close: bool = False) -> None:
    """Shut a socket down, then close it if asked; errors mean it is gone already. The shutdown
    wakes a thread blocked on it (recv, recvfrom, accept): a bare close leaves that thread blocked
    and the port bound, or a listener accepting, until its call returns."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # unconnected UDP says ENOTCONN, and wakes its reader all the same
        pass
    if close:
        try:
            sock.close()
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
