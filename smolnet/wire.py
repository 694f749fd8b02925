"""The smolcluster wire: HMAC challenge-response, then frames.

A frame is a fixed 20-byte binary header, a small JSON header and raw payload bytes.
Nothing executable ever crosses: no object serialization, no code. Every length is checked against
a bound before a single byte is allocated for it, and every read has a deadline.

Handshake (mutual, fixed sizes, so nothing unbounded is read before it succeeds):
  server -> client: MAGIC_AUTH + nonce_s (32 bytes)
  client -> server: nonce_c (32) + HMAC(secret, b"client" + nonce_s + nonce_c)
  server -> client: HMAC(secret, b"server" + nonce_c + nonce_s)
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
import time

from smolnet.errors import SmolError

MAGIC_AUTH = b"SMOLAUTH1"
MAGIC_BUSY = b"SMOLBUSY1"  # instead of MAGIC_AUTH: the listener sheds load, try again later
# sent to a stranger the listener evicts; it starts with MAGIC_BUSY (read in place of the
# challenge) and is MAC-sized (read in place of the server's proof): busy either way
BUSY_PROOF = MAGIC_BUSY + b"\0" * (32 - len(MAGIC_BUSY))
NONCE_BYTES = 32
MAC_BYTES = 32
FRAME_MAGIC = b"SMOL"
FRAME_VERSION = 1
# magic, version, kind, reserved, json length, payload length
FRAME_HEADER = struct.Struct("!4sBBHIQ")
MAX_JSON_BYTES = 64 * 1024
DEFAULT_MAX_PAYLOAD = 1 << 30


class WireError(SmolError):
    """A peer sent something we will not accept; the connection must be closed."""


class AuthError(WireError):
    pass


class PeerClosed(WireError):
    pass


class ForgedFrame(WireError):
    """A frame failed its session MAC: injected, replayed, reordered or altered on the way."""


class BusyError(WireError):
    """The listener is shedding unauthenticated connections; retrying later may succeed."""


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out waiting for peer")
    return left


def _early(deadline: float | None) -> bool:
    """A timeout before our own deadline: a socket's timeout is one setting shared by every
    thread using it (a control connection reads in one thread and sends from another), so a
    read meant to wait for ever can be cut short by a send's timeout set in between. Nothing
    was transferred (the wait timed out first): go on waiting."""
    return deadline is None or time.monotonic() < deadline


def recv_exact_into(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill view completely from sock (short reads looped) or raise."""
    got = 0
    n = len(view)
    while got < n:
        sock.settimeout(_remaining(deadline))
        try:
            k = sock.recv_into(view[got:], n - got)
        except TimeoutError:
            if _early(deadline):  # another thread's send set a shorter timeout on this socket
                continue
            raise TimeoutError("timed out waiting for peer") from None
        if k == 0:
            raise PeerClosed(f"peer closed the connection after {got} of {n} bytes")
        got += k


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf), deadline)
    return bytes(buf)


def send_all(sock: socket.socket, data, deadline: float | None = None) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        sock.settimeout(_remaining(deadline))
        try:
            k = sock.send(view)
        except TimeoutError:
            if _early(deadline):  # another thread's read set a shorter timeout on this socket
                continue
            raise TimeoutError("timed out sending to peer") from None
        view = view[k:]


def _mac(secret: bytes, role: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(secret, role + a + b, hashlib.sha256).digest()


def session_key(secret: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    """Fresh per connection: both nonces are in it, so no frame MAC is valid on another one."""
    return _mac(secret, b"session", nonce_s, nonce_c)


def server_handshake(sock: socket.socket, secret: bytes, timeout: float = 5.0, answered=None) -> bytes:
    """Prove the peer knows the secret before anything else is read from it; returns the session key.

    answered: called once the peer's answer is in; False means the listener evicted this
    connection meanwhile (it has told the peer "busy"), so stop here."""
    deadline = _deadline(timeout)
    nonce_s = os.urandom(NONCE_BYTES)
    send_all(sock, MAGIC_AUTH + nonce_s, deadline)
    reply = recv_exact(sock, NONCE_BYTES + MAC_BYTES, deadline)
    if answered is not None and not answered():
        raise PeerClosed("evicted before its answer was read")
    nonce_c, mac = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
    if not hmac.compare_digest(mac, _mac(secret, b"client", nonce_s, nonce_c)):
        raise AuthError("peer failed the cluster-secret challenge")
    send_all(sock, _mac(secret, b"server", nonce_c, nonce_s), deadline)
    return session_key(secret, nonce_s, nonce_c)


def client_handshake(sock: socket.socket, secret: bytes, timeout: float = 5.0) -> bytes:
    deadline = _deadline(timeout)
    magic = recv_exact(sock, len(MAGIC_AUTH), deadline)
    if magic == MAGIC_BUSY:
        raise BusyError("peer is busy (too many unauthenticated connections); try again")
    if magic != MAGIC_AUTH:
        raise AuthError("peer is not a smolcluster endpoint")
    nonce_s = recv_exact(sock, NONCE_BYTES, deadline)
    nonce_c = os.urandom(NONCE_BYTES)
    send_all(sock, nonce_c + _mac(secret, b"client", nonce_s, nonce_c), deadline)
    proof = recv_exact(sock, MAC_BYTES, deadline)
    if proof == BUSY_PROOF:
        raise BusyError("peer is busy (evicted among too many unauthenticated connections); try again")
    if not hmac.compare_digest(proof, _mac(secret, b"server", nonce_c, nonce_s)):
        raise AuthError("peer does not know the cluster secret")
    return session_key(secret, nonce_s, nonce_c)


TAG_BYTES = 16


class Session:
    """Frame authentication after the handshake: a MAC over every frame header and its sequence
    number (so frames cannot be injected, replayed or reordered), and with `full` over every
    payload too. One key per direction, derived from the session key, so a frame cannot be
    reflected back to its sender."""

    def __init__(self, key: bytes, client: bool, full: bool = False):
        c2s, s2c = (hmac.new(key, d, hashlib.sha256).digest() for d in (b"c2s", b"s2c"))
        self.tx_key, self.rx_key = (c2s, s2c) if client else (s2c, c2s)
        self.tx_seq = self.rx_seq = 0
        self.full = full

    @staticmethod
    def _tag(key: bytes, seq: int, what: bytes, data) -> bytes:
        m = hmac.new(key, what + struct.pack("!Q", seq), hashlib.sha256)
        m.update(data)
        return m.digest()[:TAG_BYTES]

    def seal(self, head: bytes) -> bytes:
        """The tag that follows a frame's fixed and JSON headers."""
        tag = self._tag(self.tx_key, self.tx_seq, b"H", head)
        self.tx_seq += 1
        return tag

    def check(self, head: bytes, tag: bytes) -> None:
        if not hmac.compare_digest(tag, self._tag(self.rx_key, self.rx_seq, b"H", head)):
            raise ForgedFrame(f"frame {self.rx_seq} failed its MAC (injected, replayed or reordered)")
        self.rx_seq += 1

    def seal_payload(self, data) -> bytes:
        """`full`: the tag after the payload of the frame just sealed."""
        return self._tag(self.tx_key, self.tx_seq - 1, b"P", data)

    def check_payload(self, data, tag: bytes) -> None:
        if not hmac.compare_digest(tag, self._tag(self.rx_key, self.rx_seq - 1, b"P", data)):
            raise ForgedFrame(f"frame {self.rx_seq - 1}: payload failed its MAC (corrupted or altered)")


def pack_header(kind: int, meta: dict | None, payload_len: int) -> bytes:
    """Fixed header + JSON header, ready to send before the payload."""
    js = json.dumps(meta or {}, separators=(",", ":")).encode() if meta else b""
    if len(js) > MAX_JSON_BYTES:
        raise WireError(f"JSON header of {len(js)} bytes exceeds {MAX_JSON_BYTES}")
    return FRAME_HEADER.pack(FRAME_MAGIC, FRAME_VERSION, kind, 0, len(js), payload_len) + js


def parse_header(raw: bytes, max_payload: int = DEFAULT_MAX_PAYLOAD) -> tuple[int, int, int]:
    """Validate a fixed header; returns (kind, json_len, payload_len)."""
    if len(raw) != FRAME_HEADER.size:
        raise WireError(f"frame header is {len(raw)} bytes, expected {FRAME_HEADER.size}")
    magic, version, kind, _reserved, json_len, payload_len = FRAME_HEADER.unpack(raw)
    if magic != FRAME_MAGIC:
        raise WireError("bad frame magic")
    if version != FRAME_VERSION:
        raise WireError(f"unsupported frame version {version}")
    if json_len > MAX_JSON_BYTES:
        raise WireError(f"JSON header length {json_len} exceeds {MAX_JSON_BYTES}")
    if payload_len > max_payload:
        raise WireError(f"payload length {payload_len} exceeds {max_payload}")
    return kind, json_len, payload_len


def parse_meta(raw: bytes) -> dict:
    if not raw:
        return {}
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise WireError(f"bad JSON header: {e}") from None
    if not isinstance(meta, dict):
        raise WireError("JSON header is not an object")
    return meta


def send_frame(
    sock: socket.socket,
    kind: int,
    meta: dict | None = None,
    payload=b"",
    timeout: float | None = 30.0,
    session: Session | None = None,
) -> int:
    """Send one frame; the payload (any buffer) is sent without copying. Returns header bytes.
    With a session the headers carry their MAC, and with a `full` one the payload its own."""
    view = memoryview(payload).cast("B")
    head = pack_header(kind, meta, len(view))
    if session is not None:
        head += session.seal(head)
    tail = session.seal_payload(view) if session is not None and session.full else b""
    deadline = _deadline(timeout)
    if len(view) < 64 * 1024:
        send_all(sock, head + bytes(view) + tail, deadline)  # one segment for small messages
    else:
        send_all(sock, head, deadline)
        send_all(sock, view, deadline)
        send_all(sock, tail, deadline)
    return len(head)


def recv_frame_header(
    sock: socket.socket,
    timeout: float | None = 30.0,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
    session: Session | None = None,
) -> tuple[int, dict, int]:
    """Read the fixed and JSON headers; the caller then reads payload_len bytes itself (and,
    with a `full` session, the payload's tag after them: use recv_frame unless it cannot)."""
    deadline = _deadline(timeout)
    fixed = recv_exact(sock, FRAME_HEADER.size, deadline)
    kind, json_len, payload_len = parse_header(fixed, max_payload)
    raw = recv_exact(sock, json_len, deadline) if json_len else b""
    if session is not None:
        session.check(fixed + raw, recv_exact(sock, TAG_BYTES, deadline))
    return kind, parse_meta(raw), payload_len


def recv_frame(
    sock: socket.socket,
    timeout: float | None = 30.0,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
    session: Session | None = None,
) -> tuple[int, dict, bytes]:
    deadline = _deadline(timeout)
    kind, meta, n = recv_frame_header(sock, _remaining(deadline), max_payload, session)
    payload = recv_exact(sock, n, deadline) if n else b""
    if session is not None and session.full:
        session.check_payload(payload, recv_exact(sock, TAG_BYTES, deadline))
    return kind, meta, payload


def connect(
    addr: str,
    port: int,
    secret: bytes,
    timeout: float = 60.0,
    what: str = "peer",
    retry_every: float = 0.2,
    keyed: bool = False,
):
    """Connect and prove the secret both ways, retrying with backoff while the peer starts up
    or is busy, until `timeout`. keyed: returns (socket, session key)."""
    deadline = time.monotonic() + timeout
    wait = retry_every
    while True:
        try:
            sock = socket.create_connection((addr, port), timeout=5.0)
        except OSError as e:
            if time.monotonic() > deadline:
                raise ConnectionError(f"{what} {addr}:{port} unreachable: {e}") from None
            time.sleep(retry_every)
            continue
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            key = client_handshake(sock, secret, timeout=10.0)
            return (sock, key) if keyed else sock
        except (BusyError, TimeoutError, ConnectionResetError) as e:
            sock.close()
            if time.monotonic() + wait > deadline:
                raise ConnectionError(f"{what} {addr}:{port}: {e}") from None
            time.sleep(wait)
            wait = min(wait * 2, 2.0)
        except BaseException:
            sock.close()
            raise
