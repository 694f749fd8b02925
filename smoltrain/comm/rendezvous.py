"""How ranks find each other: one authenticated rendezvous at rank 0, then a full mesh.

Rank 0 listens on `coordinator_addr:port`; every rank r listens for its peers on its
own address at `port + 1 + r` (or any free port, if something else holds that one).
Each rank registers its listening address with rank 0, which answers with the whole
table once every rank has registered (so nobody dials a peer that is not listening
yet). Then rank i dials every rank j < i and accepts every rank j > i. Every
connection, rendezvous and mesh alike, passes the cluster-secret challenge before a
single frame is read from it; a stranger is logged and dropped and the wait goes on
until the deadline. Every frame of the rendezvous and of the mesh greeting carries a
MAC (wire.Session, under a key of its own derived from the connection's session key, so
the mesh's data frames, which start their own sequence, can never be replayed into it).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import queue
import socket
import time

from smolnet import wire
from smolnet.server import AuthListener
from smoltrain.comm.base import CommError

log = logging.getLogger("smoltrain.comm")

K_HELLO = 1  # rank -> rank 0: {"rank", "world_size", "addr", "port"}
K_TABLE = 2  # rank 0 -> rank: {"table": [[addr, port], ...]}
K_REJECT = 3  # rank 0 -> rank: {"why"}
K_PEER = 4  # mesh dialer -> acceptor: {"rank", "world_size"}

HANDSHAKE_TIMEOUT = 5.0


def data_port(port: int, rank: int) -> int:
    """The port rank `rank` listens on for its peers."""
    return port + 1 + rank


def tune(sock: socket.socket) -> None:
    """No Nagle delay for small frames; kernel buffers stay autotuned (they grow to MBs)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def listen(addr: str, port: int, backlog: int = 16, or_any: bool = False) -> socket.socket:
    """A listening socket on addr:port. With or_any, a port that something else already holds
    gives way to any free one: a rank's peers learn its real port from the rendezvous table,
    so a stranger (or another job) sitting on the port does not stop this one."""
    try:
        return socket.create_server((addr, port), backlog=backlog, reuse_port=False)
    except OSError as e:
        if not (or_any and e.errno == errno.EADDRINUSE):
            raise CommError(f"cannot listen on {addr}:{port}: {e.strerror or e}") from None
    s = listen(addr, 0, backlog)
    log.warning("%s:%s is taken; listening for peers on %s:%s instead", addr, port, addr, s.getsockname()[1])
    return s


def hello_session(key: bytes, client: bool) -> wire.Session:
    """The MACs of a connection's greeting frames (registration, table, mesh hello)."""
    return wire.Session(hmac.new(key, b"rendezvous", hashlib.sha256).digest(), client=client, full=True)


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _dial(addr: str, port: int, deadline: float, who: str, peer: int) -> socket.socket:
    """Connect, retrying while the other side is not up yet, until the deadline."""
    last = None
    while True:
        left = _left(deadline)
        if left <= 0:
            raise CommError(f"{who} ({addr}:{port}) not reachable: {last or 'timed out'}", peer=peer)
        try:
            return socket.create_connection((addr, port), timeout=min(2.0, left))
        except OSError as e:
            last = e.strerror or str(e)
            time.sleep(min(0.05, _left(deadline)))


def _prove(s: socket.socket, secret: bytes, deadline: float, who: str, peer: int) -> bytes:
    """Client side of the secret check, with a message that says what most likely went wrong."""
    try:
        return wire.client_handshake(s, secret, timeout=min(HANDSHAKE_TIMEOUT, max(_left(deadline), 0.1)))
    except (wire.AuthError, wire.PeerClosed, ConnectionResetError) as e:
        s.close()
        raise CommError(f"{who} refused us at the cluster-secret check (different secret?): {e}", peer=peer) from None
    except BaseException:
        s.close()
        raise


def dial_authenticated(addr: str, port: int, secret: bytes, deadline: float, who: str, peer: int):
    """Dial and pass the secret check, retrying with backoff while the peer is busy or slow
    (a stranger may hold its listener for a moment) until the run's connect deadline.
    Returns (socket, session key)."""
    wait = 0.05
    while True:
        s = _dial(addr, port, deadline, who, peer)
        try:
            return s, _prove(s, secret, deadline, f"{who} ({addr}:{port})", peer)
        except (wire.BusyError, TimeoutError, OSError) as e:
            if _left(deadline) <= wait:
                raise CommError(f"{who} ({addr}:{port}) did not complete the handshake: {e}", peer=peer) from None
            log.info("%s (%s:%s): %s; retrying in %.2fs", who, addr, port, e, wait)
            time.sleep(wait)
            wait = min(wait * 2, 1.0)


class Inbox:
    """Authenticated connections to a listener, each with its first (bounded) frame, in a queue.

    Handshakes run concurrently in smolnet.server.AuthListener, so a silent stranger costs
    nothing but a pre-authentication slot for a few seconds."""

    def __init__(self, listener: socket.socket, secret: bytes, where: str):
        self.where = where
        self.queue: queue.Queue = queue.Queue()
        self.server = AuthListener(listener, secret, self._first_frame, name=where, with_key=True).start()

    def _first_frame(self, s: socket.socket, peer, key: bytes) -> None:
        ses = hello_session(key, client=False)
        try:
            kind, meta, _ = wire.recv_frame(s, timeout=HANDSHAKE_TIMEOUT, max_payload=0, session=ses)
        except (wire.WireError, OSError, TimeoutError) as e:
            log.warning("%s: dropped connection from %s:%s: %s", self.where, peer[0], peer[1], e)
            s.close()
            return
        self.queue.put((s, kind, meta, key, ses))

    def next(self, deadline: float):
        """(sock, kind, meta, session key, greeting session) of the next authenticated connection,
        or TimeoutError."""
        left = _left(deadline)
        if left <= 0:
            raise TimeoutError
        try:
            return self.queue.get(timeout=left)
        except queue.Empty:
            raise TimeoutError from None

    def close(self) -> None:
        """Stop accepting (the listening socket shut down at once: a group rebuilt on this port
        right after would otherwise find it still listening); close connections nobody took."""
        self.server.close()
        while True:
            try:
                self.queue.get_nowait()[0].close()
            except queue.Empty:
                return


def _valid_rank(meta: dict, world_size: int) -> int | None:
    r = meta.get("rank")
    if isinstance(r, int) and not isinstance(r, bool) and 0 <= r < world_size and meta.get("world_size") == world_size:
        return r
    return None


def rendezvous(
    rank: int,
    world_size: int,
    coordinator_addr: str,
    port: int,
    secret: bytes,
    my_addr: str,
    my_port: int,
    timeout: float,
) -> list[tuple[str, int]]:
    """Exchange listening addresses through rank 0; returns [(addr, port)] indexed by rank."""
    deadline = time.monotonic() + timeout
    if world_size == 1:
        return [(my_addr, my_port)]
    if rank == 0:
        return _serve_table(world_size, coordinator_addr, port, secret, my_addr, my_port, deadline)
    s, key = dial_authenticated(coordinator_addr, port, secret, deadline, "rank 0 (rendezvous)", 0)
    ses = hello_session(key, client=True)
    try:
        wire.send_frame(
            s,
            K_HELLO,
            {"rank": rank, "world_size": world_size, "addr": my_addr, "port": my_port},
            timeout=max(_left(deadline), 0.1),
            session=ses,
        )
        kind, meta, _ = wire.recv_frame(s, timeout=max(_left(deadline), 0.1), max_payload=0, session=ses)
    except (wire.WireError, OSError, TimeoutError) as e:
        raise CommError(f"rendezvous with rank 0 ({coordinator_addr}:{port}) failed: {e}", peer=0) from None
    finally:
        s.close()
    if kind == K_REJECT:
        raise CommError(f"rank 0 ({coordinator_addr}:{port}) refused rank {rank}: {meta.get('why')}", peer=0)
    table = meta.get("table")
    if (
        kind != K_TABLE
        or not isinstance(table, list)
        or len(table) != world_size
        or not all(
            isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and isinstance(e[1], int) for e in table
        )
    ):
        raise CommError(f"rank 0 ({coordinator_addr}:{port}) sent a malformed rendezvous table", peer=0)
    return [(a, p) for a, p in table]


def _serve_table(world_size, coordinator_addr, port, secret, my_addr, my_port, deadline):
    table: list = [None] * world_size
    table[0] = (my_addr, my_port)
    conns: dict[int, tuple[socket.socket, wire.Session]] = {}
    listener = listen(coordinator_addr, port, backlog=max(16, world_size))
    where = f"rendezvous {coordinator_addr}:{port}"
    inbox = Inbox(listener, secret, where)
    try:
        while len(conns) < world_size - 1:
            try:
                s, kind, meta, _, ses = inbox.next(deadline)
            except TimeoutError:
                missing = [r for r in range(1, world_size) if r not in conns]
                raise CommError(
                    f"rendezvous at {coordinator_addr}:{port} timed out: rank(s) "
                    f"{', '.join(map(str, missing))} never registered",
                    peer=missing[0],
                ) from None
            r = _valid_rank(meta, world_size) if kind == K_HELLO else None
            why = None
            if r is None:
                why = f"bad registration {meta!r:.120} (expected a rank below world size {world_size})"
            elif r == 0 or r in conns:
                why = f"rank {r} is already taken"
            elif not isinstance(meta.get("addr"), str) or not isinstance(meta.get("port"), int):
                why = "registration without a listening address"
            if why:
                log.warning("%s: %s", where, why)
                try:
                    wire.send_frame(s, K_REJECT, {"why": why}, timeout=1.0, session=ses)
                except (OSError, TimeoutError, wire.WireError):
                    pass
                s.close()
                continue
            conns[r] = (s, ses)
            table[r] = (meta["addr"], meta["port"])
        for r, (s, ses) in conns.items():
            try:
                wire.send_frame(
                    s, K_TABLE, {"table": [list(e) for e in table]}, timeout=max(_left(deadline), 1.0), session=ses
                )
            except (OSError, TimeoutError) as e:
                raise CommError(f"rank {r} ({table[r][0]}) left during rendezvous: {e}", peer=r) from None
    finally:
        inbox.close()
        for s, _ in conns.values():
            s.close()
        listener.close()
    return table


def connect_mesh(
    rank: int,
    table: list[tuple[str, int]],
    listener: socket.socket | None,
    secret: bytes,
    timeout: float,
    keys: dict | None = None,
) -> dict[int, socket.socket]:
    """One authenticated TCP connection to every other rank: dial lower ranks, accept higher ones.
    keys (filled in when given): peer -> (session key, whether this rank dialled)."""
    keys = {} if keys is None else keys
    world_size = len(table)
    deadline = time.monotonic() + timeout
    socks: dict[int, socket.socket] = {}
    inbox = None
    try:
        for j in range(rank):
            addr, port = table[j]
            s, key = dial_authenticated(addr, port, secret, deadline, f"rank {j}", j)
            keys[j] = (key, True)
            tune(s)
            try:
                wire.send_frame(
                    s,
                    K_PEER,
                    {"rank": rank, "world_size": world_size},
                    timeout=max(_left(deadline), 0.1),
                    session=hello_session(key, client=True),
                )
            except (wire.WireError, OSError, TimeoutError) as e:
                s.close()
                raise CommError(f"rank {j} ({addr}:{port}) dropped the connection: {e}", peer=j) from None
            socks[j] = s
        where = f"rank {rank} mesh"
        inbox = Inbox(listener, secret, where) if len(socks) < world_size - 1 else None
        while len(socks) < world_size - 1:
            try:
                s, kind, meta, key, _ = inbox.next(deadline)
            except TimeoutError:
                missing = [j for j in range(rank + 1, world_size) if j not in socks]
                raise CommError(
                    f"rank(s) {', '.join(map(str, missing))} never connected to rank {rank} "
                    f"({table[rank][0]}:{table[rank][1]})",
                    peer=missing[0],
                ) from None
            j = _valid_rank(meta, world_size) if kind == K_PEER else None
            if j is None or j <= rank or j in socks:
                log.warning("%s: dropped peer with bad hello %r", where, meta)
                s.close()
                continue
            tune(s)
            socks[j] = s
            keys[j] = (key, False)
        if inbox is not None:
            inbox.close()
    except BaseException:
        if inbox is not None:
            inbox.close()
        for s in socks.values():
            s.close()
        raise
    return socks
