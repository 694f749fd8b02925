"""The measurement agent against bad peers, and its probes between two real agents on loopback."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import time

import pytest
from need import need_tool
from ports import free_port

from smolnet import agent_client as control
from smolnet import wire
from smolnet.agent import Agent
from smolnet.probes import iperf, pmtu

SECRET = b"test-secret-0123456789abcdef"


@pytest.fixture
def agents():
    """Two agents on distinct loopback addresses, short timeouts so bad peers cost little."""
    a = Agent("127.0.0.21", 0, SECRET, handshake_timeout=1.0, request_timeout=1.0)
    b = Agent("127.0.0.22", 0, SECRET, handshake_timeout=1.0, request_timeout=1.0)
    a.start_background()
    b.start_background()
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()


def ping(agent: Agent) -> dict:
    return control.call(agent.bind, agent.port, SECRET, "ping", timeout=5.0)


def raw(agent: Agent) -> socket.socket:
    s = socket.create_connection((agent.bind, agent.port), timeout=5)
    return s


def authed(agent: Agent) -> control.Conn:
    s = raw(agent)
    return control.Conn(s, wire.client_handshake(s, SECRET, timeout=5), client=True)


def closed_by_peer(s: socket.socket, wait: float = 5.0) -> bool:
    """True when the agent closed (or reset) the connection, after maybe an error frame."""
    s.settimeout(wait)
    try:
        while True:
            data = s.recv(65536)
            if not data:
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_ping_and_facts(agents):
    a, _ = agents
    info = ping(a)
    assert info["ok"] and info["port"] == a.port
    f = control.call(a.bind, a.port, SECRET, "facts", timeout=10.0)
    assert f["iface"] == "lo" and f["iface_mtu"] >= 1500 and f["cpus_logical"] >= 1
    assert any("127.0.0.1" in i["addresses"] for i in f["interfaces"])


def test_wrong_secret_rejected_agent_keeps_serving(agents):
    a, _ = agents
    with pytest.raises(control.AgentError, match="secret"):
        control.call(a.bind, a.port, b"another-secret-of-enough-length", "ping")
    assert a.stats["rejected"] >= 1
    assert ping(a)["ok"]


def test_no_secret_silent_peer_dropped(agents):
    a, _ = agents
    s = raw(a)
    hello = s.recv(64)
    assert hello.startswith(wire.MAGIC_AUTH)
    assert closed_by_peer(s)  # we never answered the challenge: dropped on timeout
    s.close()
    assert ping(a)["ok"]


def test_garbage_instead_of_handshake(agents):
    a, _ = agents
    s = raw(a)
    s.recv(64)
    s.sendall(os.urandom(64))  # exactly the handshake size, but no valid MAC
    assert closed_by_peer(s)
    s.close()
    s = raw(a)
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 50)
    assert closed_by_peer(s)
    s.close()
    assert ping(a)["ok"]


def test_oversized_lengths_rejected_before_allocation(agents):
    a, _ = agents
    for json_len, payload_len in ((wire.MAX_JSON_BYTES + 1, 0), (2, 1 << 40), (0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF)):
        s = authed(a).sock
        s.sendall(
            wire.FRAME_HEADER.pack(wire.FRAME_MAGIC, wire.FRAME_VERSION, control.KIND_REQUEST, 0, json_len, payload_len)
        )
        assert closed_by_peer(s)
        s.close()
    assert a.stats["errors"] >= 3
    assert ping(a)["ok"]


def test_half_frames_and_bad_json(agents):
    a, _ = agents
    head = wire.pack_header(control.KIND_REQUEST, {"op": "ping"}, 0)
    s = authed(a).sock
    s.sendall(head[:7])  # half a fixed header, then silence
    assert closed_by_peer(s)
    s.close()
    s = authed(a).sock
    s.sendall(head[:-3])  # header complete, JSON cut short, then close
    s.shutdown(socket.SHUT_WR)
    assert closed_by_peer(s)
    s.close()
    c = authed(a)
    js = b"[1, 2"
    head = wire.FRAME_HEADER.pack(wire.FRAME_MAGIC, 1, control.KIND_REQUEST, 0, len(js), 0) + js
    c.sock.sendall(head + c.session.seal(head) + c.session.seal_payload(b""))  # MACed, but not JSON
    kind, meta, _ = c.recv(5)
    assert kind == control.KIND_ERROR and "JSON" in meta["error"]
    c.close()
    for op, bad in (
        ("nope", {}),
        ("rtt", {"dst": "not-an-ip", "port": 1}),
        ("sink_data", {"session": "missing"}),
        ("echo", {"size": 10**9}),
        ("throughput", {"dst": "127.0.0.22", "port": 1, "streams": 10**6}),
    ):
        s = authed(a)
        control.send_request(s, op, **bad)
        with pytest.raises(control.AgentError):
            control.read_reply(s, 5.0)
        s.close()
    assert ping(a)["ok"]


def test_udp_probe_acks_only_authenticated(agents):
    a, _ = agents
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect((a.bind, a.port))
    s.settimeout(0.5)
    try:
        _, pkt = pmtu.make_probe(b"wrong-secret-wrong-secret", 1000)
        s.send(pkt)
        s.send(b"\x00" * 10)
        s.send(os.urandom(1400))
        with pytest.raises(socket.timeout):
            s.recv(256)
        nonce, pkt = pmtu.make_probe(SECRET, 1000)
        s.send(pkt)
        ack = s.recv(256)
        assert pmtu._check_ack(SECRET, ack, nonce, 1000)
        assert not pmtu._check_ack(b"wrong-secret-wrong-secret", ack, nonce, 1000)
        # a probe whose claimed size disagrees with its length is not answered
        head = pkt[: pmtu.HEAD.size]
        s.send(head + b"\x00" * 10)
        with pytest.raises(socket.timeout):
            s.recv(256)
    finally:
        s.close()
    assert a.stats["udp_acked"] == 1 and a.stats["udp_dropped"] >= 4


def test_rtt_pmtu_builtin_throughput_between_agents(agents):
    a, b = agents
    r = control.call(a.bind, a.port, SECRET, "rtt", timeout=30, dst=b.bind, port=b.port, count=200)
    assert r["samples"] == 200
    assert 0 < r["min"] <= r["p50"] <= r["p90"] <= r["p99"] <= r["max"]
    m = control.call(a.bind, a.port, SECRET, "pmtu", timeout=30, dst=b.bind, port=b.port)
    assert m["error"] is None and m["mtu_effective"] == min(m["local_mtu"], pmtu.MAX_PROBE)
    t = control.call(
        a.bind,
        a.port,
        SECRET,
        "throughput",
        timeout=30,
        dst=b.bind,
        port=b.port,
        duration=0.5,
        omit=0.2,
        streams=2,
        backend="builtin",
    )
    assert t["method"] == "builtin" and t["throughput_mbit"] > 10
    assert t["bytes_received"] <= t["bytes_sent"]
    assert 0.45 <= t["seconds"] <= 2.0
    assert ping(a)["ok"] and ping(b)["ok"]


def test_probe_towards_silent_port_reports_no_ack(agents):
    a, _ = agents
    quiet = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    quiet.bind(("127.0.0.23", 0))  # receives, never acks: a path that eats everything
    try:
        m = pmtu.measure_pmtu("127.0.0.23", quiet.getsockname()[1], SECRET, source="127.0.0.21", tries=1, wait=0.05)
    finally:
        quiet.close()
    assert m["mtu_effective"] is None and "no acknowledgement" in m["error"]


@pytest.mark.parametrize("duration", [1, 0.5])
def test_iperf3_backend_between_agents(agents, duration):
    """0.5 s: `smolnet matrix --duration` takes it, and iperf3 reads `-t 0.5` as "run forever"."""
    need_tool("iperf3")
    a, b = agents
    srv = control.call(b.bind, b.port, SECRET, "iperf3_server", timeout=15, lifetime=20)
    t = control.call(
        a.bind,
        a.port,
        SECRET,
        "throughput",
        timeout=30,
        dst=b.bind,
        port=srv["port"],
        duration=duration,
        omit=0.5,
        streams=2,
        backend="iperf3",
    )
    assert t["method"] == "iperf3" and t["connected"] and t["throughput_mbit"] > 10
    assert t["bytes_received"] > 0


def test_iperf3_json_traps():
    doc = iperf.parse_json(
        'warning: something odd\n{"start": {"connected": [{}]}, "end": {'
        '"sum_sent": {"bytes": 5000000, "retransmits": 40, "bits_per_second": 4e7},'
        '"sum_received": {"bytes": 0, "seconds": 3.0, "bits_per_second": 0},'
        '"cpu_utilization_percent": {"host_total": 12.0}}}'
    )
    s = iperf.summarize(doc)
    # the sender believed 40 Mbit/s; the receiver got nothing: that is what we report
    assert s["throughput_mbit"] == 0 and s["connected"] and not s["cpu_limited"]
    with pytest.raises(iperf.IperfError, match="unable to connect"):
        iperf.summarize({"error": "unable to connect to server"})
    with pytest.raises(iperf.IperfError):
        iperf.parse_json("iperf3: error - no JSON at all")


def test_agent_command_reads_secret_from_stdin_and_stops_on_term():
    port = free_port("127.0.0.24")
    p = subprocess.Popen(
        [sys.executable, "-m", "smolnet", "agent", "--bind", "127.0.0.24", "--port", str(port), "--secret-stdin"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        p.stdin.write(SECRET + b"\n")
        p.stdin.close()
        deadline = time.monotonic() + 20
        while True:
            try:
                assert control.call("127.0.0.24", port, SECRET, "ping", timeout=5)["ok"]
                break
            except control.AgentError:
                assert time.monotonic() < deadline and p.poll() is None, p.stderr.read().decode()
                time.sleep(0.2)
        # a peer with a bad length header does not take the process down
        s = socket.create_connection(("127.0.0.24", port), timeout=5)
        wire.client_handshake(s, SECRET)
        s.sendall(struct.pack("!4sBBHIQ", b"SMOL", 1, 1, 0, 1 << 31, 1 << 50))
        s.close()
        assert control.call("127.0.0.24", port, SECRET, "ping", timeout=5)["ok"]
        p.terminate()
        assert p.wait(10) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_agent_command_refuses_short_secret_on_stdin():
    p = subprocess.run(
        [sys.executable, "-m", "smolnet", "agent", "--bind", "127.0.0.24", "--port", "0", "--secret-stdin"],
        input=b"short\n",
        capture_output=True,
        timeout=30,
    )
    assert p.returncode == 2 and b"shorter than" in p.stderr


def test_an_agent_stopped_as_it_starts_stops_cleanly(monkeypatch):
    """stop() right after start_background(): the serving thread must find the agent stopped,
    not its sockets closed under it (CI saw `Bad file descriptor` raised in the agent's threads)."""
    import threading

    raised = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(f"{args.thread.name}: {args.exc_value!r}"))
    for _ in range(40):
        a = Agent("127.0.0.21", 0, SECRET, handshake_timeout=1.0, request_timeout=1.0)
        t = a.start_background()
        a.stop()
        t.join(5)
        assert not t.is_alive()
    time.sleep(0.6)  # the UDP thread's poll: 0.5 s
    assert raised == []


def test_an_agent_on_port_0_picks_again_when_udp_holds_the_kernels_choice(monkeypatch):
    """Port 0: the kernel picks TCP's port and the agent wants UDP on the same number, which
    another process may hold (CI ran 40 agents a test beside a suite full of sockets). Held for
    real on a named port, the agent refuses; on port 0 it picks again."""
    import errno

    import smolnet.agent as agent_mod

    port = free_port("127.0.0.21")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as held:
        held.bind(("127.0.0.21", port))
        with pytest.raises(OSError):
            Agent("127.0.0.21", port, SECRET)

    taken = []

    class Busy(socket.socket):  # the first UDP bind finds its number held
        def bind(self, addr):
            if self.type == socket.SOCK_DGRAM and not taken:
                taken.append(addr[1])
                raise OSError(errno.EADDRINUSE, "Address already in use")
            return super().bind(addr)

    monkeypatch.setattr(agent_mod.socket, "socket", Busy)
    a = Agent("127.0.0.21", 0, SECRET)
    try:
        assert len(taken) == 1 and a.port == a.udp.getsockname()[1] == a.tcp.getsockname()[1]
    finally:
        a.stop()
