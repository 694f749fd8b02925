"""SocketComm: hand-written, authenticated collectives over plain TCP that count every byte.

Every message is a smolnet.wire frame (fixed header, small JSON header, raw tensor
bytes). Tensor memory is sent straight from the tensor (sendmsg of a memoryview, no
copy) and received with recv_into straight into the destination tensor, or into one
chunk-sized staging buffer when it must be added (reduce-scatter).

Collectives are built from one engine, `_transfer`: a list of sends and a list of
receives, cut into chunks of `chunk_bytes`, driven by one thread with non-blocking
calls. A send may depend on a receive: chunk k of a send goes out as soon as chunk k
of the receive it forwards has landed (and been reduced), so sending, receiving and
reducing overlap, and the thread sleeps in poll() only when nothing can move. One
thread means no hand-offs between threads, which matters most on small, busy CPUs.

The algorithms, and the payload bytes each rank sends in each, are in ring.py.
Framing (header bytes) is counted apart from payload in `counter.framing`.

Failure: any error on a link becomes a CommError naming the peer rank and its address.
The rank that saw it tells every other peer (an ABORT frame, at a frame boundary), so
ranks that are not neighbours of the dead peer raise a CommError naming it too,
instead of waiting for their own timeout. After a failure the Comm refuses further use.
"""

from __future__ import annotations

import logging
import socket

import torch

from smolnet import wire
from smolnet.server import shut
from smoltrain.comm import rendezvous as rdv
from smoltrain.comm import ring
from smoltrain.comm.base import ByteCounter, Comm, CommError
from smoltrain.comm.exchange import (
    HEADER_SIZE,
    K_ABORT,
    _byte_view,
    _consume,
    _Exchange,
    _Staged,
    as_comm_error,
)

log = logging.getLogger("smoltrain.comm")

# Chunk size. Every chunk boundary is a chance to sleep in poll(), and on a busy machine
# a sleep costs more than the copy it waits for: so big chunks. Two ranks have no chain to
# pipeline (each step is one swap with the one peer): 4 MB. Longer rings forward every
# chunk N-1 times, so there smaller chunks start the next hop sooner: 1 MB.
CHUNK_BYTES_PAIR = 4 << 20
CHUNK_BYTES_RING = 1 << 20


class SocketComm(Comm):
    backend = "socket"

    def __init__(
        self,
        rank: int,
        world_size: int,
        coordinator_addr: str,
        port: int,
        secret: bytes,
        timeout: float = 30.0,
        device="cpu",
        addrs: list[str] | None = None,
        chunk_bytes: int | None = None,
        integrity: str = "header",
    ):
        if not (0 <= rank < world_size):
            raise CommError(f"rank {rank} is outside world size {world_size}")
        if addrs is not None and len(addrs) != world_size:
            raise CommError(f"{len(addrs)} addresses for world size {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device) if device else torch.device("cpu")
        self.peer_timeout = float(timeout)  # seconds any single wait may last
        self.counter = ByteCounter()
        chunk_bytes = chunk_bytes or (CHUNK_BYTES_PAIR if world_size <= 2 else CHUNK_BYTES_RING)
        self.chunk_bytes = max(64, chunk_bytes - chunk_bytes % 8)
        self._seq = 0
        self._p2p_out: dict[int, int] = {}
        self._p2p_in: dict[int, int] = {}
        self._staging: dict = {}
        self._failed: CommError | None = None
        self._closed = False
        self._hdr = bytearray(HEADER_SIZE)
        my_addr = addrs[rank] if addrs else coordinator_addr
        my_port = rdv.data_port(port, rank)
        self._socks: dict[int, socket.socket] = {}
        self._sess: dict[int, wire.Session] = {}  # every mesh link MACs its frames
        self._where = [f"{my_addr}:{my_port}"] * world_size
        if world_size == 1:
            return
        listener = rdv.listen(my_addr, my_port, backlog=max(16, world_size), or_any=True)
        my_port = listener.getsockname()[1]
        try:
            table = rdv.rendezvous(rank, world_size, coordinator_addr, port, secret, my_addr, my_port, timeout)
            self._where = [f"{a}:{p}" for a, p in table]
            keys: dict = {}
            self._socks = rdv.connect_mesh(rank, table, listener, secret, timeout, keys)
            self._sess = {j: wire.Session(k, dialled, full=integrity == "full") for j, (k, dialled) in keys.items()}
        finally:
            listener.close()
        for s in self._socks.values():
            s.setblocking(False)  # every wait happens in poll(), with peer_timeout

    # ----------------------------------------------------------------- plumbing
    def _who(self, peer: int) -> str:
        return f"rank {peer} ({self._where[peer]})"

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise CommError(f"communicator unusable after an earlier failure: {self._failed}", self._failed.peer)
        if self._closed:
            raise CommError("communicator is closed")

    def _check_peer(self, peer: int) -> None:
        if not isinstance(peer, int) or not (0 <= peer < self.world_size) or peer == self.rank:
            raise CommError(f"rank {self.rank}: bad peer rank {peer!r} (world size {self.world_size})")

    @staticmethod
    def _sendv(sock: socket.socket, bufs: list) -> None:
        """Send all buffers in order (scatter-gather, no copies); socket timeout bounds each wait."""
        bufs = [memoryview(b).cast("B") for b in bufs if len(b)]
        while bufs:
            _consume(bufs, sock.sendmsg(bufs))

    def _error(self, peer: int | None, exc: BaseException, op: str) -> CommError:
        where = self._who(peer) if peer is not None else "a peer"
        return as_comm_error(exc, peer, where, op, self.rank, self.peer_timeout)

    def _fail(self, err: CommError, dirty: set[int] = frozenset()) -> CommError:
        """Tell every reachable peer why we stop, then drop all links; returns err to raise."""
        if self._failed is None:
            self._failed = err
            log.warning("rank %d: dropping all links: %s", self.rank, err)
            meta = {"peer": err.peer, "why": getattr(err, "root", str(err))[:1000]}
            for peer, sock in self._socks.items():
                if peer == err.peer or peer in dirty:
                    continue
                try:
                    sock.settimeout(1.0)
                    head = wire.pack_header(K_ABORT, meta, 0)
                    ses = self._sess.get(peer)
                    self._sendv(sock, [head + ses.seal(head) if ses else head])
                except (OSError, wire.WireError):
                    pass
            self._drop_links()
        return err

    def _drop_links(self) -> None:
        for s in self._socks.values():
            shut(s, close=True)

    # -------------------------------------------------------------- the engine
    def _chunks(self, n: int, elem: int) -> list[tuple[int, int]]:
        """Byte ranges of the chunks of an n-byte message; an empty message is one empty frame."""
        if n == 0:
            return [(0, 0)]
        step = max(elem, self.chunk_bytes - self.chunk_bytes % elem)
        return [(a, min(n, a + step)) for a in range(0, n, step)]

    def _transfer(
        self,
        op: str,
        sends: list,
        recvs: list,
        elem: int = 1,
        dtype=None,
        seq: int | None = None,
        extra: dict | None = None,
        recv_seq: int | None = None,
        recv_extra: dict | None = None,
    ) -> None:
        """Run sends [(peer, view, dep)] and receives [(peer, view, acc)] as one exchange.

        dep: index of the receive whose chunk k must have landed (and been reduced) before
        chunk k of this send goes out (same chunking), or None. acc: a tensor to add each
        received chunk into (the view then only gives the size), or None to receive
        straight into the view. The first frame of every message carries {op, seq, index}
        (+ extra), checked by the receiver, so ranks that disagree fail loudly; the receives
        expect recv_seq and recv_extra where given (a send and a receive of different streams).
        """
        if seq is None:
            self._seq += 1
            seq = self._seq
        rchunks = [self._chunks(len(v), elem) for _, v, _ in recvs]
        schunks = [self._chunks(len(v), elem) for _, v, _ in sends]
        base, total = [], 0
        for c in rchunks:
            base.append(total)
            total += len(c)
        staging = staging_bytes = None
        if any(a is not None for _, _, a in recvs):
            biggest = max(len(v) for _, v, a in recvs if a is not None)
            staging = self._staging_buffer(dtype, min(biggest, self.chunk_bytes) // elem)
            staging_bytes = _byte_view(staging)
        ex = _Exchange(
            self._socks,
            op,
            seq,
            extra or {},
            sends,
            recvs,
            schunks,
            rchunks,
            base,
            elem,
            staging,
            staging_bytes,
            self._hdr,
            self.peer_timeout,
            self._sess,
            recv_seq,
            recv_extra,
        )
        try:
            ex.run()
        except BaseException as e:
            raise self._fail(self._error(ex.peer, e, op), ex.stats.mid_frame) from None
        for p, n in ex.stats.framing.items():
            self.counter.add(p, ex.stats.payload.get(p, 0), n)

    def _staging_buffer(self, dtype, numel: int) -> torch.Tensor:
        """One reusable landing buffer per dtype for chunks that get added (no page faults per call)."""
        buf = self._staging.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1), dtype=dtype)
            self._staging[dtype] = buf
        return buf

    # ------------------------------------------------------------ collectives
    def send(self, tensor, dst: int) -> None:
        self._p2p(tensor, dst, None, None)

    def recv(self, tensor, src: int) -> None:
        self._p2p(None, None, tensor, src)

    def send_recv(self, send, dst: int, recv, src: int) -> None:
        """One exchange: the send and the receive move at once (each in its own p2p stream,
        so a plain send or recv at the other end matches it)."""
        self._p2p(send, dst, recv, src)

    def _p2p(self, send, dst, recv, src) -> None:
        """Point to point: every (peer, direction) pair numbers its own messages, and the first
        frame names dtype and length, so a mismatched pair fails loudly."""
        self._check_usable()
        for t, peer in ((send, dst), (recv, src)):
            if t is not None:
                self._check_peer(peer)  # both before either stream's count moves
        out = self._p2p_side(send, dst, self._p2p_out, writeback=False)
        into = self._p2p_side(recv, src, self._p2p_in, writeback=True)
        kw = dict(seq=out[2], extra=out[3]) if out else {}
        if into:
            kw.update(recv_seq=into[2], recv_extra=into[3])
            kw.setdefault("seq", into[2])  # a receive alone must not move the collectives' count
        self._transfer("p2p", [out[1]] if out else [], [into[1]] if into else [], **kw)
        if into:
            into[0].finish()

    @staticmethod
    def _p2p_side(tensor, peer, counts: dict, writeback: bool):
        """(staged tensor, its transfer entry, its stream's message number, dtype and length), or None."""
        if tensor is None:
            return None
        st = _Staged(tensor, writeback=writeback)
        counts[peer] = counts.get(peer, 0) + 1
        meta = {"dt": str(st.flat.dtype), "n": st.flat.numel()}
        return st, (peer, _byte_view(st.flat), None), counts[peer], meta

    def broadcast(self, tensor, src: int) -> None:
        self._check_usable()
        if not (0 <= src < self.world_size):
            raise CommError(f"bad broadcast source {src}")
        if self.world_size == 1 or tensor.numel() == 0:
            return
        st = _Staged(tensor, writeback=self.rank != src)
        view = _byte_view(st.flat)
        sends, recvs = ring.broadcast_steps(view, self.rank, self.world_size, src)
        self._transfer("broadcast", sends, recvs, st.flat.element_size(), st.flat.dtype)
        st.finish()

    def all_reduce(self, tensor, op: str = "sum") -> None:
        self._check_usable()
        if op not in ("sum", "avg"):
            raise CommError(f"unsupported reduce op {op!r} (sum or avg)")
        n = self.world_size
        if n == 1 or tensor.numel() == 0:
            return
        st = _Staged(tensor, writeback=True)
        flat, es = st.flat, st.flat.element_size()
        view = _byte_view(flat)
        sends, recvs = ring.all_reduce_steps(flat, view, self.rank, n)
        self._transfer("all_reduce", sends, recvs, es, flat.dtype)
        if op == "avg":
            if flat.is_floating_point():
                flat.div_(n)
            else:
                flat.div_(n, rounding_mode="floor")
        st.finish()

    def reduce_scatter(self, out, inp, op: str = "sum") -> None:
        self._check_usable()
        if op not in ("sum", "avg"):
            raise CommError(f"unsupported reduce op {op!r} (sum or avg)")
        n, r = self.world_size, self.rank
        if inp.numel() != n * out.numel() or inp.dtype != out.dtype:
            raise CommError(
                f"reduce_scatter: input has {inp.numel()} {inp.dtype} elements, output "
                f"{out.numel()} {out.dtype}; input must be world_size x output"
            )
        m = out.numel()
        work = inp.detach().to("cpu").reshape(-1).clone()  # reduced in place; the caller's input stays intact
        if n > 1 and m > 0:
            es = work.element_size()
            view = _byte_view(work)
            sends, recvs = ring.reduce_scatter_steps(work, view, m, r, n)
            self._transfer("reduce_scatter", sends, recvs, es, work.dtype)
        mine = work[r * m : (r + 1) * m]
        if op == "avg":
            mine = mine / n if mine.is_floating_point() else torch.div(mine, n, rounding_mode="floor")
        with torch.no_grad():
            out.copy_(mine.view_as(out))

    def all_gather(self, out, inp) -> None:
        self._check_usable()
        n, r = self.world_size, self.rank
        if out.numel() != n * inp.numel() or inp.dtype != out.dtype:
            raise CommError(
                f"all_gather: output has {out.numel()} {out.dtype} elements, input "
                f"{inp.numel()} {inp.dtype}; output must be world_size x input"
            )
        m = inp.numel()
        st = _Staged(out, writeback=True)
        flat = st.flat
        with torch.no_grad():
            flat[r * m : (r + 1) * m].copy_(inp.detach().reshape(-1))
        if n > 1 and m > 0:
            es = flat.element_size()
            view = _byte_view(flat)
            sends, recvs = ring.all_gather_steps(view, m, es, r, n)
            self._transfer("all_gather", sends, recvs, es, flat.dtype)
        st.finish()

    def all_to_all(self, outs: list, inps: list) -> None:
        self._check_usable()
        n, r = self.world_size, self.rank
        if len(outs) != n or len(inps) != n:
            raise CommError(f"all_to_all needs {n} inputs and {n} outputs, got {len(inps)} and {len(outs)}")
        with torch.no_grad():
            outs[r].copy_(inps[r])
        if n == 1:
            return
        ins = [_Staged(t, writeback=False) for t in inps]
        got = [_Staged(t, writeback=True) for t in outs]
        sends, recvs = ring.all_to_all_steps([_byte_view(t.flat) for t in ins], [_byte_view(t.flat) for t in got], r)
        self._transfer("all_to_all", sends, recvs, 1, None)
        for j, g in enumerate(got):
            if j != r:
                g.finish()

    def exchange(self, send, dst: int, recv, src: int) -> None:
        """Send `send` to dst while receiving `recv` from src: one hop of a ring whose payload
        changes at every hop (smoltrain.comm.quantized's int8 all-reduce)."""
        self._check_usable()
        self._check_peer(dst)
        self._check_peer(src)
        out, into = _Staged(send, writeback=False), _Staged(recv, writeback=True)
        self._transfer("exchange", [(dst, _byte_view(out.flat), None)], [(src, _byte_view(into.flat), None)])
        into.finish()

    def barrier(self) -> None:
        self._check_usable()
        if self.world_size == 1:
            return
        n, r = self.world_size, self.rank
        sends, recvs = ring.barrier_steps(r, n)
        self._transfer("barrier", sends, recvs)

    def new_group(self, ranks) -> SocketComm | None:
        """A view over these links for `ranks` (smoltrain.comm.subgroup); None if this rank is not in it."""
        from smoltrain.comm.subgroup import SocketGroup, check_ranks

        ranks = check_ranks(ranks, self.world_size)
        return SocketGroup(self, ranks) if self.rank in ranks else None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._drop_links()
            self._socks = {}
