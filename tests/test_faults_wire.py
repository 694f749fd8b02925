"""Issue 15, "frames after the handshake are authenticated": a session key from the handshake
and a sequence number in a MAC over every frame header of the rank mesh; `full` adds payloads."""

from __future__ import annotations

import os
import socket
import threading

import pytest
import torch

from smolnet import wire
from smoltrain.comm import CommError, make_comm
from smoltrain.comm.exchange import K_DATA
from smoltrain.comm.group import free_port_base
from smoltrain.comm.socket_comm import SocketComm

SECRET = b"test-secret-0123456789abcdef"


def _pair(full=False):
    key = os.urandom(32)
    return wire.Session(key, True, full), wire.Session(key, False, full)


def test_session_rejects_injected_replayed_reordered_and_reflected_frames():
    a, b = _pair()
    h1, h2 = wire.pack_header(K_DATA, {"i": 1}, 0), wire.pack_header(K_DATA, {"i": 2}, 0)
    t1, t2 = a.seal(h1), a.seal(h2)
    with pytest.raises(wire.WireError, match="MAC"):
        b.check(h2, t2)  # reordered: frame 2 where frame 1 belongs
    b.check(h1, t1)
    with pytest.raises(wire.WireError, match="MAC"):
        b.check(h1, t1)  # replayed
    with pytest.raises(wire.WireError, match="MAC"):
        b.check(wire.pack_header(K_DATA, {"i": 9}, 0), t2)  # injected / altered
    b.check(h2, t2)
    with pytest.raises(wire.WireError, match="MAC"):
        a.check(h1, t1)  # reflected back to its sender


def _reader(data: bytes, ses: wire.Session) -> SocketComm:
    a, b = socket.socketpair()
    a.sendall(data)
    a.shutdown(socket.SHUT_WR)
    comm = SocketComm(0, 1, "127.0.0.1", 1, SECRET, timeout=2.0)
    comm.world_size, comm._where, comm._socks, comm._sess = 2, ["here", "there"], {1: b}, {1: ses}
    comm._keep = a
    return comm


META = {"dt": "torch.uint8", "n": 4, "o": "p2p", "q": 1, "i": 0}


def test_mesh_link_refuses_a_frame_without_a_valid_mac():
    tx, rx = _pair()
    head = wire.pack_header(K_DATA, META, 4)
    good = _reader(head + tx.seal(head) + b"abcd", rx)
    t = torch.zeros(4, dtype=torch.uint8)
    good.recv(t, 1)
    assert bytes(t.numpy()) == b"abcd"
    _, rx2 = _pair()
    forged = _reader(head + b"\0" * wire.TAG_BYTES + b"abcd", rx2)  # a stranger's frame: no key
    with pytest.raises(CommError, match="MAC") as e:
        forged.recv(torch.zeros(4, dtype=torch.uint8), 1)
    assert e.value.peer == 1


def test_full_integrity_catches_an_altered_payload():
    tx, rx = _pair(full=True)
    head = wire.pack_header(K_DATA, META, 4)
    frame = head + tx.seal(head) + b"abcd"
    tag = tx.seal_payload(b"abcd")
    with pytest.raises(CommError, match="payload failed its MAC"):
        _reader(frame[:-4] + b"abce" + tag, rx).recv(torch.zeros(4, dtype=torch.uint8), 1)


@pytest.mark.parametrize("integrity", ["header", "full"])
def test_real_group_with_authenticated_frames(integrity):
    n, port = 3, free_port_base(3)
    out: dict = {}

    def go(r):
        try:
            c = make_comm("socket", r, n, "127.0.0.1", port, SECRET, timeout=20.0, integrity=integrity)
            x = torch.full((300_000,), float(r + 1))
            c.all_reduce(x)
            c.barrier()
            out[r] = (x, c._sess[(r + 1) % n].tx_seq)
            c.close()
        except Exception as e:  # reported through out
            out[r] = e

    ts = [threading.Thread(target=go, args=(r,)) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    for r in range(n):
        assert not isinstance(out[r], Exception), out[r]
        assert torch.equal(out[r][0], torch.full((300_000,), 6.0)) and out[r][1] > 0


def test_control_channel_frames_are_authenticated():
    """A frame spliced into a worker's control connection is refused, not queued."""
    from smoltrain.run.channel import ControlServer

    srv = ControlServer("127.0.0.1", SECRET, lambda hello: (_ for _ in ()).throw(ValueError("no")))
    try:
        s, key = wire.connect("127.0.0.1", srv.port, SECRET, keyed=True)
        head = wire.pack_header(1, {"type": "hello", "rank": 0}, 0)
        s.sendall(head + b"\0" * wire.TAG_BYTES)  # a forged MAC: as if injected by a third party
        with pytest.raises((wire.PeerClosed, ConnectionError, OSError)):
            wire.recv_frame(s, timeout=5.0)
        s.close()
        assert srv.messages.get(timeout=5)[1]["message"].count("MAC") == 1
    finally:
        srv.close()


def test_a_read_without_deadline_outlives_a_timeout_another_thread_set():
    """A control connection is read by one thread (no deadline: it waits for the next message)
    and written by another (a send with a 30 s timeout). A socket's timeout is one setting, so
    the send's can land between the reader's `settimeout(None)` and its wait; the reader must
    go on waiting rather than report silence. Here every settimeout sets 0.05 s, as if the
    other thread always won, and the frame comes after 0.3 s."""

    class Racing(socket.socket):
        def settimeout(self, value):
            super().settimeout(0.05)

    a, b = socket.socketpair()
    reader = Racing(fileno=a.detach())
    timer = threading.Timer(0.3, lambda: wire.send_frame(b, 1, {"type": "late"}))
    timer.start()
    try:
        _, msg, _ = wire.recv_frame(reader, timeout=None, max_payload=0)
        assert msg == {"type": "late"}
        with pytest.raises(TimeoutError):  # a real deadline still ends the wait
            wire.recv_frame(reader, timeout=0.2, max_payload=0)
    finally:
        timer.join()
        reader.close()
        b.close()
