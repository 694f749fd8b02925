"""Groups: a Comm over a subset of the world's ranks (the axes of a mesh, smoltrain.mesh).

`comm.new_group(ranks)` is called by EVERY rank of the world with the same increasing list,
in the same order (torch.distributed needs all ranks at each new_group); a member gets a Comm
whose rank and world_size are its place in `ranks` and their count, a non-member gets None.
Collectives, send/recv and peers inside a group use group-local ranks.

Socket transport: a group is a view over the world's authenticated links (no new
connections). It has its own sequence numbers, and every frame's header carries the group's
ranks, so two ranks that disagree about which group a message belongs to fail loudly instead
of mixing bytes. Bytes are counted in the world's counter, keyed by the world rank at the far
end of each link, so per-link bytes stay one table whatever groups sent them.

torch: dist.new_group (gloo on CPU); the textbook byte counts go to the world's counter the
same way. A failure in a group fails the world Comm on the socket transport (the links are
shared), as it does in torch.
"""

from __future__ import annotations

from smoltrain.comm.base import CommError
from smoltrain.comm.socket_comm import CHUNK_BYTES_PAIR, CHUNK_BYTES_RING, SocketComm
from smoltrain.comm.torch_comm import TorchComm


def check_ranks(ranks, world_size: int) -> list[int]:
    """A group's world ranks: distinct, increasing, inside the world (torch orders them so too)."""
    ranks = list(ranks)
    if not ranks or any(not isinstance(r, int) or not 0 <= r < world_size for r in ranks):
        raise CommError(f"group ranks {ranks} must be non-empty and inside world size {world_size}")
    if any(a >= b for a, b in zip(ranks, ranks[1:])):
        raise CommError(f"group ranks {ranks} must be distinct and increasing")
    return ranks


class SocketGroup(SocketComm):
    """A view over the parent's links for the ranks in `ranks` (group-local rank = position)."""

    def __init__(self, parent: SocketComm, ranks: list[int]):  # no super().__init__: it shares the links
        self._parent, self._ranks = parent, ranks
        self._tag = ",".join(map(str, ranks))
        self.rank, self.world_size = ranks.index(parent.rank), len(ranks)
        self.device, self.peer_timeout, self.counter = parent.device, parent.peer_timeout, parent.counter
        self.chunk_bytes = CHUNK_BYTES_PAIR if len(ranks) <= 2 else CHUNK_BYTES_RING
        self._seq, self._p2p_out, self._p2p_in = 0, {}, {}
        self._staging, self._hdr = {}, bytearray(len(parent._hdr))  # own: groups may run on two threads
        self._socks, self._sess, self._where = parent._socks, parent._sess, parent._where
        self._group_closed = False

    # the parent owns the links: its failure or close is the group's, and the group's failure is its
    _failed = property(lambda self: self._parent._failed)
    _closed = property(lambda self: self._parent._closed or self._group_closed)

    def _fail(self, err: CommError, dirty=frozenset()) -> CommError:
        return self._parent._fail(err, dirty)

    def _transfer(self, op, sends, recvs, elem=1, dtype=None, seq=None, extra=None, recv_seq=None, recv_extra=None):
        """The parent's engine, with group-local peers mapped to world ranks and the group named."""
        g = self._ranks
        super()._transfer(
            op,
            [(g[p], v, d) for p, v, d in sends],
            [(g[p], v, a) for p, v, a in recvs],
            elem,
            dtype,
            seq,
            dict(extra or {}, g=self._tag),
            recv_seq,
            None if recv_extra is None else dict(recv_extra, g=self._tag),
        )

    def new_group(self, ranks):
        raise CommError("build every group from the world Comm, not from a group")

    def close(self) -> None:
        self._group_closed = True


class TorchGroup(TorchComm):
    """A torch.distributed process group over `ranks`; byte counts go to the parent's counter."""

    def __init__(self, parent: TorchComm, ranks: list[int], pg):  # no super().__init__: the world is up
        self._pg, self._ranks = pg, ranks
        self.rank, self.world_size = ranks.index(parent.rank), len(ranks)
        self.device, self.peer_timeout, self.counter = parent.device, parent.peer_timeout, parent.counter
        self._where, self._nccl, self._closed = parent._where, parent._nccl, False

    def new_group(self, ranks):
        raise CommError("build every group from the world Comm, not from a group")

    def close(self) -> None:
        self._closed = True  # the world's destroy_process_group tears the group down
