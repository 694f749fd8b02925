"""Talking to a measurement agent: authenticate, send one request frame, read one reply.

The controller and the agents themselves (an agent sending to another agent) use the
same few calls. One request per connection keeps the agent's state trivial. An agent that
says "busy" (its listener evicted us among a flood of strangers, or all its request slots are
taken) is asked again with backoff until the call's connect timeout: busy is a reason to wait,
never a failure by itself.
"""

from __future__ import annotations

import random
import socket
import time

from smolnet import wire
from smolnet.errors import SmolError

KIND_REQUEST = 1
KIND_REPLY = 2
KIND_ERROR = 3
KIND_DATA = 4
MAX_REPLY_PAYLOAD = 0  # replies carry JSON only


BACKOFF_FIRST, BACKOFF_MAX = 0.02, 0.5


class AgentError(SmolError):
    """The agent could not be reached, refused us, or reported a failure."""


class AgentBusy(AgentError):
    """The agent stayed busy for as long as we were prepared to wait."""


class _Backoff:
    """Waits that double from 20 ms to 0.5 s (jittered), until the deadline."""

    def __init__(self, seconds: float):
        self.deadline, self.wait = time.monotonic() + seconds, BACKOFF_FIRST

    def left(self) -> float:
        return max(0.05, self.deadline - time.monotonic())

    def sleep(self) -> bool:
        """Wait before the next try; False when the deadline comes first."""
        pause = self.wait * random.uniform(0.5, 1.0)
        if time.monotonic() + pause > self.deadline:
            return False
        time.sleep(pause)
        self.wait = min(self.wait * 2, BACKOFF_MAX)
        return True


class Conn:
    """An agent connection past the mutual secret check, and the wire.Session that MACs every
    frame on it (header and payload, in sequence): a frame injected into the TCP stream by a
    third party after the handshake fails its MAC, is logged and ends the connection."""

    def __init__(self, sock: socket.socket, key: bytes, client: bool):
        self.sock, self.session = sock, wire.Session(key, client=client, full=True)

    def send(self, kind: int, meta: dict, timeout: float) -> None:
        wire.send_frame(self.sock, kind, meta, timeout=timeout, session=self.session)

    def recv(self, timeout: float, max_payload: int = 0):
        return wire.recv_frame(self.sock, timeout=timeout, max_payload=max_payload, session=self.session)

    def close(self) -> None:
        self.sock.close()


def open_agent(addr: str, port: int, secret: bytes, timeout: float = 5.0, source: str | None = None) -> Conn:
    """A connection to an agent that has passed the mutual secret check (busy: tried again
    with backoff for up to `timeout`)."""
    backoff = _Backoff(timeout)
    while True:
        try:
            return _open_once(addr, port, secret, backoff.left(), source)
        except (wire.BusyError, ConnectionResetError) as e:
            if not backoff.sleep():
                raise AgentBusy(f"agent at {addr}:{port} stayed busy for {timeout:g}s ({e})") from None


def _open_once(addr: str, port: int, secret: bytes, timeout: float, source: str | None) -> Conn:
    try:
        sock = socket.create_connection((addr, port), timeout=timeout, source_address=(source, 0) if source else None)
    except OSError as e:
        raise AgentError(f"cannot connect to agent at {addr}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        key = wire.client_handshake(sock, secret, timeout=timeout)
    except (wire.BusyError, ConnectionResetError):
        sock.close()
        raise
    except wire.AuthError as e:
        sock.close()
        raise AgentError(f"agent at {addr}:{port}: {e}") from None
    except wire.PeerClosed:
        # the server hangs up right after a failed challenge; it never tells us why
        sock.close()
        raise AgentError(
            f"agent at {addr}:{port} closed the connection during the handshake: it rejects our cluster secret"
        ) from None
    except (wire.WireError, TimeoutError, OSError) as e:
        sock.close()
        raise AgentError(f"agent at {addr}:{port}: handshake failed: {e}") from None
    return Conn(sock, key, client=True)


def send_request(conn: Conn, op: str, /, timeout: float = 10.0, **params) -> None:
    conn.send(KIND_REQUEST, {"op": op, **params}, timeout=timeout)


def read_reply(conn: Conn, timeout: float, where: str = "agent") -> dict:
    try:
        kind, meta, _ = conn.recv(timeout, max_payload=MAX_REPLY_PAYLOAD)
    except TimeoutError:
        raise AgentError(f"{where}: no reply within {timeout:g}s") from None
    except (wire.WireError, OSError) as e:
        raise AgentError(f"{where}: {e}") from None
    if kind == KIND_ERROR:
        error = str(meta.get("error", "failed"))
        raise (AgentBusy if error.startswith("busy:") else AgentError)(f"{where}: {error}")
    if kind != KIND_REPLY:
        raise AgentError(f"{where}: unexpected frame kind {kind}")
    return meta


def call(
    addr: str, port: int, secret: bytes, op: str, /, timeout: float = 10.0, connect_timeout: float = 5.0, **params
) -> dict:
    """One request, one reply, connection closed; busy is asked again until connect_timeout."""
    backoff = _Backoff(connect_timeout)
    while True:
        conn = open_agent(addr, port, secret, timeout=backoff.left())
        try:
            send_request(conn, op, **params)
            return read_reply(conn, timeout, where=f"agent at {addr}:{port} ({op})")
        except AgentBusy:
            if not backoff.sleep():
                raise
        except (wire.WireError, TimeoutError, OSError) as e:
            raise AgentError(f"agent at {addr}:{port} ({op}): {e}") from None
        finally:
            conn.close()
