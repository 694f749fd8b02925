"""Issue 15, defect 8: an agent started for a matrix holds a lease and exits when it lapses."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

from smolnet import agent_client as control
from smolnet.agent import Agent
from smolnet.inventory import Host
from smolnet.matrix import AgentPool

SECRET = b"test-secret-0123456789abcdef"


def test_agent_stops_when_its_lease_is_not_renewed_and_strangers_cannot_renew_it():
    a = Agent("127.0.0.25", 0, SECRET, lease=1.5)
    t = a.start_background()
    for _ in range(4):  # renewed by the controller: alive past its lease
        time.sleep(0.5)
        assert control.call(a.bind, a.port, SECRET, "lease", timeout=5.0)["ok"]
    assert t.is_alive()
    stop = threading.Event()

    def poke():  # unauthenticated pokes do not renew
        while not stop.is_set():
            try:
                socket.create_connection((a.bind, a.port), timeout=1).close()
            except OSError:
                pass
            time.sleep(0.1)

    threading.Thread(target=poke, daemon=True).start()
    try:
        t.join(20)
        assert not t.is_alive(), "agent outlived its lease"
    finally:
        stop.set()
        a.stop()


def test_agent_command_with_a_lease_exits_by_itself():
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "smolnet",
            "agent",
            "--bind",
            "127.0.0.26",
            "--port",
            "0",
            "--secret-stdin",
            "--lease",
            "1",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    p.stdin.write(SECRET + b"\n")
    p.stdin.close()
    try:
        assert p.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            p.kill()


def test_matrix_starts_agents_with_a_lease():
    h = Host(name="x", address="127.0.0.1", cluster_ip="127.0.0.27")
    argv = AgentPool(SECRET)._argv(h)
    assert "--lease" in argv and float(argv[argv.index("--lease") + 1]) > 0
