"""Issue 41: frames after the handshake carry a MAC on the inference control channel, the
measurement agent and the rendezvous; an injected or altered frame is dropped and logged,
never acted on. And `Cluster.start` registers its ranks behind the parallel listener, so a
few silent connections do not hold it up."""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time

import pytest

from smolnet import agent_client as control
from smolnet import wire
from smolnet.agent import Agent
from smolnet.server import AuthListener
from smoltrain.comm import rendezvous as rdv
from smoltrain.comm.group import free_port_base
from smoltrain.infer.cluster import Cluster
from smoltrain.infer.config import InferConfig
from smoltrain.infer.worker import MSG, Control

SECRET = b"test-secret-0123456789abcdef"
CFG = InferConfig("local", "socket", "/nonexistent", None, ("rank0",), ((0, 1),))


def _forged(kind: int, meta: dict) -> bytes:
    """A frame as a third party on the path would inject it: well formed, but without the key."""
    head = wire.pack_header(kind, meta, 0)
    return head + b"\0" * wire.TAG_BYTES * 2


def _closed(s: socket.socket) -> None:
    """Read until the peer closes (or resets: it hung up with our bytes unread)."""
    s.settimeout(5)
    try:
        while s.recv(4096):
            pass
    except ConnectionResetError:
        pass
    s.close()


def _wait(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.fixture
def agent():
    a = Agent("127.0.0.1", 0, SECRET, handshake_timeout=1.0, request_timeout=2.0)
    a.start_background()
    yield a
    a.stop()


def test_agent_drops_an_injected_request(agent, caplog):
    s = socket.create_connection((agent.bind, agent.port), timeout=5)
    wire.client_handshake(s, SECRET, timeout=5)  # a member's connection, then a frame it did not send
    s.sendall(_forged(control.KIND_REQUEST, {"op": "lease"}))
    _closed(s)
    _wait(lambda: agent.stats["forged"] == 1, "the forged frame was not counted")
    assert "lease" not in agent.ops
    assert "failed its MAC" in caplog.text
    assert control.call(agent.bind, agent.port, SECRET, "lease", timeout=5.0)["ok"]  # and it goes on serving


def test_agent_drops_an_altered_request(agent, caplog):
    conn = control.open_agent(agent.bind, agent.port, SECRET)
    head = wire.pack_header(control.KIND_REQUEST, {"op": "ping"}, 0)
    tags = conn.session.seal(head) + conn.session.seal_payload(b"")
    conn.sock.sendall(head.replace(b"ping", b"pong") + tags)  # the sender's frame, changed on the way
    with pytest.raises(control.AgentError):
        control.read_reply(conn, 5.0)
    conn.close()
    _wait(lambda: agent.stats["forged"] == 1, "the altered frame was not counted")
    assert not agent.ops and "failed its MAC" in caplog.text


def _controller(world: int = 1):
    """The controller's end of the inference control channel, played by the test."""
    got: queue.Queue = queue.Queue()

    def greet(sock, peer, key):
        ses = wire.Session(key, client=False, full=True)
        _, hello, _ = wire.recv_frame(sock, timeout=5.0, max_payload=0, session=ses)
        wire.send_frame(sock, MSG, {"type": "config", "config": CFG.to_wire()}, timeout=5.0, session=ses)
        got.put((sock, ses, hello))

    return AuthListener.serve("127.0.0.1", 0, SECRET, greet, name="test controller", with_key=True), got


def test_worker_drops_an_injected_control_frame(capfd):
    srv, got = _controller()
    try:
        ctl = Control("127.0.0.1", srv.port, SECRET, rank=0)
        sock, ses, hello = got.get(timeout=10)
        assert hello["type"] == "hello" and ctl.config == CFG
        wire.send_frame(sock, MSG, {"type": "stats"}, timeout=5.0, session=ses)  # the controller's own
        assert ctl.inbox.get(timeout=10) == {"type": "stats"}
        sock.sendall(_forged(MSG, {"type": "admit", "request": {"rid": 1}}))  # a third party's
        assert ctl.inbox.get(timeout=10) == {"type": "quit"}  # the connection is closed, as if lost
        assert ctl.inbox.empty()
        assert "frame dropped" in capfd.readouterr().err
        sock.close()
        ctl.sock.close()
    finally:
        srv.close()


class _TestCluster(Cluster):
    """A Cluster whose one rank is the worker's real Control, in a thread, behind `silent`
    connections that never answer the challenge."""

    silent = 4

    def _launch(self, port: int) -> None:
        self.strangers = [socket.create_connection(("127.0.0.1", port)) for _ in range(self.silent)]

        def rank0():
            self.ctl = Control("127.0.0.1", port, SECRET, rank=0)
            self.ctl.send({"type": "ready"})

        threading.Thread(target=rank0, daemon=True).start()


def test_cluster_registers_past_silent_connections_and_drops_an_injected_frame(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    c = _TestCluster(CFG, [], SECRET, str(tmp_path))
    try:
        c.start(timeout=8.0)  # one silent connection at a time held the old loop 10 s each
        for s in c.strangers:
            s.close()
        c.ctl.send({"type": "stats", "stats": {}, "links": []})
        assert c.replies.get(timeout=10)[1]["type"] == "stats"
        c.ctl.sock.sendall(_forged(MSG, {"type": "stats", "stats": {"forged": 1}, "links": []}))
        _wait(lambda: c.dead, "the forged frame did not end the connection")
        assert c.replies.empty()
        assert "failed its MAC" in caplog.text
    finally:
        c.close()


def test_rendezvous_refuses_a_registration_without_its_mac(caplog):
    """Rank 0's rendezvous acts only on MACed registrations: a frame injected in place of a
    member's hello is logged and dropped, and the real ranks still meet."""
    port = free_port_base(4)
    out: dict = {}

    def rank(r):
        out[r] = rdv.rendezvous(r, 2, "127.0.0.1", port, SECRET, "127.0.0.1", 5000 + r, timeout=20.0)

    t0 = threading.Thread(target=rank, args=(0,))
    t0.start()
    s, _ = rdv.dial_authenticated("127.0.0.1", port, SECRET, time.monotonic() + 10, "rank 0", 0)
    s.sendall(_forged(rdv.K_HELLO, {"rank": 1, "world_size": 2, "addr": "10.6.6.6", "port": 1}))
    _closed(s)  # dropped without a table
    rank(1)
    t0.join(30)
    assert out[0] == out[1] == [("127.0.0.1", 5000), ("127.0.0.1", 5001)]
    assert "failed its MAC" in caplog.text
