"""All-reduce of a flat fp32 tensor with a smaller dtype on the wire (diloco's --sync-dtype).

bf16 and fp16: the tensor is cast and all-reduced as is by the backend (every hop adds in
that dtype; the all-gather hands every rank the same bits). int8 (symmetric, one fp32
scale per INT8_CHUNK elements) cannot be summed on the wire, so it is a ring written here on
`SocketComm.exchange`: in the reduce-scatter each rank decodes the partial sum it receives,
adds its own fp32 segment and re-encodes it for the next hop; the owner of a finished
segment encodes it once and those bytes go round unchanged in the all-gather, the owner
keeping the decoded copy too. So every rank ends with bit-identical values, and each
segment costs `planner.diloco.segment_bytes` on the wire (scales included), as the plan counts.
"""

from __future__ import annotations

import torch

from smoltrain.planner.diloco import INT8_CHUNK, ring_segments, segment_bytes

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def encode_int8(x: torch.Tensor) -> torch.Tensor:
    """fp32 values -> uint8 bytes: one fp32 scale per chunk (max |x| / 127), then the int8 values."""
    n = x.numel()
    chunks = -(-n // INT8_CHUNK)
    padded = torch.zeros(chunks * INT8_CHUNK)
    padded[:n] = x
    rows = padded.view(chunks, INT8_CHUNK)
    scale = rows.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(rows / scale[:, None]).clamp_(-127, 127).to(torch.int8).reshape(-1)[:n]
    return torch.cat([scale.view(torch.uint8), q.view(torch.uint8)])


def decode_int8(buf: torch.Tensor, n: int) -> torch.Tensor:
    """uint8 bytes from encode_int8 -> n fp32 values."""
    chunks = -(-n // INT8_CHUNK)
    scale = buf[: 4 * chunks].view(torch.float32)
    q = torch.zeros(chunks * INT8_CHUNK)
    q[:n] = buf[4 * chunks :].view(torch.int8).float()
    return (q.view(chunks, INT8_CHUNK) * scale[:, None]).reshape(-1)[:n]


def all_reduce_int8(comm, flat: torch.Tensor) -> None:
    """Sum `flat` (fp32, CPU, contiguous) over the ranks in place, int8 on the wire."""
    n, r = comm.world_size, comm.rank
    if n == 1 or flat.numel() == 0:
        return
    segs = ring_segments(flat.numel(), n)
    nxt, prv = (r + 1) % n, (r - 1) % n

    def inbox(i: int) -> torch.Tensor:
        lo, hi = segs[i]
        return torch.empty(segment_bytes(hi - lo, "int8"), dtype=torch.uint8)

    for t in range(n - 1):  # reduce-scatter: pass partial sums on, re-encoded at every hop
        slo, shi = segs[(r - t) % n]
        g = (r - t - 1) % n
        got = inbox(g)
        comm.exchange(encode_int8(flat[slo:shi]), nxt, got, prv)
        lo, hi = segs[g]
        flat[lo:hi] += decode_int8(got, hi - lo)
    lo, hi = segs[(r + 1) % n]  # this rank's finished segment: encoded once, for everyone
    out = encode_int8(flat[lo:hi])
    flat[lo:hi] = decode_int8(out, hi - lo)
    for t in range(n - 1):  # all-gather: forward the bytes as received
        g = (r - t) % n
        got = inbox(g)
        comm.exchange(out, nxt, got, prv)
        lo, hi = segs[g]
        flat[lo:hi] = decode_int8(got, hi - lo)
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
