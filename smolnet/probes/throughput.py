"""The built-in TCP throughput probe: several streams, large buffers, receiver-side count.

The receiving agent counts bytes as they arrive and samples its own counter after the
warm-up and again `duration` later, so the figure is receiver-side goodput with the
slow-start excluded. The sending agent reports how much CPU it burnt: a Python sender
that saturates its core measures itself, not the link (`probe-limited`).
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
import uuid

from smolnet import agent_client as control
from smolnet import wire

CHUNK = 1 << 20  # send/recv buffer: large, so syscalls are not the limit
# Socket buffers are left to the kernel's autotuning: setting SO_RCVBUF would cap the window.
MAX_STREAMS = 16
MAX_DURATION = 120.0
MAX_OMIT = 10.0
IDLE_TIMEOUT = 5.0  # a data stream silent this long is finished
START_TIMEOUT = 10.0  # first byte must arrive within this after the session opens


TCP_INFO_BYTES_RECEIVED = 128  # offset of u64 tcpi_bytes_received in struct tcp_info (Linux 4.1+)


def _kernel_received(sock: socket.socket) -> int | None:
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, "TCP_INFO", 11), 256)
    except OSError:
        return None
    if len(info) < TCP_INFO_BYTES_RECEIVED + 8:
        return None
    return struct.unpack_from("=Q", info, TCP_INFO_BYTES_RECEIVED)[0]


def _bounded(value, lo, hi, what):
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number") from None
    if not lo <= v <= hi:
        raise ValueError(f"{what} {v:g} outside {lo:g}..{hi:g}")
    return v


class SinkSession:
    """One receiver-side measurement: N data streams feed one set of counters."""

    def __init__(self, streams: int, omit: float, duration: float):
        self.id = uuid.uuid4().hex
        self.streams = streams
        self.omit = omit
        self.duration = duration
        self.counts: list[list[int]] = []
        self.socks: list[socket.socket] = []
        self.kernel: dict[int, int] = {}
        self.lock = threading.Lock()
        self.first_byte = threading.Event()
        self.done = threading.Event()
        self.created = time.monotonic()

    def total(self) -> int:
        """Bytes received so far: the kernel's count when it has one, else what we have read.

        The kernel's tcpi_bytes_received does not lag when this process is short of CPU
        (data waiting in socket buffers at the window edges would otherwise be misplaced)."""
        with self.lock:
            for i, sock in enumerate(self.socks):
                k = _kernel_received(sock)
                if k is not None:
                    self.kernel[i] = k  # a stream closed since keeps its last count
            if self.socks and len(self.kernel) == len(self.socks):
                return sum(self.kernel.values())
            return sum(c[0] for c in self.counts)

    def attach(self, sock: socket.socket) -> list[int] | None:
        with self.lock:
            if len(self.counts) >= self.streams or self.done.is_set():
                return None
            c = [0]
            self.counts.append(c)
            self.socks.append(sock)
            return c

    def feed(self, sock: socket.socket, counter: list[int]) -> None:
        """Drain one data stream into the counter until EOF, idle or session end."""
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        sock.settimeout(0.5)
        last = time.monotonic()
        limit = self.created + START_TIMEOUT + self.omit + self.duration + 30
        while not self.done.is_set() and time.monotonic() < limit:
            try:
                k = sock.recv_into(view)
            except TimeoutError:
                if time.monotonic() - last > IDLE_TIMEOUT:
                    return
                continue
            if k == 0:
                return
            counter[0] += k
            last = time.monotonic()
            if not self.first_byte.is_set():
                self.first_byte.set()

    def measure(self) -> dict:
        """Wait for the first byte, skip the warm-up, count `duration` seconds."""
        try:
            # the sender stops after omit + duration: no byte by then means none is coming
            if not self.first_byte.wait(min(START_TIMEOUT, self.omit + self.duration + 1.0)):
                return {"bytes": 0, "seconds": 0.0, "total_bytes": 0, "first_byte": False}
            time.sleep(self.omit)
            b0, t0 = self.total(), time.monotonic()
            time.sleep(self.duration)
            b1, t1 = self.total(), time.monotonic()
            return {
                "bytes": b1 - b0,
                "seconds": t1 - t0,
                "total_bytes": b1,
                "first_byte": True,
                "streams_attached": len(self.counts),
            }
        finally:
            self.done.set()


class SinkRegistry:
    """Sessions awaiting their data streams, looked up by id from the data connections."""

    def __init__(self):
        self._sessions: dict[str, SinkSession] = {}
        self._lock = threading.Lock()

    def open(self, params: dict) -> SinkSession:
        streams = int(_bounded(params.get("streams", 4), 1, MAX_STREAMS, "streams"))
        omit = _bounded(params.get("omit", 1.0), 0, MAX_OMIT, "omit")
        duration = _bounded(params.get("duration", 3.0), 0.1, MAX_DURATION, "duration")
        s = SinkSession(streams, omit, duration)
        with self._lock:
            now = time.monotonic()
            for k in [k for k, v in self._sessions.items() if v.done.is_set() or now - v.created > 300]:
                del self._sessions[k]
            if len(self._sessions) >= 32:
                raise ValueError("too many open sink sessions")
            self._sessions[s.id] = s
        return s

    def get(self, sid) -> SinkSession | None:
        with self._lock:
            return self._sessions.get(str(sid))

    def close(self, s: SinkSession) -> None:
        with self._lock:
            self._sessions.pop(s.id, None)


def send_builtin(
    dst: str, port: int, secret: bytes, duration: float, omit: float, streams: int, source: str | None = None
) -> dict:
    """Run on the sending agent: stream to the agent at dst, return its receiver-side count."""
    streams = int(_bounded(streams, 1, MAX_STREAMS, "streams"))
    duration = _bounded(duration, 0.1, MAX_DURATION, "duration")
    omit = _bounded(omit, 0, MAX_OMIT, "omit")
    ctl = control.open_agent(dst, port, secret, timeout=5.0, source=source)
    socks: list[socket.socket] = []
    try:
        control.send_request(ctl, "sink_open", streams=streams, omit=omit, duration=duration)
        sid = control.read_reply(ctl, 10.0, where=f"sink at {dst}")["session"]
        for _ in range(streams):
            conn = control.open_agent(dst, port, secret, timeout=5.0, source=source)
            socks.append(conn.sock)  # after the MACed request: raw bytes, only counted
            control.send_request(conn, "sink_data", session=sid)
        payload = memoryview(os.urandom(CHUNK))
        sent = [0] * streams
        stop_at = time.monotonic() + omit + duration + 0.5
        cpu0, wall0 = time.process_time(), time.monotonic()

        def pump(i: int) -> None:
            s = socks[i]
            s.settimeout(0.5)
            while time.monotonic() < stop_at:
                try:
                    sent[i] += s.send(payload)
                except TimeoutError:
                    continue
                except OSError:
                    return

        threads = [threading.Thread(target=pump, args=(i,), daemon=True) for i in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(omit + duration + 5)
        cpu = (time.process_time() - cpu0) / max(1e-6, time.monotonic() - wall0)
        for s in socks:
            s.close()
        socks.clear()
        res = control.read_reply(ctl, 15.0, where=f"sink at {dst}")
    finally:
        for s in socks:
            s.close()
        ctl.close()
    seconds = float(res.get("seconds") or 0.0)
    nbytes = int(res.get("bytes") or 0)
    ncpu = os.cpu_count() or 1
    return {
        "method": "builtin",
        "throughput_mbit": nbytes * 8 / seconds / 1e6 if seconds > 0 else 0.0,
        "bytes_received": nbytes,
        "bytes_sent": sum(sent),
        "seconds": seconds,
        "connected": True,
        "retransmits": None,
        "sender_cpu_cores": round(cpu, 3),
        # the GIL holds a Python sender to about one core, whatever the stream count
        "cpu_limited": cpu >= 0.85 * min(1.0, ncpu),
    }


def serve_sink_data(sock: socket.socket, params: dict, sinks: SinkRegistry) -> None:
    s = sinks.get(params.get("session"))
    if s is None:
        raise wire.WireError("unknown sink session")
    counter = s.attach(sock)
    if counter is None:
        raise wire.WireError("sink session is full or finished")
    s.feed(sock, counter)
