"""Issue 15, defects 1 and 5: strangers on a port never stop a run or lock a legitimate client out.

Before: handshakes were served one at a time (one silent connection to rank 0's rendezvous or
rank port made the others time out), the agent counted unauthenticated connections against its
64 slots and then said the secret was rejected, and the control channel and the parameter
server gave every idle connection a thread, without a cap.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from smolnet import agent_client as control
from smolnet import wire
from smolnet.agent import Agent
from smolnet.server import MAX_PENDING, AuthListener
from smoltrain.comm import make_comm
from smoltrain.comm.group import free_port_base
from smoltrain.comm.rendezvous import data_port

SECRET = b"test-secret-0123456789abcdef"


def _connect_when_listening(port: int, limit: float = 20.0) -> socket.socket:
    deadline = time.monotonic() + limit
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=2)
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on {port}"
            time.sleep(0.02)


def _rank(rank, n, port, out, timeout):
    def go():
        try:
            out[rank] = make_comm("socket", rank, n, "127.0.0.1", port, SECRET, timeout=timeout)
        except Exception as e:  # reported through `out`
            out[rank] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("where", ["rendezvous", "rank port"])
def test_a_silent_connection_does_not_stop_the_group_forming(where):
    n, port = 3, free_port_base(3)
    out: dict = {}
    threads = [_rank(0, n, port, out, timeout=20.0)]
    target = port if where == "rendezvous" else data_port(port, 0)
    strangers = [_connect_when_listening(target) for _ in range(3)]  # connected first, never speak
    try:
        threads += [_rank(r, n, port, out, timeout=20.0) for r in range(1, n)]
        for t in threads:
            t.join(40)
        errors = {r: x for r, x in out.items() if isinstance(x, Exception)}
        assert not errors and len(out) == n, errors
    finally:
        for s in strangers:
            s.close()
        for c in out.values():
            if not isinstance(c, Exception):
                c.close()


def test_a_rank_port_held_by_someone_else_moves_and_the_group_still_works():
    """A listener of another program on rank 1's port (the race a loopback run can lose between
    choosing ports and binding them): rank 1 listens elsewhere and the table says where."""
    import torch

    n, port = 3, free_port_base(3)
    squatter = socket.create_server(("127.0.0.1", data_port(port, 1)))
    out: dict = {}
    try:
        threads = [_rank(r, n, port, out, timeout=20.0) for r in range(n)]
        for t in threads:
            t.join(40)
        errors = {r: x for r, x in out.items() if isinstance(x, Exception)}
        assert not errors and len(out) == n, errors
        assert out[0]._where[1] != f"127.0.0.1:{data_port(port, 1)}"

        def reduce(r):
            t = torch.full((5,), float(r + 1))
            out[r].all_reduce(t)
            return t

        with ThreadPoolExecutor(n) as pool:
            sums = list(pool.map(reduce, range(n), timeout=20))
        assert all(torch.equal(t, torch.full((5,), 6.0)) for t in sums), sums
    finally:
        squatter.close()
        for c in out.values():
            if not isinstance(c, Exception):
                c.close()


def _echo_handler(sock, peer):
    with sock:
        kind, meta, _ = wire.recv_frame(sock, timeout=5.0, max_payload=0)
        wire.send_frame(sock, kind, meta, timeout=5.0)


def _wait(cond, what: str, limit: float = 20.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_flood_of_idle_connections_is_capped_and_legit_client_is_served():
    srv = AuthListener.serve(
        "127.0.0.1", 0, SECRET, _echo_handler, name="test", preauth_timeout=30.0, max_pending=32, max_per_source=1000
    )
    before = threading.active_count()
    flood = []
    try:
        for _ in range(3 * 32):
            flood.append(socket.create_connection(("127.0.0.1", srv.port), timeout=5))
        # wait until the listener has seen them all (accepted, evicted or turned away)
        _wait(lambda: srv.stats["accepted"] >= len(flood), srv.stats)
        assert threading.active_count() - before <= 32 + 4, srv.stats  # threads bounded by the cap
        s = wire.connect("127.0.0.1", srv.port, SECRET, timeout=10.0)  # evicts an idle stranger at once
        wire.send_frame(s, 1, {"hi": 1})
        assert wire.recv_frame(s, timeout=5.0)[1] == {"hi": 1}
        s.close()
        assert srv.stats["evicted"] >= 1
    finally:
        for s in flood:
            s.close()
        srv.close()


def test_an_evicted_stranger_is_told_busy():
    srv = AuthListener.serve(
        "127.0.0.1", 0, SECRET, _echo_handler, name="test", preauth_timeout=30.0, max_pending=64, max_per_source=4
    )
    victim = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    challenge = wire.recv_exact(victim, len(wire.MAGIC_AUTH) + wire.NONCE_BYTES, time.monotonic() + 5)
    assert challenge.startswith(wire.MAGIC_AUTH)
    flood = [socket.create_connection(("127.0.0.1", srv.port), timeout=5) for _ in range(4)]  # the same address
    try:
        _wait(lambda: srv.stats["evicted"] >= 1, srv.stats)
        # it had not answered the challenge, so it was the one to go: busy, where the proof would be
        assert wire.recv_exact(victim, 32, time.monotonic() + 5) == wire.BUSY_PROOF
    finally:
        for s in [victim, *flood]:
            s.close()
        srv.close()


def test_busy_only_when_every_pending_connection_has_answered():
    srv = AuthListener.serve(
        "127.0.0.1", 0, SECRET, _echo_handler, name="test", preauth_timeout=30.0, max_pending=4, max_per_source=4
    )
    flood = [socket.create_connection(("127.0.0.1", srv.port), timeout=5) for _ in range(4)]
    try:
        _wait(lambda: len(srv.pending) == 4, srv.stats)
        with srv.lock:
            for p in srv.pending:
                p.verifying = True  # as if each had answered and were being checked
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        with pytest.raises(wire.BusyError):
            wire.client_handshake(s, SECRET, timeout=5.0)
        s.close()
        assert srv.stats["busy"] >= 1 and srv.stats["evicted"] == 0
    finally:
        for s in flood:
            s.close()
        srv.close()


def _strangers(addr, port, sources: list[str], garbage: bool = False) -> list[socket.socket]:
    out = []
    for src in sources:
        s = socket.create_connection((addr, port), timeout=5, source_address=(src, 0))
        if garbage:
            s.sendall(os.urandom(100))  # in place of the answer to the challenge
        out.append(s)
    return out


@pytest.mark.parametrize("where", ["own address", "other addresses", "both"])
def test_agent_serves_every_member_through_a_flood(where):
    """Before every request, fresh idle strangers fill the agent's pending slots (from the
    member's own address up to its per-address cap, from three other addresses up to the global
    cap, or both) and garbage arrives from the member's own address: every request is served."""
    from smolnet.server import MAX_PER_SOURCE

    a = Agent("127.0.0.23", 0, SECRET, handshake_timeout=30.0, request_timeout=2.0)
    a.start_background()
    with socket.create_connection((a.bind, a.port), timeout=5) as probe:
        own = probe.getsockname()[0]  # the address our own requests come from
    others = ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"]
    idle = {
        "own address": [own] * MAX_PER_SOURCE,
        "other addresses": [o for o in others for _ in range(MAX_PER_SOURCE)],
        "both": [own] * MAX_PER_SOURCE + [o for o in others[:3] for _ in range(MAX_PER_SOURCE)],
    }[where]
    before = threading.active_count()
    served = 0
    try:
        for _ in range(8):
            want = a.stats["accepted"] + len(idle) + 4
            held = _strangers(a.bind, a.port, idle) + _strangers(a.bind, a.port, [own] * 4, garbage=True)
            _wait(lambda n=want: a.stats["accepted"] >= n, a.stats)
            served += control.call(a.bind, a.port, SECRET, "ping", timeout=5.0)["ok"]
            for s in held:
                s.close()
        assert served == 8
        assert a.stats["evicted"] >= 8 and a.stats["rejected"] >= 8, a.stats
        assert threading.active_count() - before <= MAX_PENDING + 16
    finally:
        a.stop()


def test_the_client_waits_out_a_busy_agent_within_its_timeout():
    from smolnet.agent import MAX_CONNECTIONS

    a = Agent("127.0.0.24", 0, SECRET, request_timeout=2.0)
    a.start_background()
    for _ in range(MAX_CONNECTIONS):  # every request slot taken by members' long requests
        a.slots.acquire()
    try:
        with pytest.raises(control.AgentBusy, match="busy"):
            control.call(a.bind, a.port, SECRET, "ping", timeout=5.0, connect_timeout=0.3)
        busy = a.stats["busy"]
        assert busy >= 2  # asked again, with backoff, before giving up
        threading.Timer(0.5, lambda: [a.slots.release() for _ in range(MAX_CONNECTIONS)]).start()
        assert control.call(a.bind, a.port, SECRET, "ping", timeout=5.0, connect_timeout=10.0)["ok"]
        assert a.stats["busy"] > busy
    finally:
        a.stop()


def test_control_channel_caps_idle_connections_and_keeps_them_off_its_queue():
    from smoltrain.run.channel import ControlServer

    srv = ControlServer("127.0.0.1", SECRET, lambda hello: None)
    before = threading.active_count()
    flood = [socket.create_connection(("127.0.0.1", srv.port), timeout=5) for _ in range(200)]
    try:
        deadline = time.monotonic() + 20
        while srv.listener.stats["accepted"] < len(flood):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert threading.active_count() - before <= MAX_PENDING + 4
        assert srv.messages.empty()  # strangers never reach the controller's queue (nor its clock)
    finally:
        for s in flood:
            s.close()
        srv.close()
