"""Comm groups (the axes of a mesh) on both backends, gloo's groups the anchor.

Four ranks split two ways at once, rows {0,1},{2,3} and columns {0,2},{1,3}; every
collective inside a group gives the locally computed reference, the socket transport gives
exactly what gloo gives, and each call's bytes land on the one link inside the group, keyed by
the world rank at its far end (the textbook volumes of a 2-rank group).
"""

from __future__ import annotations

import pytest
from commtools import run_group


@pytest.fixture(scope="module")
def both():
    out = {}
    for backend in ("socket", "torch"):
        res = run_group("groups", 4, backend, timeout=90)
        for r, x in enumerate(res):
            assert x is not None and x["ok"], f"{backend} rank {r}: {x and (x.get('error'), x.get('trace'))}"
        out[backend] = [x["result"]["calls"] for x in res]
    return out


def expected_link(name: str, rank: int) -> tuple[int, int]:
    """(world rank of the far end, payload bytes) this rank sends for one call of a 2-rank group."""
    axis, call = name.split(".")
    peer = rank ^ 1 if axis == "row" else rank ^ 2
    sizes = {"all_reduce7": 7, "all_reduce300007": 300_007, "broadcast": 10, "all_gather": 6, "reduce_scatter": 5}
    if call in ("send", "recv"):
        return peer, 9 * 4 if call == "send" else 0
    if call == "broadcast":  # chain from group rank 1: only it sends
        return peer, 40 if ((rank & 1) if axis == "row" else (rank >> 1)) == 1 else 0
    return peer, sizes[call] * 4


@pytest.mark.parametrize("backend", ["socket", "torch"])
def test_group_collectives_match_reference_and_count_per_link(both, backend):
    for r, calls in enumerate(both[backend]):
        assert [c["name"] for c in calls if not c["ok"]] == [], f"{backend} rank {r}"
        for c in calls:
            peer, b = expected_link(c["name"], r)
            assert c["payload"] == ({str(peer): b} if b else {}), f"{backend} rank {r}: {c['name']} {c['payload']}"


def test_socket_groups_equal_gloo_groups(both):
    for r in range(4):
        assert [(c["name"], c["value"]) for c in both["socket"][r]] == [
            (c["name"], c["value"]) for c in both["torch"][r]
        ]


def test_a_rank_in_another_group_fails_loudly():
    res = run_group("group_mismatch", 2, "socket", timeout=30)
    for r, x in enumerate(res):
        assert x is not None and not x["ok"] and "mismatch" in x["error"], f"rank {r}: {x}"
