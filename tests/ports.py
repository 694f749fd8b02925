"""Ports chosen free at run time, so tests never collide with each other or with a real agent.

They come from below the kernel's ephemeral range and smoltrain's own group ports: a port the
kernel hands out (an outgoing connection, or gloo's listener bound to port 0) is never one a test
picked, so a test that probes its own server's port cannot reach another test's gloo listener and
break its rendezvous (CI: a torch group's full mesh failed with "Connection closed by peer" while
the suite ran, the listener at a port in the ephemeral range).
"""

from __future__ import annotations

import os
import random
import socket

from smoltrain.comm.group import _ephemeral_low


def _bindable(addr: str, port: int, kind: int) -> bool:
    with socket.socket(socket.AF_INET, kind) as s:
        try:
            s.bind((addr, port))
        except OSError:
            return False
    return True


def free_port(*addrs: str, tries: int = 200) -> int:
    """A port that is free for TCP and UDP on every address given (default 127.0.0.1).

    The agent listens on TCP and UDP at the same port, and a loopback cluster puts several
    hosts on one port at different 127.0.0.x addresses, so all of them must be free.
    """
    addrs = addrs or ("127.0.0.1",)
    rng = random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "little"))
    # below the ranges smoltrain's group bases (20000 up) and the kernel's ephemeral ports take
    low, top = (10000, 20000) if _ephemeral_low() > 21000 else (60000, 65535)
    for _ in range(tries):
        port = rng.randrange(low, top)
        if all(_bindable(a, port, k) for a in addrs for k in (socket.SOCK_STREAM, socket.SOCK_DGRAM)):
            return port
    raise RuntimeError(f"no port free on all of {addrs} after {tries} tries")
