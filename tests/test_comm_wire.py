"""The transport's front door: frame parsing under garbage, and the secret check before anything else."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from smolnet import wire
from smoltrain.comm import CommError, make_comm
from smoltrain.comm.exchange import K_DATA
from smoltrain.comm.group import free_port_base
from smoltrain.comm.socket_comm import SocketComm

SECRET = b"wire-test-secret-0123456789"
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _feed(data: bytes) -> socket.socket:
    """A socket that yields exactly `data`, then end of stream."""
    a, b = socket.socketpair()
    a.sendall(data)
    a.close()
    return b


@FUZZ
@given(st.binary(max_size=64))
def test_parse_header_accepts_only_bounded_valid_headers(raw):
    try:
        kind, json_len, payload_len = wire.parse_header(raw, max_payload=1 << 20)
    except wire.WireError:
        return
    assert raw[:4] == wire.FRAME_MAGIC and len(raw) == wire.FRAME_HEADER.size
    assert json_len <= wire.MAX_JSON_BYTES and payload_len <= 1 << 20


@FUZZ
@given(st.binary(max_size=512), st.booleans())
@example(bytes(14), True)  # a whole empty frame: the call returns, and must return what it says
@example(bytes(3) + b"\x00\x00\x00\x02\x00\x00\x00\x00\x00\x00\x00\x01{}z", True)
def test_recv_frame_on_garbage_raises_wire_error_only(junk, with_magic):
    """Garbage raises WireError and nothing else; where the bytes happen to hold a whole frame
    (all-zero lengths are one), what comes back is exactly what those bytes say."""
    data = (wire.FRAME_MAGIC + bytes([wire.FRAME_VERSION]) + junk) if with_magic else junk
    s = _feed(data)
    try:
        kind, meta, payload = wire.recv_frame(s, timeout=2.0, max_payload=1 << 16)
    except wire.WireError:
        return
    finally:
        s.close()
    head = wire.FRAME_HEADER.size
    magic, version, k, _, json_len, n = wire.FRAME_HEADER.unpack(data[:head])
    assert (magic, version) == (wire.FRAME_MAGIC, wire.FRAME_VERSION) and len(data) >= head + json_len + n
    assert kind == k and payload == data[head + json_len : head + json_len + n]
    assert meta == (json.loads(data[head : head + json_len]) if json_len else {})


@FUZZ
@given(st.dictionaries(st.text(max_size=8), st.integers(), max_size=4), st.binary(max_size=300), st.data())
def test_truncated_frames_are_detected(meta, payload, data):
    frame = wire.pack_header(K_DATA, meta, len(payload)) + payload
    cut = data.draw(st.integers(0, len(frame) - 1))
    s = _feed(frame[:cut])
    with pytest.raises(wire.PeerClosed):
        wire.recv_frame(s, timeout=2.0)
    s.close()
    s = _feed(frame)
    kind, got_meta, got = wire.recv_frame(s, timeout=2.0)
    assert (kind, got_meta, got) == (K_DATA, meta, payload)
    s.close()


@pytest.mark.parametrize("json_len,payload_len", [(wire.MAX_JSON_BYTES + 1, 0), (0, 1 << 40), (0, (1 << 64) - 1)])
def test_oversized_lengths_rejected_before_reading_on(json_len, payload_len):
    head = wire.FRAME_HEADER.pack(wire.FRAME_MAGIC, wire.FRAME_VERSION, K_DATA, 0, json_len, payload_len)
    a, b = socket.socketpair()
    a.sendall(head + b"rest")
    with pytest.raises(wire.WireError):
        wire.recv_frame(b, timeout=2.0, max_payload=1 << 20)
    b.settimeout(2.0)
    assert b.recv(16) == b"rest"  # only the fixed header was consumed: nothing was allocated for the rest
    a.close()
    b.close()


def _reader(data: bytes) -> SocketComm:
    """A rank whose link to rank 1 yields exactly `data` (no rendezvous: a world of one, widened)."""
    comm = SocketComm(0, 1, "127.0.0.1", 1, SECRET, timeout=2.0)
    comm.world_size, comm._where = 2, ["here", "there"]
    comm._socks = {1: _feed(data)}
    comm.peer_timeout = 2.0
    return comm


def _p2p_meta(numel: int, dtype=torch.uint8) -> dict:
    return {"dt": str(dtype), "n": numel, "o": "p2p", "q": 1, "i": 0}


@FUZZ
@given(st.binary(max_size=400), st.integers(0, 64))
def test_socketcomm_receive_path_turns_garbage_into_commerror(junk, want):
    comm = _reader(wire.FRAME_MAGIC + bytes([wire.FRAME_VERSION]) + junk)
    with pytest.raises(CommError) as e:
        comm.recv(torch.zeros(want, dtype=torch.uint8), 1)
    assert e.value.peer == 1 and "rank 1 (there)" in str(e.value)
    with pytest.raises(CommError, match="unusable"):  # a failed link is never read again
        comm.recv(torch.zeros(want, dtype=torch.uint8), 1)


def test_socketcomm_accepts_exactly_the_expected_frame():
    comm = _reader(wire.pack_header(K_DATA, _p2p_meta(4), 4) + b"abcd")
    t = torch.zeros(4, dtype=torch.uint8)
    comm.recv(t, 1)
    assert bytes(t.numpy()) == b"abcd"


@pytest.mark.parametrize(
    "frame,why",
    [
        (wire.pack_header(K_DATA, _p2p_meta(4), 8) + b"x" * 8, "8 exceeds 4"),  # never lands in a smaller buffer
        (wire.pack_header(K_DATA, _p2p_meta(4), 2) + b"xy", "expected 4"),
        (wire.pack_header(K_DATA, _p2p_meta(4, torch.float16), 4) + b"abcd", "mismatch"),  # other dtype
        (wire.pack_header(K_DATA, dict(_p2p_meta(4), o="all_gather"), 4) + b"abcd", "mismatch"),
        (wire.pack_header(K_DATA, None, 4) + b"abcd", "mismatch"),
        (wire.pack_header(99, _p2p_meta(4), 4) + b"abcd", "kind 99"),
        (wire.pack_header(K_DATA, _p2p_meta(4), 4) + b"ab", "closed the connection mid-message"),
    ],
)
def test_socketcomm_rejects_bad_frames_naming_the_peer(frame, why):
    comm = _reader(frame)
    with pytest.raises(CommError, match=why) as e:
        comm.recv(torch.zeros(4, dtype=torch.uint8), 1)
    assert e.value.peer == 1


def test_silent_peer_times_out():
    a, b = socket.socketpair()
    comm = SocketComm(0, 1, "127.0.0.1", 1, SECRET, timeout=0.3)
    comm.world_size, comm._where, comm._socks = 2, ["here", "there"], {1: b}
    comm.peer_timeout = 0.3
    t = time.monotonic()
    with pytest.raises(CommError, match="did not respond within 0.3s"):
        comm.recv(torch.zeros(4), 1)
    assert time.monotonic() - t < 2
    a.close()


# ------------------------------------------------------------------- secret
def _rank_in_thread(rank, n, port, secret, out, timeout=15.0):
    def go():
        try:
            out[rank] = make_comm("socket", rank, n, "127.0.0.1", port, secret, timeout=timeout)
        except Exception as e:  # reported through `out`
            out[rank] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def _intruder(port: int, send: bytes) -> bytes:
    """Connect, read the challenge, send `send`, return whatever comes back before the close."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        hello = wire.recv_exact(s, len(wire.MAGIC_AUTH) + wire.NONCE_BYTES, time.monotonic() + 5)
        assert hello.startswith(wire.MAGIC_AUTH)
        try:
            s.sendall(send)
            s.settimeout(5)
            back = b""
            while True:
                chunk = s.recv(4096)
                if not chunk:
                    return back
                back += chunk
        except (ConnectionResetError, BrokenPipeError):
            return b""
    finally:
        s.close()


def test_strangers_are_dropped_before_any_payload_and_the_group_still_forms(caplog):
    port = free_port_base(2)
    out: dict = {}
    t0 = _rank_in_thread(0, 2, port, SECRET, out)
    deadline = time.monotonic() + 10
    while True:  # wait for the rendezvous to listen
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    # a frame claiming a 1 GB payload sent instead of the challenge answer: dropped, nothing echoed
    huge = wire.FRAME_HEADER.pack(wire.FRAME_MAGIC, 1, K_DATA, 0, 0, 1 << 30)
    assert _intruder(port, huge + b"\0" * 100) == b""
    # a wrong answer to the challenge
    assert _intruder(port, b"\0" * (wire.NONCE_BYTES + wire.MAC_BYTES)) == b""
    # a client with the wrong secret learns it was refused, with a clear error naming rank 0
    bad: dict = {}
    _rank_in_thread(1, 2, port, b"not-the-right-secret-at-all", bad).join(20)
    assert isinstance(bad[1], CommError) and bad[1].peer == 0, bad
    assert "secret" in str(bad[1])
    # ... and the real rank 1 still gets in
    t1 = _rank_in_thread(1, 2, port, SECRET, out)
    t0.join(20)
    t1.join(20)
    assert not isinstance(out[0], Exception) and not isinstance(out[1], Exception), out
    results = {}

    def reduce(r):
        x = torch.full((1000,), float(r + 1))
        out[r].all_reduce(x)
        results[r] = x

    ts = [threading.Thread(target=reduce, args=(r,)) for r in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    assert torch.equal(results[0], torch.full((1000,), 3.0)) and torch.equal(results[1], results[0])
    for c in out.values():
        c.close()
    # rejections are logged at most once a second, the ones held back counted in the next line
    assert any("cluster-secret challenge" in r.getMessage() for r in caplog.records)


def test_rendezvous_gives_up_naming_the_missing_rank():
    port = free_port_base(3)
    t = time.monotonic()
    with pytest.raises(CommError) as e:
        make_comm("socket", 0, 3, "127.0.0.1", port, SECRET, timeout=1.0)
    assert time.monotonic() - t < 5
    assert e.value.peer == 1 and "1, 2" in str(e.value)


def test_a_bad_peer_in_send_recv_moves_no_stream():
    """send_recv names a peer that does not exist: one clear CommError before anything moves, and
    the ranks' point-to-point streams stay numbered alike (the next exchange still matches)."""
    port, out = free_port_base(2), {}
    ts = [_rank_in_thread(r, 2, port, SECRET, out) for r in (0, 1)]
    for t in ts:
        t.join(20)
    assert not any(isinstance(c, Exception) for c in out.values()), out
    got = {}
    try:
        with pytest.raises(CommError, match="bad peer rank 7"):
            out[0].send_recv(torch.ones(3), 1, torch.empty(3), 7)

        def swap(r):
            mine = torch.full((5,), float(r + 1))
            got[r] = torch.empty(5)
            out[r].send_recv(mine, 1 - r, got[r], 1 - r)

        ts = [threading.Thread(target=swap, args=(r,)) for r in (0, 1)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(20)
        assert torch.equal(got[0], torch.full((5,), 2.0)) and torch.equal(got[1], torch.full((5,), 1.0)), got
    finally:
        for c in out.values():
            c.close()
