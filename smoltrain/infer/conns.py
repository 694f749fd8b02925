"""The HTTP server's connections: a cap, a deadline per request, and no spin when descriptors run out.

A connection costs a thread and a descriptor from the moment it is accepted, before any key
is checked, so the server holds at most `max_connections`. Past the cap, a new connection
takes the place of the stalest one that has not finished sending its request (a slow
client, or a keep-alive connection sitting idle): that one gets a 503 and is closed. When
every held connection is a request being answered, the newcomer gets the 503. So a flood of
connections that trickle a byte at a time is shed, and a client that sends its request
promptly is answered.

A request's line, headers and body must all arrive within `read_timeout` of its start: a
deadline for the whole request, not for each read (a byte every 20 s would renew that for
ever). Answers are written with the same timeout per write, so a client that stops reading a
stream is dropped and its slot freed.

When accept() fails for want of descriptors (EMFILE), the listener waits a moment before it
tries again instead of spinning on a socket that stays readable.
"""

from __future__ import annotations

import errno
import io
import socket
import threading
import time
from http.server import ThreadingHTTPServer

from smolnet.server import shut

BACKLOG = 1024
_BODY = b'{"error": {"message": "too many connections; retry later", "type": "server_error", "code": 503}}'
SHED = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_BODY), _BODY)
)


class DeadlineReader(io.RawIOBase):
    """A socket's reads, each bounded by what is left of its handler's request deadline."""

    def __init__(self, sock: socket.socket, handler):
        self.sock, self.h = sock, handler

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        left = self.h.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive within its deadline")
        self.sock.settimeout(left)
        return self.sock.recv_into(b)


class Conn:
    """One accepted connection: when its current request started, and whether it is still arriving."""

    __slots__ = ("sock", "since", "arriving", "evicted")

    def __init__(self, sock: socket.socket):
        self.sock, self.since, self.arriving, self.evicted = sock, time.monotonic(), True, False


class Server(ThreadingHTTPServer):
    request_queue_size = BACKLOG  # a burst of connections waits in the kernel instead of being reset
    daemon_threads = True
    block_on_close = False

    def __init__(self, addr, handler, max_connections: int = 256):
        self.max_connections = max_connections
        self.conns: dict[socket.socket, Conn] = {}
        self.conn_lock = threading.Lock()
        self.shed = 0  # connections refused or evicted past the cap
        super().__init__(addr, handler)

    def get_request(self):
        try:
            return super().get_request()
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                time.sleep(0.1)  # the listener stays readable: without a pause the loop spins
            raise

    def process_request(self, request, client_address):
        with self.conn_lock:
            victim = None
            if len(self.conns) >= self.max_connections:
                waiting = [c for c in self.conns.values() if c.arriving]
                victim = min(waiting, key=lambda c: c.since) if waiting else None
                if victim is None:
                    self.shed += 1
                    return _refuse(request)
                del self.conns[victim.sock]
                victim.evicted = True
                self.shed += 1
            self.conns[request] = Conn(request)
        if victim is not None:
            _refuse(victim.sock, close=False)  # its thread sees the end of the stream and goes
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.conn_lock:
                self.conns.pop(request, None)

    def mark(self, sock: socket.socket, arriving: bool) -> None:
        """A request started arriving (evictable) or has arrived whole (being answered)."""
        with self.conn_lock:
            c = self.conns.get(sock)
            if c is not None:
                c.arriving = arriving
                if arriving:
                    c.since = time.monotonic()

    def open_connections(self) -> int:
        return len(self.conns)


def _refuse(sock: socket.socket, close: bool = True) -> None:
    """The fixed 503, if the socket takes it at once, then the end of the connection."""
    try:
        sock.setblocking(False)
        sock.send(SHED)
    except OSError:
        pass
    shut(sock, close)
