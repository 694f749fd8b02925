"""The wire layout of the transport's collectives, torch-free: how a ring splits a buffer
into segments and what a segment of a pseudo-gradient costs on the wire in each sync dtype.

It belongs to the transport (comm/ring.py, comm/quantized.py lay their bytes out by it);
the planner imports it to count the same bytes (planner/diloco.py), never the other way.
"""

from __future__ import annotations

import math

SYNC_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}  # bytes per element on the wire
INT8_CHUNK = 1024  # int8 pseudo-gradients: one fp32 scale per this many elements
SCALE_BYTES = 4

# Two ranks and at most this many bytes: the all-reduce swaps whole buffers instead of running
# the ring. The same bytes each way, one round instead of two (the ring's all-gather waits on its
# reduce-scatter); the cost is a copy of the buffer, so big ones still take the ring. Raised from
# 64 KB for tp inside a pp stage (issue 38): its all-reduces of 49-393 KB per microbatch each paid
# a second round, and on CPU-capped hosts a round costs a wake-up of both ends (ms, not alpha).
SMALL_BYTES = 1 << 20


def ring_segments(numel: int, world: int) -> list[tuple[int, int]]:
    """Element ranges of the ring's segments: numel // world each, the first numel % world one more."""
    base, extra = divmod(numel, world)
    out, lo = [], 0
    for i in range(world):
        hi = lo + base + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def segment_bytes(numel: int, dtype: str) -> int:
    """Bytes one segment of `numel` pseudo-gradient elements takes on the wire."""
    scales = SCALE_BYTES * math.ceil(numel / INT8_CHUNK) if dtype == "int8" else 0
    return numel * SYNC_BYTES[dtype] + scales
