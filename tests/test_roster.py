"""diloco's roster with its members over loopback, in one process: who is kept at a sync when
rank 0 (which holds the roster) or another member arrives late.

The member timeout here is 2 s; rank 0 checks in 3.5 s after the others. Before the roster said
WAIT to the members already in, they gave up at 2 s and the run lost them (the bench's Jetson
rank 0 at H=34). A member 0.4 s behind the first is kept under a 0.2 s `barrier_timeout`
because the first took 2 s for the round (half of it is allowed), and one 1.6 s behind is not.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from ports import free_port

from smoltrain.strategies.roster import Member, Roster, member_timeout

SECRET = b"roster-test-secret-0123456789abcdef"


class Reporter:
    def __init__(self):
        self.lines, self.events = [], []

    def log(self, msg):
        self.lines.append(msg)

    def event(self, step, kind, who):
        self.events.append((step, kind, who))


def test_members_wait_for_a_slow_rank_0_and_a_member_within_half_a_round_is_kept():
    run = SimpleNamespace(
        coord_addr="127.0.0.1", port=free_port() - 5, world_size=4, barrier_timeout=0.2, timeout=1.6,
        placement=None, shares=None, names=["rank0", "rank1", "rank2", "rank3"], inner_steps=4, steps=4,
    )  # fmt: skip
    assert member_timeout(run) == 2.0
    reporter = Reporter()
    roster = Roster(SimpleNamespace(run=run, reporter=reporter, secret=SECRET, batch=8), 4, last_outer=0)
    members = [Member(run, SECRET, f"rank{r}", r, timeout=member_timeout(run)) for r in range(4)]
    start = time.monotonic()
    arrive = {0: 5.5, 1: 2.0, 2: 2.4, 3: 3.6}  # seconds after the start of the outer step
    got, errors = {}, {}

    def member(r):
        try:
            time.sleep(max(0.0, start + arrive[r] - time.monotonic()))
            got[r] = members[r].sync(0, tokens=32, seconds=1.0)
            if got[r] is not None and f"rank{r}" in got[r]["names"]:
                got[r]["ok"] = members[r].commit(0, True)
        except Exception as e:  # the assertion below names it
            errors[r] = repr(e)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    roster.thread.join(timeout=10)
    for m in members:
        m.close()
    assert roster.error is None, roster.error
    assert not [r for r in (0, 1, 2) if r in errors], (errors, reporter.lines)
    for r in (0, 1, 2):
        assert got[r]["names"] == ["rank0", "rank1", "rank2"], (r, got[r])
        assert got[r]["ok"] is True
    dropped = [line for line in reporter.lines if "dropping" in line]
    assert len(dropped) == 1 and "rank3" in dropped[0] and "behind the first" in dropped[0], reporter.lines
