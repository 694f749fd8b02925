"""iperf3 as the throughput backend: one one-off server per test, the receiver's figure.

iperf3 serves one test at a time by design, so the receiving agent starts a fresh
`iperf3 -s -1` on a port it picks for every test. Traps handled here: a warning line
can precede the JSON (parse from the first `{`); the client's `sum_sent` is the
sender's view, so read `sum_received`; an MTU black hole exits 0 with no error and
about nothing received; `-t` is whole seconds (iperf3 3.12 reads 0.5 as 0, which runs forever),
so a fractional duration is rounded up.
"""

from __future__ import annotations

import json
import math
import os
import select
import shutil
import socket
import subprocess
import threading
import time

from smolnet.errors import SmolError


class IperfError(SmolError):
    pass


def available() -> bool:
    return shutil.which("iperf3") is not None


def _free_port(bind: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((bind, 0))
        return s.getsockname()[1]


def start_server(bind: str, lifetime: float) -> tuple[int, subprocess.Popen]:
    """Start a one-test server on a free port; it is killed after `lifetime` seconds at most."""
    if not available():
        raise IperfError("iperf3 is not installed on this host")
    for _ in range(3):
        port = _free_port(bind)
        p = subprocess.Popen(
            ["iperf3", "-s", "-1", "--forceflush", "-B", bind, "-p", str(port)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 5.0
        out = b""
        while time.monotonic() < deadline and p.poll() is None:
            r, _, _ = select.select([p.stdout], [], [], 0.1)
            if r:
                chunk = os.read(p.stdout.fileno(), 4096)
                out += chunk
                if b"listening" in out:
                    threading.Thread(target=_reap, args=(p, lifetime), daemon=True).start()
                    return port, p
        p.kill()
        p.wait(2)
    raise IperfError(f"iperf3 server did not start: {out.decode(errors='replace').strip()[-200:]}")


def _reap(p: subprocess.Popen, lifetime: float) -> None:
    """Drain its output (so it never blocks on a full pipe) and kill it when overdue."""
    deadline = time.monotonic() + lifetime
    while p.poll() is None and time.monotonic() < deadline:
        r, _, _ = select.select([p.stdout], [], [], 0.5)
        if r and not os.read(p.stdout.fileno(), 65536):
            break
    if p.poll() is None:
        p.kill()
    try:
        p.wait(5)
    except subprocess.TimeoutExpired:
        pass


def parse_json(stdout: str) -> dict:
    """The iperf3 -J document, skipping any text before the first '{'."""
    i = stdout.find("{")
    if i < 0:
        raise IperfError(f"iperf3 printed no JSON: {stdout.strip()[-200:]}")
    try:
        doc = json.loads(stdout[i:])
    except ValueError as e:
        raise IperfError(f"iperf3 printed bad JSON: {e}") from None
    if not isinstance(doc, dict):
        raise IperfError("iperf3 JSON is not an object")
    return doc


def summarize(doc: dict) -> dict:
    """Receiver-side goodput, retransmits and sender CPU from a client's -J document."""
    if doc.get("error"):
        raise IperfError(f"iperf3: {doc['error']}")
    end = doc.get("end") or {}
    recv = end.get("sum_received") or {}
    sent = end.get("sum_sent") or {}
    cpu = end.get("cpu_utilization_percent") or {}
    connected = bool((doc.get("start") or {}).get("connected"))
    nbytes = int(recv.get("bytes") or 0)
    seconds = float(recv.get("seconds") or 0.0)
    host_cpu = cpu.get("host_total")
    return {
        "method": "iperf3",
        "throughput_mbit": float(recv.get("bits_per_second") or 0.0) / 1e6,
        "bytes_received": nbytes,
        "bytes_sent": int(sent.get("bytes") or 0),
        "seconds": seconds,
        "connected": connected,
        "retransmits": sent.get("retransmits"),
        "sender_cpu_percent": host_cpu,
        # iperf3 before 3.16 runs every stream in one thread: ~100 % of one core is the limit
        "cpu_limited": host_cpu is not None and host_cpu >= 90.0,
    }


def run_client(dst: str, port: int, duration: float, omit: float, streams: int, source: str | None = None) -> dict:
    if not available():
        raise IperfError("iperf3 is not installed on this host")
    argv = [
        "iperf3",
        "-c",
        dst,
        "-p",
        str(port),
        "-J",
        "-t",
        str(max(1, math.ceil(duration))),  # iperf3 reads whole seconds: -t 0.5 would be 0, "forever"
        "-O",
        f"{omit:g}",
        "-P",
        str(int(streams)),
    ]
    if source:
        argv += ["-B", source]
    try:
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=duration + omit + 30)
    except subprocess.TimeoutExpired:
        raise IperfError(f"iperf3 client to {dst}:{port} timed out") from None
    return summarize(parse_json(p.stdout.decode(errors="replace")))
