"""A peer killed in the middle of a collective: every survivor raises a CommError naming it, fast."""

from __future__ import annotations

import os
import time

import pytest
from commtools import Group

TIMEOUT = 6.0


def _wait_running(g: Group, rank: int, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not os.path.exists(os.path.join(g.dir, f"running{rank}")):
        assert time.monotonic() < deadline, "the group never got going"
        assert all(p.is_alive() for p in g.procs), "a rank died before the kill"
        time.sleep(0.02)


@pytest.mark.parametrize("backend,n,victim", [("socket", 4, 2), ("socket", 2, 1), ("socket", 3, 0), ("torch", 3, 1)])
def test_killed_peer_is_named_by_every_survivor(backend, n, victim):
    g = Group("killed", n, backend, {"timeout": TIMEOUT, "numel": 1 << 20}).start()
    _wait_running(g, victim)
    time.sleep(0.05)
    killed_at = g.kill(victim)
    res = g.results(timeout=TIMEOUT * 3)
    for r, x in enumerate(res):
        if r == victim:
            continue
        assert x is not None, f"survivor rank {r} hung (killed after {TIMEOUT * 3}s)"
        assert not x["ok"] and x["type"] == "CommError", f"rank {r}: {x}"
        assert x["t"] - killed_at < TIMEOUT + 2.0, f"rank {r} took {x['t'] - killed_at:.1f}s to notice"
        if backend == "socket":
            assert x["peer"] == victim, f"rank {r} blamed {x['peer']}: {x['error']}"
            assert f"rank {victim} (127.0.0.1:{g.port + 1 + victim})" in x["error"], x["error"]
