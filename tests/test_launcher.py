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


def test_preloaded_children_are_forked_and_see_what_a_fresh_one_sees(tmp_path, monkeypatch):
    """ProcessGroup(preload=...) forks `python -m` children from a server (smolnet.forked): each
    gets the secret on stdin, this process's environment and folder, its own session and log,
    and its exit status, kill and death are reported as a fresh child's are."""
    from smolnet.forked import Forked

    g = ProcessGroup(SECRET, str(tmp_path / "logs"), preload=["forkchild"])
    os.mkdir(g.log_dir)
    monkeypatch.setenv("SMOL_FORK_TEST", "seen")
    monkeypatch.chdir(tmp_path)
    go, never = tmp_path / "go", tmp_path / "never"
    try:
        g.start("a", [sys.executable, "-m", "forkchild", str(go)])
        g.start("bad", [sys.executable, "-m", "forkchild", str(never), "3"])
        g.start("raises", [sys.executable, "-m", "forkchild", str(never), "raise"])
        g.start("victim", [sys.executable, "-m", "forkchild", str(never)])
        g.start("plain", [sys.executable, "-c", WAITER, str(go)])  # not `-m`: started afresh
        assert all(isinstance(g.procs[n], Forked) for n in ("a", "bad", "raises", "victim"))
        assert not isinstance(g.procs["plain"], Forked)
        want = f"got {hashlib.sha256(SECRET).hexdigest()}"
        wait_for(lambda: g.log_tail("a").startswith("colorsys"), "the forked child started")
        assert g.log_lines("a", 4)[:3] == [want, f"env seen cwd {tmp_path}", f"own session True argv ['{go}']"]
        assert SECRET not in Path(f"/proc/{g.procs['a'].pid}/cmdline").read_bytes()
        wait_for(lambda: {"bad", "raises"} <= set(g.dead()), "the failing children were noticed")
        assert g.dead() == {"bad": 3, "raises": 1}
        assert g.log_tail("bad") == "exiting 3"
        assert g.log_tail("raises") == "RuntimeError: boom: no such model"
        assert g.alive("a") and g.alive("victim") and g.poll("a") is None
        g.kill("victim")
        wait_for(lambda: "victim" in g.dead(), "the killed child was noticed")
        assert g.dead()["victim"] == -9  # as Popen says it
        go.touch()
        assert g.wait(60) == []
        assert g.poll("a") == 0 and g.log_tail("a") == "last line"
        pids = [p.pid for p in g.procs.values()]
    finally:
        g.stop()
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_the_server_imports_the_preload_list_once(tmp_path):
    """In a fresh interpreter (this one's server may already run, with another list), a forked
    child finds the preload list already imported; and it never re-runs the parent's main
    script (multiprocessing's habit: here an unguarded `python - < script`)."""
    script = f"""
import os, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from smolnet.launcher import ProcessGroup
g = ProcessGroup(b"x", {str(tmp_path)!r}, preload=["colorsys"])
g.start("c", [sys.executable, "-m", "forkchild", "go", "0"])
print(g.wait(60), g.poll("c"), g.log_lines("c", 2)[0])
"""
    import subprocess

    p = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=120)
    assert p.stdout.strip() == "[] 0 colorsys already imported True", p.stdout + p.stderr
