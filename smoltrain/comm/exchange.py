"""The engine under SocketComm: frames and one exchange of chunked sends and receives.

Split out of socket_comm so each file stays small. With a wire.Session per link (the rank
mesh always has one), every frame header carries a MAC over it and its sequence number, so
a frame cannot be injected, replayed or reordered; with `full` integrity every payload is
MACed as well (its cost is measured by bench/bench_faults.py --integrity).
"""

from __future__ import annotations

import select
import socket

import torch

from smolnet import wire
from smolnet.errors import SmolError
from smoltrain.comm.base import CommError

K_DATA = 10
K_ABORT = 11
HEADER_SIZE = wire.FRAME_HEADER.size
_DONTWAIT = socket.MSG_DONTWAIT
# A receive sleeps until this much of what it waits for has arrived (SO_RCVLOWAT), not until
# the next packet: on a link slower than the CPU, data lands a 1448-byte segment at a time,
# and a rank read it as it came (6,819 reads for 321 sleeps on the hidden sim); a capped 4-host
# all-reduce of 1 MB there took 137 ms before and 96 after (BENCHMARKS.md). Small enough that
# the kernel never clamps the TCP window for it.
LOWAT_MAX = 32 << 10
_LOWAT = getattr(socket, "SO_RCVLOWAT", None)


def _check_frame(kind: int, meta: dict, payload_len: int, expect_len: int, expect_meta: dict | None, peer: int):
    """A frame header that is not exactly the expected data frame ends the collective."""
    if kind == K_ABORT:
        who = meta.get("peer")
        raise _RemoteAbort(str(meta.get("why", "aborted"))[:500], who if isinstance(who, int) else peer)
    if kind != K_DATA:
        raise wire.WireError(f"unexpected frame kind {kind}")
    if expect_meta is not None and meta != expect_meta:
        raise wire.WireError(f"collective mismatch: peer sent {meta}, this rank expected {expect_meta}")
    if payload_len != expect_len:
        raise wire.WireError(
            f"sent {payload_len} payload bytes, this rank expected {expect_len} (mismatched shapes or dtypes)"
        )


def _consume(bufs: list, k: int) -> None:
    """Drop the first k bytes sent from a scatter-gather list of memoryviews, in place."""
    while k and bufs:
        if k >= len(bufs[0]):
            k -= len(bufs[0])
            bufs.pop(0)
        else:
            bufs[0] = bufs[0][k:]
            k = 0


class _RemoteAbort(SmolError):
    """Another rank reported a failure; carries its CommError fields."""

    def __init__(self, message: str, peer: int | None):
        super().__init__(message)
        self.peer = peer


def as_comm_error(exc: BaseException, peer: int | None, where: str, op: str, rank: int, timeout: float) -> CommError:
    """One line naming the peer and what it did: what a rank that saw a link fail raises."""
    if isinstance(exc, CommError):
        return exc
    if isinstance(exc, _RemoteAbort):
        err = CommError(f"{exc} (reported by {where})" if peer is not None else str(exc), exc.peer)
        err.root = str(exc)  # forwarded as is, so the story does not grow at every hop
        return err
    if isinstance(exc, (socket.timeout, TimeoutError)):
        what = f"did not respond within {timeout:g}s"
    elif isinstance(exc, wire.PeerClosed):
        what = str(exc)
    elif isinstance(exc, wire.WireError):
        what = f"sent a bad frame: {exc}"
    elif isinstance(exc, (ConnectionResetError, BrokenPipeError)):
        what = "closed the connection (reset)"
    elif isinstance(exc, OSError):
        what = f"link failed: {exc.strerror or exc}"
    else:
        what = f"failed: {exc!r}"
    return CommError(f"{where} {what} during {op} (seen by rank {rank})", peer)


class _Sent:
    """Bytes sent per peer in one exchange, and which peers have a frame half sent."""

    def __init__(self):
        self.payload: dict[int, int] = {}
        self.framing: dict[int, int] = {}
        self.mid_frame: set[int] = set()


class _Exchange:
    """The state of one `_transfer`: which chunk each send and receive is at, and the pumps.

    pump_sends/pump_recvs move as much as the sockets take without blocking; run() drives
    both on the calling thread and sleeps in poll() only when neither can move. (A second
    thread for the sends measured slower here: the hand-offs cost more than the overlap.)
    """

    def __init__(
        self,
        socks,
        op,
        seq,
        extra,
        sends,
        recvs,
        schunks,
        rchunks,
        base,
        elem,
        staging,
        staging_bytes,
        hdr,
        timeout,
        sess=None,
        rseq=None,
        rextra=None,
    ):
        self.socks, self.op, self.seq, self.extra = socks, op, seq, extra
        self.rseq = seq if rseq is None else rseq  # what the receives expect (send_recv: their own stream)
        self.rextra = extra if rextra is None else rextra
        self.sess = sess or {}  # peer -> wire.Session: every frame MACed (none: a bare test link)
        self.ptag = None  # full integrity: the payload just received, awaiting its tag
        self.sends, self.recvs, self.schunks, self.rchunks, self.base = sends, recvs, schunks, rchunks, base
        self.elem, self.staging, self.staging_bytes = elem, staging, staging_bytes
        self.hdr = memoryview(hdr)
        self.wait_ms = max(1, int(timeout * 1000))
        self.stats = _Sent()
        self.peer = None  # the peer of the call that failed, for the error message
        self.done = 0  # receive chunks landed (and reduced)
        self.drained = False  # the last pump_recvs emptied the socket mid-message
        self.si = self.sk = 0  # send item, chunk
        self.sbufs = None
        self.spay = 0
        self.ri = self.rk = 0  # receive item, chunk
        self.phase, self.rview, self.rgot, self.plen, self.kind, self.meta = 0, self.hdr, 0, 0, 0, {}

    # ------------------------------------------------------------------ pumps
    def send_ready(self) -> bool:
        """The next send chunk's data is there (its dependency has landed)."""
        dep = self.sends[self.si][2]
        return dep is None or self.done > self.base[dep] + self.sk

    def pump_sends(self):
        """Send until blocked. Returns (moved, peer whose socket is full or None)."""
        moved = False
        while self.si < len(self.sends):
            peer = self.sends[self.si][0]
            if self.sbufs is None:
                if not self.send_ready():
                    return moved, None
                a, b = self.schunks[self.si][self.sk]
                meta = dict(self.extra, o=self.op, q=self.seq, i=self.si) if self.sk == 0 else None
                head = wire.pack_header(K_DATA, meta, b - a)
                ses = self.sess.get(peer)
                payload = self.sends[self.si][1][a:b]
                if ses is not None:
                    head += ses.seal(head)
                self.sbufs = [memoryview(head), payload] if b > a else [memoryview(head)]
                if ses is not None and ses.full and b > a:
                    self.sbufs.append(memoryview(ses.seal_payload(payload)))
                self.spay = b - a
                self.stats.framing[peer] = self.stats.framing.get(peer, 0) + len(head)
                self.stats.mid_frame.add(peer)
            try:
                k = self.socks[peer].sendmsg(self.sbufs, (), _DONTWAIT)
            except BlockingIOError:
                return moved, peer
            except OSError:
                self.peer = peer
                raise
            moved = True
            bufs = self.sbufs
            _consume(bufs, k)
            if not bufs:
                self.sbufs = None
                self.stats.mid_frame.discard(peer)
                self.stats.payload[peer] = self.stats.payload.get(peer, 0) + self.spay
                self.sk += 1
                if self.sk == len(self.schunks[self.si]):
                    self.si, self.sk = self.si + 1, 0
        return moved, None

    def pump_recvs(self) -> bool:
        """Receive until the socket is drained or one chunk completes (which may unblock a
        send). A drained socket sets `drained`: run() then sleeps until enough has arrived
        (LOWAT_MAX) rather than reading each segment as it lands."""
        moved, self.drained = False, False
        while self.ri < len(self.recvs):
            peer, view, acc = self.recvs[self.ri]
            self.peer = peer
            try:
                k = self.socks[peer].recv_into(self.rview[self.rgot :], len(self.rview) - self.rgot, _DONTWAIT)
            except BlockingIOError:
                return moved
            if k == 0:
                raise wire.PeerClosed("closed the connection" + (" mid-message" if self.rgot or self.phase else ""))
            moved = True
            self.rgot += k
            if self.rgot < len(self.rview):  # the socket is drained: sleep until more is there
                self.drained = True
                return moved
            a, b = self.rchunks[self.ri][self.rk]
            ses = self.sess.get(peer)
            if self.phase == 0:  # fixed header: bounded by what this chunk may carry
                self.kind, jlen, self.plen = wire.parse_header(bytes(self.hdr), max_payload=b - a)
                self.meta = {}
                self.jlen = jlen
                if jlen or ses is not None:  # the JSON header, then the MAC over both headers
                    tag = wire.TAG_BYTES if ses is not None else 0
                    self.phase, self.rview, self.rgot = 1, memoryview(bytearray(jlen + tag)), 0
                    continue
            if self.phase <= 1:
                if self.phase == 1:
                    raw = bytes(self.rview)
                    if ses is not None:
                        ses.check(bytes(self.hdr) + raw[: self.jlen], raw[self.jlen :])
                    self.meta = wire.parse_meta(raw[: self.jlen])
                expect = dict(self.rextra, o=self.op, q=self.rseq, i=self.ri) if self.rk == 0 else None
                _check_frame(self.kind, self.meta, self.plen, b - a, expect, peer)
                if self.plen:
                    self.phase, self.rgot = 2, 0
                    self.rview = view[a:b] if acc is None else self.staging_bytes[: b - a]
                    continue
            if self.phase == 2 and ses is not None and ses.full and self.plen:
                self.ptag, self.phase, self.rview, self.rgot = self.rview, 3, memoryview(bytearray(wire.TAG_BYTES)), 0
                continue
            if self.phase == 3:
                ses.check_payload(self.ptag, bytes(self.rview))
            if acc is not None and b > a:  # chunk complete: reduce it
                acc[a // self.elem : b // self.elem].add_(self.staging[: (b - a) // self.elem])
            self.phase, self.rview, self.rgot = 0, self.hdr, 0
            self.rk += 1
            if self.rk == len(self.rchunks[self.ri]):
                self.ri, self.rk = self.ri + 1, 0
            self.done += 1
            return True
        return moved

    def wait(self, out_peer, recv: bool) -> None:
        """Sleep until a socket we need can move; peer_timeout without any is an error."""
        masks: dict[int, int] = {}
        if out_peer is not None:
            fd = self.socks[out_peer].fileno()
            masks[fd] = select.POLLOUT
        low = None
        if recv and self.ri < len(self.recvs):
            sock = self.socks[self.recvs[self.ri][0]]
            masks[sock.fileno()] = masks.get(sock.fileno(), 0) | select.POLLIN
            want = min(len(self.rview) - self.rgot, LOWAT_MAX)
            if _LOWAT is not None and want > 1:
                low = _set_lowat(sock, want)
        poller = select.poll()
        for fd, m in masks.items():
            poller.register(fd, m)
        try:
            ready = poller.poll(self.wait_ms)
        finally:
            if low is not None:
                _set_lowat(low, 1)  # other readers of this socket wait for any byte, as usual
        if not ready:
            self.peer = self.recvs[self.ri][0] if recv and self.ri < len(self.recvs) else out_peer
            raise TimeoutError

    # ------------------------------------------------------------ drivers
    def run(self) -> None:
        while self.si < len(self.sends) or self.ri < len(self.recvs):
            moved, full = self.pump_sends() if self.si < len(self.sends) else (False, None)
            got = self.pump_recvs() if self.ri < len(self.recvs) else False
            if moved or (got and not self.drained):
                continue
            self.wait(full, True)


def _set_lowat(sock, n: int):
    """The socket, its low-water mark set to n bytes; None where the system refuses it."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, _LOWAT, n)
        return sock
    except OSError:
        return None


def _byte_view(flat: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous 1-D CPU tensor, no copy (works for bfloat16 too)."""
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


class _Staged:
    """A contiguous CPU view of a tensor; copies back on finish() when staging was needed."""

    def __init__(self, tensor: torch.Tensor, writeback: bool):
        self.orig = tensor
        t = tensor.detach()
        self.copied = t.device.type != "cpu" or not t.is_contiguous()
        self.work = t.to("cpu").contiguous() if self.copied else t
        if self.copied and self.work.data_ptr() == t.data_ptr():
            self.work = self.work.clone()
        self.flat = self.work.reshape(-1)
        self.writeback = writeback

    def finish(self) -> None:
        if self.copied and self.writeback:
            with torch.no_grad():
                self.orig.copy_(self.work.view_as(self.orig))
