"""All-reduce of a flat fp32 tensor with a smaller dtype on the wire (diloco's --sync-dtype).

bf16 and fp16: the tensor is cast and all-reduced as is by the backend (every hop adds in
that dtype; the all-gather hands every rank the same bits). int8 (symmetric, one fp32
scale per INT8_CHUNK elements) cannot be summed on the wire, so it is a ring written here on
`SocketComm.exchange`: in the reduce-scatter each rank decodes the partial sum it receives,
adds its own fp32 segment and re-encodes it for the next hop; the owner of a finished
segment encodes it once and those bytes go round unchanged in the all-gather, the owner
keeping the decoded copy too. So every rank ends with bit-identical values, and each
segment costs `comm.layout.segment_bytes` on the wire (scales included), as the plan counts.
"""

from __future__ import annotations

import torch

from smoltrain.comm.layout import INT8_CHUNK, ring_segments, segment_bytes

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def encode_int8(x: torch.Tensor, work: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 values -> uint8 bytes: one fp32 scale per chunk (max |x| / 127), then the int8 values.

    In place in one scratch buffer (`work`, at least x.numel() fp32; the ring passes one for
    the whole all-reduce): a fresh temporary per operation cost more in page faults than the
    arithmetic (a capped host pays it at every hop)."""
    n, C = x.numel(), INT8_CHUNK
    chunks, full = -(-n // C), n // C * C
    out = torch.empty(4 * chunks + n, dtype=torch.uint8)
    scale = out[: 4 * chunks].view(torch.float32)
    w = (torch.empty(n) if work is None else work)[:n]
    torch.abs(x, out=w)
    if full:
        torch.amax(w[:full].view(-1, C), dim=1, out=scale[: full // C])
    if n > full:  # the last, short chunk
        torch.amax(w[full:], dim=0, keepdim=True, out=scale[full // C :])
    scale.div_(127.0).masked_fill_(scale == 0, 1.0)
    if full:
        torch.div(x[:full].view(-1, C), scale[: full // C, None], out=w[:full].view(-1, C))
    if n > full:
        torch.div(x[full:], scale[full // C :], out=w[full:])
    out[4 * chunks :].view(torch.int8).copy_(w.round_().clamp_(-127, 127))
    return out


def decode_int8(buf: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 bytes from encode_int8 -> n fp32 values (into `out` when given)."""
    C = INT8_CHUNK
    chunks, full = -(-n // C), n // C * C
    scale = buf[: 4 * chunks].view(torch.float32)
    out = torch.empty(n) if out is None else out
    out.copy_(buf[4 * chunks :].view(torch.int8))
    if full:
        out[:full].view(-1, C).mul_(scale[: full // C, None])
    if n > full:
        out[full:].mul_(scale[full // C :])
    return out


def all_reduce_int8(comm, flat: torch.Tensor) -> None:
    """Sum `flat` (fp32, CPU, contiguous) over the ranks in place, int8 on the wire."""
    n, r = comm.world_size, comm.rank
    if n == 1 or flat.numel() == 0:
        return
    segs = ring_segments(flat.numel(), n)
    nxt, prv = (r + 1) % n, (r - 1) % n
    work = torch.empty(max(hi - lo for lo, hi in segs))  # the codec's scratch, one for the whole ring

    def inbox(i: int) -> torch.Tensor:
        lo, hi = segs[i]
        return torch.empty(segment_bytes(hi - lo, "int8"), dtype=torch.uint8)

    for t in range(n - 1):  # reduce-scatter: pass partial sums on, re-encoded at every hop
        slo, shi = segs[(r - t) % n]
        g = (r - t - 1) % n
        got = inbox(g)
        comm.exchange(encode_int8(flat[slo:shi], work), nxt, got, prv)
        lo, hi = segs[g]
        flat[lo:hi] += decode_int8(got, hi - lo, work[: hi - lo])
    lo, hi = segs[(r + 1) % n]  # this rank's finished segment: encoded once, for everyone
    out = encode_int8(flat[lo:hi], work)
    decode_int8(out, hi - lo, flat[lo:hi])
    for t in range(n - 1):  # all-gather: forward the bytes as received
        g = (r - t) % n
        got = inbox(g)
        comm.exchange(out, nxt, got, prv)
        lo, hi = segs[g]
        decode_int8(got, hi - lo, flat[lo:hi])
        out = got


def all_reduce_as(comm, flat: torch.Tensor, dtype: str) -> None:
    """Sum `flat` over the ranks in place with `dtype` on the wire (fp32, bf16, fp16, int8)."""
    if dtype == "int8":
        all_reduce_int8(comm, flat)
    elif dtype == "fp32":
        comm.all_reduce(flat, op="sum")
    else:
        wire = flat.to(TORCH_DTYPES[dtype])
        comm.all_reduce(wire, op="sum")
        flat.copy_(wire)
