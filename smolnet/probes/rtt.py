"""Round-trip time of a small TCP message, the way an RPC or a pipeline hop sees it.

One message in flight, TCP_NODELAY on both ends, warm-up discarded, full round trip
(not half, unlike sockperf's default), percentiles over at least 200 samples.
"""

from __future__ import annotations

import socket
import time

from smolnet import agent_client as control
from smolnet import wire

MIN_SAMPLES = 200
MAX_SAMPLES = 100_000
MAX_MESSAGE = 64 * 1024
WARMUP = 20
ECHO_READ_TIMEOUT = 10.0


def percentiles(samples_us: list[float]) -> dict:
    s = sorted(samples_us)
    if not s:
        return {"min": None, "p50": None, "p90": None, "p99": None, "max": None}

    def pct(p: float) -> float:
        # nearest-rank: a value that was actually observed
        k = max(0, min(len(s) - 1, int(round(p / 100 * len(s) + 0.5)) - 1))
        return round(s[k], 1)

    return {
        "min": round(s[0], 1),
        "p50": pct(50),
        "p90": pct(90),
        "p99": pct(99),
        "max": round(s[-1], 1),
        "samples": len(s),
    }


def measure_rtt(
    dst: str, port: int, secret: bytes, count: int = 300, size: int = 1, source: str | None = None, timeout: float = 5.0
) -> dict:
    """Run on the pinging agent: `count` round trips to the echo of the agent at dst."""
    count = max(MIN_SAMPLES, min(int(count), MAX_SAMPLES))
    size = max(1, min(int(size), MAX_MESSAGE))
    conn = control.open_agent(dst, port, secret, timeout=timeout, source=source)
    sock = conn.sock  # after the MACed request the echo bytes are the measurement, not commands
    try:
        control.send_request(conn, "echo", size=size)
        msg = b"\x01" * size
        buf = memoryview(bytearray(size))
        samples = []
        for i in range(WARMUP + count):
            t0 = time.perf_counter_ns()
            wire.send_all(sock, msg, time.monotonic() + timeout)
            wire.recv_exact_into(sock, buf, time.monotonic() + timeout)
            dt = time.perf_counter_ns() - t0
            if i >= WARMUP:
                samples.append(dt / 1000.0)
    finally:
        sock.close()
    return percentiles(samples)


def serve_echo(sock: socket.socket, params: dict) -> None:
    """Echo fixed-size messages back until the peer closes or goes quiet."""
    size = int(params.get("size", 1))
    if not 1 <= size <= MAX_MESSAGE:
        raise wire.WireError(f"echo size {size} outside 1..{MAX_MESSAGE}")
    buf = memoryview(bytearray(size))
    for _ in range(MAX_SAMPLES + WARMUP + 10):
        try:
            wire.recv_exact_into(sock, buf, time.monotonic() + ECHO_READ_TIMEOUT)
        except wire.PeerClosed:
            return
        wire.send_all(sock, buf, time.monotonic() + ECHO_READ_TIMEOUT)
