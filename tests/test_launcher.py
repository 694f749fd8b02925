"""smolnet.launcher.ProcessGroup with real local processes: secret on stdin, logs, liveness, stop."""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

import pytest

from smolnet.launcher import ProcessGroup

SECRET = b"s3cr3t-" + os.urandom(8).hex().encode()

# Reads the secret from stdin, says it got it (the hash, never the secret), then waits for a file.
WAITER = """
import hashlib, os, sys, time
s = sys.stdin.readline().strip().encode()
print("got", hashlib.sha256(s).hexdigest(), flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
print("last line", flush=True)
"""


def wait_for(pred, what):
    deadline = time.monotonic() + 60
    while not pred():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


@pytest.fixture
def group(tmp_path):
    g = ProcessGroup(SECRET, str(tmp_path / "logs"))
    os.mkdir(g.log_dir)
    yield g
    g.stop()


def test_secret_on_stdin_not_argv_and_logged(group, tmp_path):
    go = tmp_path / "go"
    group.start("a", [sys.executable, "-c", WAITER, str(go)])
    pid = group.procs["a"].pid
    log = Path(group.log_dir, "a.log")
    want = f"got {hashlib.sha256(SECRET).hexdigest()}"
    wait_for(lambda: want in log.read_text(), "the child read the secret")
    assert SECRET not in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert group.poll("a") is None and group.alive("a") and group.dead() == {}
    assert group.log_tail("a") == want
    go.touch()
    assert group.wait(60) == []
    assert group.poll("a") == 0 and group.dead() == {}  # a clean exit is not a death
    assert group.log_tail("a") == "last line"
    assert group.log_lines("a", 2) == [want, "last line"]


def test_dying_process_is_noticed(group, tmp_path):
    group.start("ok", [sys.executable, "-c", WAITER, str(tmp_path / "never")])
    group.start("bad", [sys.executable, "-c", "import sys; print('boom: no such model'); sys.exit(3)"])
    wait_for(lambda: group.dead(), "the failing child was noticed")
    assert group.dead() == {"bad": 3}
    assert group.log_tail("bad") == "boom: no such model"
    assert group.alive("ok")


def test_stop_kills_all(group, tmp_path):
    for n in ("x", "y", "z"):
        group.start(n, [sys.executable, "-c", WAITER, str(tmp_path / "never")])
    pids = [p.pid for p in group.procs.values()]
    group.stop()
    assert all(group.poll(n) is not None for n in ("x", "y", "z"))
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # reaped, not a zombie
    group.stop()  # twice is harmless


def test_missing_log_and_unknown_name(group):
    assert group.log_tail("nobody") == ""
    assert group.dead() == {}


def test_detached_start_through_remote(tmp_path):
    """Without a log dir a local host goes through smolnet.remote: detached, log on the host, stop."""
    from smolnet.inventory import Host

    g = ProcessGroup(SECRET)
    log = tmp_path / "agent.log"
    log.write_text("old error: stale\n")
    try:
        g.start(
            "h",
            [sys.executable, "-c", WAITER, str(tmp_path / "never")],
            host=Host("h", "127.0.0.1", "127.0.0.1", local=True),
            log=str(log),
            fresh=True,
        )
        want = f"got {hashlib.sha256(SECRET).hexdigest()}"
        wait_for(lambda: g.log_tail("h") == want, "the detached process read the secret")
        assert "stale" not in log.read_text()  # fresh: the old log is gone
        pid = g.procs["h"][1].pid
        assert SECRET not in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert g.alive("h") and g.poll("h") is None and g.dead() == {}
    finally:
        g.stop()
    wait_for(
        lambda: not os.path.exists(f"/proc/{pid}") or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2],
        "the detached process was stopped",
    )


def test_remote_logs_are_named_for_their_run(tmp_path):
    """Two runs' ranks on a host of the same name (sim hosts share this filesystem) log to
    different files, so a rank that dies silently is never quoted with the last run's error."""
    from smolnet.launcher import remote_log

    a, b = tmp_path / "smoltrain-infer-abc", tmp_path / "smoltrain-infer-xyz"
    assert remote_log(str(a), "laptop") == "~/.cache/smolcluster/logs/smoltrain-infer-abc-laptop.log"
    assert remote_log(str(a) + "/", "laptop") == remote_log(str(a), "laptop")
    assert remote_log(str(b), "laptop") != remote_log(str(a), "laptop") != remote_log(str(a), "pi5")
