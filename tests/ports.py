"""Ports chosen free at run time, so tests never collide with each other or with a real agent."""

from __future__ import annotations

import socket


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
    for _ in range(tries):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((addrs[0], 0))
            port = s.getsockname()[1]
        if all(_bindable(a, port, k) for a in addrs for k in (socket.SOCK_STREAM, socket.SOCK_DGRAM)):
            return port
    raise RuntimeError(f"no port free on all of {addrs} after {tries} tries")
