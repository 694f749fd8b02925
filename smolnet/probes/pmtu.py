"""Effective path MTU, per direction: don't-fragment UDP probes that the peer must answer.

A jumbo mismatch on one L2 segment sends no ICMP error back (switches and NICs drop
oversize frames silently), so the kernel's PMTU cache, tracepath and IP_MTU all keep
saying 9000. Only probes the far end acknowledges tell the truth (RFC 4821). With
IP_PMTUDISC_PROBE the kernel sets DF but ignores its cached PMTU, so every size we ask
for really goes on the wire (capped by the local interface MTU).

Probe: MAGIC, nonce, size, HMAC tag, zero padding up to `size` bytes of IP packet.
Ack:   ACK_MAGIC, nonce, size, HMAC tag. Unauthenticated probes get no ack, and the
prober ignores acks whose tag does not verify.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time

IP_MTU_DISCOVER = 10  # Linux <linux/in.h>; Python's socket module lacks these
IP_PMTUDISC_PROBE = 3
IP_MTU = 14
IP_UDP_OVERHEAD = 28  # IPv4 20 + UDP 8
MIN_PROBE = 576  # every IPv4 path must carry this
MAX_PROBE = 65535
PROBE_MAGIC = b"SMTU"
ACK_MAGIC = b"SMTA"
NONCE = 16
TAG = 16
HEAD = struct.Struct("!4s16sI16s")  # magic, nonce, size, tag
MIN_WAIT = 0.05


def _tag(secret: bytes, role: bytes, nonce: bytes, size: int) -> bytes:
    return hmac.new(secret, role + nonce + struct.pack("!I", size), hashlib.sha256).digest()[:TAG]


def make_probe(secret: bytes, size: int, nonce: bytes | None = None) -> tuple[bytes, bytes]:
    nonce = nonce or os.urandom(NONCE)
    head = HEAD.pack(PROBE_MAGIC, nonce, size, _tag(secret, b"probe", nonce, size))
    return nonce, head + bytes(size - IP_UDP_OVERHEAD - len(head))


def answer_probe(secret: bytes, datagram: bytes | memoryview) -> bytes | None:
    """The ack for a valid probe, or None (wrong size, bad tag, not ours)."""
    if len(datagram) < HEAD.size:
        return None
    magic, nonce, size, tag = HEAD.unpack(bytes(datagram[: HEAD.size]))
    if magic != PROBE_MAGIC or size != len(datagram) + IP_UDP_OVERHEAD:
        return None
    if not hmac.compare_digest(tag, _tag(secret, b"probe", nonce, size)):
        return None
    return HEAD.pack(ACK_MAGIC, nonce, size, _tag(secret, b"ack", nonce, size))


def _check_ack(secret: bytes, data: bytes, nonce: bytes, size: int) -> bool:
    if len(data) != HEAD.size:
        return False
    magic, n, s, tag = HEAD.unpack(data)
    return (
        magic == ACK_MAGIC and n == nonce and s == size and hmac.compare_digest(tag, _tag(secret, b"ack", nonce, size))
    )


def _try(sock: socket.socket, secret: bytes, size: int, tries: int, wait: float) -> bool:
    for _ in range(tries):
        nonce, pkt = make_probe(secret, size)
        try:
            sock.send(pkt)
        except OSError:  # EMSGSIZE: larger than our own interface allows
            return False
        deadline = time.monotonic() + wait
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            sock.settimeout(left)
            try:
                data = sock.recv(256)
            except TimeoutError:
                break
            except OSError:  # ICMP port unreachable etc.
                break
            if _check_ack(secret, data, nonce, size):
                return True
    return False


def measure_pmtu(
    dst: str,
    port: int,
    secret: bytes,
    source: str | None = None,
    tries: int = 3,
    wait: float = 0.2,
    resolution: int = 1,
) -> dict:
    """Run on the sending agent: largest IPv4 packet (IP header included) dst acknowledges."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        if source:
            sock.bind((source, 0))
        sock.connect((dst, port))
        sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_PROBE)
        try:
            local = sock.getsockopt(socket.IPPROTO_IP, IP_MTU)
        except OSError:
            local = 1500
        hi = max(MIN_PROBE, min(int(local), MAX_PROBE))
        t0 = time.monotonic()
        if not _try(sock, secret, MIN_PROBE, tries, wait):
            return {
                "mtu_effective": None,
                "local_mtu": local,
                "probes": 1,
                "error": f"no acknowledgement from {dst}:{port} even for {MIN_PROBE}-byte packets",
            }
        # a lost probe costs `wait`; scale it to the path (ten round trips, 50 ms at least)
        wait = min(wait, max(MIN_WAIT, 10 * (time.monotonic() - t0)))
        if _try(sock, secret, hi, tries, wait):
            return {"mtu_effective": hi, "local_mtu": local, "probes": 2, "error": None}
        good, bad = MIN_PROBE, hi
        probes = 2
        while bad - good > resolution:
            mid = (good + bad) // 2
            probes += 1
            if _try(sock, secret, mid, tries, wait):
                good = mid
            else:
                bad = mid
        return {"mtu_effective": good, "local_mtu": local, "probes": probes, "error": None, "wait_s": round(wait, 3)}
    finally:
        sock.close()
