"""Who sends which bytes to whom in each SocketComm collective (the algorithms, no sockets).

Each `*_steps` function returns (sends, recvs) for `_Exchange`: sends are (peer, bytes,
index of the receive it forwards or None), recvs are (peer, bytes, tensor to add into or
None). Kept apart from SocketComm so the schedules (and the byte counts the tests check
against, `ring_allreduce_bytes`) can be read without the connection and failure handling.

The payload each rank sends (S = buffer bytes, N = world size):
- all_reduce: ring reduce-scatter then ring all-gather over N segments. Segment i has
  numel//N elements plus one for i < numel % N. Rank r sends every segment but
  (r+1)%N during reduce-scatter and every segment but (r+2)%N during all-gather:
  2*S - seg[(r+1)%N] - seg[(r+2)%N] bytes, all to rank (r+1)%N. That is exactly
  2(N-1)/N*S when numel divides by N, and the ranks together always send 2(N-1)*S.
- reduce_scatter / all_gather: ring, (N-1)/N of the full buffer per rank.
- broadcast: pipelined chain src -> src+1 -> ...; every rank but the last sends S.
- all_to_all: rank r sends inps[j] to j (j != r).
- two ranks and at most ring.SMALL_BYTES: one swap of the whole buffer (the same S bytes as
  the ring, one round trip instead of two).
- send/recv: the tensor; barrier: an empty frame to every peer (framing only).
"""

from __future__ import annotations

from smoltrain.comm.exchange import _byte_view
from smoltrain.comm.layout import SMALL_BYTES  # the planner counts the same rounds
from smoltrain.comm.layout import ring_segments as _segments  # the planner counts the same split


def ring_allreduce_bytes(numel: int, elem_size: int, world_size: int, rank: int) -> int:
    """Payload bytes rank `rank` sends in one ring all-reduce (the uneven-split rule in socket_comm)."""
    if world_size == 1 or numel == 0:
        return 0
    seg = [hi - lo for lo, hi in _segments(numel, world_size)]
    return (2 * numel - seg[(rank + 1) % world_size] - seg[(rank + 2) % world_size]) * elem_size


def broadcast_steps(view, rank: int, n: int, src: int):
    """Pipelined chain src -> src+1 -> ...: each rank forwards what it receives."""
    pos = (rank - src) % n
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    recvs = [(prv, view, None)] if pos > 0 else []
    sends = [(nxt, view, 0 if pos > 0 else None)] if pos < n - 1 else []
    return sends, recvs


def all_reduce_steps(flat, view, r: int, n: int):
    """Ring reduce-scatter then ring all-gather; two ranks with a small buffer swap once."""
    es = flat.element_size()
    segs = _segments(flat.numel(), n)
    nxt, prv = (r + 1) % n, (r - 1) % n
    if n == 2 and len(view) <= SMALL_BYTES:
        # Two ranks, small buffer: swap whole buffers in one exchange (recursive doubling).
        # Same bytes as the ring (S each), half the round trips; a+b == b+a, so both
        # ranks hold bit-identical sums. The copy keeps the outgoing bytes unreduced.
        return [(nxt, _byte_view(flat.clone()), None)], [(prv, view, flat)]
    sends, recvs = [], []
    for t in range(n - 1):  # reduce-scatter: rank r ends up owning segment (r+1) % n
        slo, shi = segs[(r - t) % n]
        rlo, rhi = segs[(r - t - 1) % n]
        sends.append((nxt, view[slo * es : shi * es], t - 1 if t else None))
        recvs.append((prv, view[rlo * es : rhi * es], flat[rlo:rhi]))
    for t in range(n - 1):  # all-gather: pass the owned segments around
        slo, shi = segs[(r + 1 - t) % n]
        rlo, rhi = segs[(r - t) % n]
        sends.append((nxt, view[slo * es : shi * es], n - 2 + t))
        recvs.append((prv, view[rlo * es : rhi * es], None))
    return sends, recvs


def reduce_scatter_steps(work, view, m: int, r: int, n: int):
    """Ring over n segments of m elements; ends with rank r owning segment r, reduced."""
    es = work.element_size()
    nxt, prv = (r + 1) % n, (r - 1) % n
    sends, recvs = [], []
    for t in range(n - 1):
        s, g = (r - t - 1) % n, (r - t - 2) % n
        sends.append((nxt, view[s * m * es : (s + 1) * m * es], t - 1 if t else None))
        recvs.append((prv, view[g * m * es : (g + 1) * m * es], work[g * m : (g + 1) * m]))
    return sends, recvs


def all_gather_steps(view, m: int, es: int, r: int, n: int):
    """Ring over n segments of m elements: pass each rank's segment all the way round."""
    nxt, prv = (r + 1) % n, (r - 1) % n
    sends, recvs = [], []
    for t in range(n - 1):
        s, g = (r - t) % n, (r - t - 1) % n
        sends.append((nxt, view[s * m * es : (s + 1) * m * es], t - 1 if t else None))
        recvs.append((prv, view[g * m * es : (g + 1) * m * es], None))
    return sends, recvs


def all_to_all_steps(in_views: list, out_views: list, r: int):
    """Rank r sends in_views[j] to every j != r and receives out_views[j] from it."""
    n = len(in_views)
    sends = [((r + k) % n, in_views[(r + k) % n], None) for k in range(1, n)]
    recvs = [((r - k) % n, out_views[(r - k) % n], None) for k in range(1, n)]
    return sends, recvs


def barrier_steps(r: int, n: int):
    """An empty frame to every peer and one from every peer."""
    empty = memoryview(b"")
    sends = [((r + k) % n, empty, None) for k in range(1, n)]
    recvs = [((r - k) % n, empty, None) for k in range(1, n)]
    return sends, recvs
