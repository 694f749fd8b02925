"""Decode weights in transparent huge pages where Linux offers them (2 MB on x86-64 and 4K-page
arm64; 32 MB on a 16K-page arm64 kernel such as the Raspberry Pi 5's: read from the kernel).

A batch-1 decode step streams every weight once, a row at a time. With 4 KB pages that is
a TLB miss every 4 KB, a page walk the hardware prefetcher cannot run ahead of; with 2 MB
pages one every 2 MB. On the machine of BENCHMARKS.md a whole fp32 decode step ran
1.14-1.20x faster with its weights in huge pages (a plain 64 MB copy, the bound, moved
about the same either way). Linux gives them to memory asked for with
madvise(MADV_HUGEPAGE) when /sys/kernel/mm/transparent_hugepage/enabled is `always` or
`madvise` (the default of Debian and most distributions). torch's allocator does not ask,
so `hold` copies a weight into an anonymous mapping that does, aligned to 2 MB. Elsewhere
(macOS, `never`, SMOL_HUGEPAGES=0: the A/B switch) the weight stays as it is.
"""

from __future__ import annotations

import functools
import mmap
import os
from pathlib import Path

import torch

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
PMD_SIZE = Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")


def huge_size(path: Path = PMD_SIZE) -> int:
    """Bytes in this kernel's transparent huge page; 2 MB where it does not say."""
    try:
        n = int(path.read_text())
    except (OSError, ValueError):
        return 2 << 20
    return n if n > 0 and n & (n - 1) == 0 else 2 << 20


HUGE = huge_size()


@functools.lru_cache(maxsize=1)
def available() -> bool:
    if os.environ.get("SMOL_HUGEPAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP.read_text()
    except OSError:
        return False


def hold(t: torch.Tensor) -> torch.Tensor:
    """t's values in memory the kernel may back with huge pages (a copy; the mapping lives as
    long as the tensor), or t itself: not on the CPU, under one huge page, or none offered."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes < HUGE or not available():
        return t
    mm = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mm, dtype=torch.uint8)  # keeps `mm` alive
    at = -raw.data_ptr() % HUGE
    # before the first touch, so they are faulted in huge; only whole huge pages, so the tail
    # of a weight costs 4 KB pages, not up to 2 MB of memory nothing reads
    mm.madvise(mmap.MADV_HUGEPAGE, at, nbytes // HUGE * HUGE)
    out = raw[at : at + nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out
