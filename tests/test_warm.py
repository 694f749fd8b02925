"""smolnet.warm: ranks forked from a warm server per host, with a fresh process's semantics.

Real processes on this machine: a `local` host goes through smolnet.remote exactly as an SSH
host does (setsid sh -c 'exec ARGV >>LOG'), a group with a log folder starts its local ranks
as Popen children of the client, and the client is also run directly where its exit status is
the point. Each test has its own HOME (the socket folder is ~/.cache/smolcluster/warm),
so servers are never shared with anything else, and every server left is killed at the end.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from smolnet.inventory import Host
from smolnet.launcher import ProcessGroup

SECRET = b"s3cr3t-" + os.urandom(8).hex().encode()
TESTS = str(Path(__file__).parent)
HOST = Host("h", "127.0.0.1", "127.0.0.1", local=True)
WPKG_MAIN = """import os, sys
import wpkg
secret = sys.stdin.readline().strip()
print("version", wpkg.VERSION, "pid", os.getpid(), "ppid", os.getppid(), "secret", len(secret), flush=True)
"""


def wait_for(pred, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def servers(home: Path) -> list[int]:
    """Warm servers whose socket folder is under home."""
    out = []
    for p in Path("/proc").iterdir():
        try:
            cmd = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"smolnet.warm_server" in cmd and any(a.startswith(str(home).encode()) for a in cmd):
            out.append(int(p.name))
    return out


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """A HOME of its own, the tests folder importable, a short idle time; servers killed after."""
    d = tmp_path_factory.mktemp("warm")
    (d / "home").mkdir()
    (d / "logs").mkdir(mode=0o700)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(d / "home"))
        mp.setenv("PYTHONPATH", os.pathsep.join([str(d / "pkgs"), TESTS]))
        mp.setenv("SMOL_WARM_IDLE", "2")
        mp.setenv("SMOL_WARM_TEST", "seen")
        mp.chdir(d)
        yield d
    for pid in servers(d):
        os.kill(pid, signal.SIGKILL)


def client(d: Path, log: str, module: str, *args, preload="torch") -> subprocess.Popen:
    """The client as remote.start runs it: its own session, log on stdout and stderr, secret on stdin."""
    with open(d / "logs" / log, "wb") as out:
        p = subprocess.Popen(
            [sys.executable, "-m", "smolnet.warm", "--preload", preload, "--", module, *args],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    p.stdin.write(SECRET + b"\n")
    p.stdin.close()
    return p


def lines(d: Path, log: str) -> list[str]:
    return (d / "logs" / log).read_text().splitlines()


def started(d: Path, log: str) -> dict:
    """The `warm ... pid ... ppid ...` line of warmchild once it is there."""
    wait_for(lambda: any(ln.startswith("warm ") for ln in lines(d, log)), f"{log} started")
    w = next(ln for ln in lines(d, log) if ln.startswith("warm ")).split()
    return {"warm": w[1] == "True", "pid": int(w[3]), "ppid": int(w[5]), "umask": w[7]}


def test_remote_ranks_start_warm_and_see_what_a_fresh_one_sees(warm):
    """Two ranks through ProcessGroup.start on a host: both forked by one server that had
    imported torch (the second start imports nothing again), each with the secret, log,
    environment, folder and session a fresh one gets; the pid reported is the client's, and
    alive/stop of that pid act on the rank."""
    g = ProcessGroup(SECRET, preload=["torch"])
    go, never = warm / "go", warm / "never"
    try:
        for name, flag in (("a", go), ("b", never)):
            log = str(warm / "logs" / f"{name}.log")
            g.start(name, [sys.executable, "-m", "warmchild", str(flag)], host=HOST, log=log, fresh=True)
        a, b = started(warm, "a.log"), started(warm, "b.log")
        want = f"got {hashlib.sha256(SECRET).hexdigest()}"
        assert lines(warm, "a.log")[:3] == [want, f"env seen cwd {warm}", f"own session True argv ['{go}']"]
        assert a["warm"] and b["warm"] and a["ppid"] == b["ppid"]  # one server, torch imported once
        assert a["umask"] == "0o77"  # remote.start's
        assert b"smolnet.warm_server" in Path(f"/proc/{a['ppid']}/cmdline").read_bytes()
        ca, cb = g.procs["a"][1].pid, g.procs["b"][1].pid
        assert {ca, cb}.isdisjoint({a["pid"], b["pid"], a["ppid"]})
        assert SECRET not in Path(f"/proc/{ca}/cmdline").read_bytes()
        assert g.alive("a") and g.alive("b")
        go.touch()
        wait_for(lambda: not g.alive("a"), "the client exits with its rank")
        assert g.log_tail("a") == "last line" and gone(a["pid"])
        g.stop()  # TERM to b's client: forwarded, the rank dies, then the client
        wait_for(lambda: gone(b["pid"]) and gone(cb), "the stopped rank and its client are gone")
    finally:
        g.stop()


@pytest.mark.parametrize("how,status", [("exit", 3), ("raise", 1), ("TERM", -15), ("INT", -2), ("KILL", -9)])
def test_the_client_ends_as_its_rank_does(warm, how, status):
    """Exit statuses, forwarded signals (the rank dies of it, and so does the client, as a
    shell would see it) and a killed client (its rank is killed with it)."""
    log = f"status-{how}.log"
    arg = {"exit": ["3"], "raise": ["raise"]}.get(how, [])
    p = client(warm, log, "warmchild", str(warm / "never"), *arg)
    rank = started(warm, log)
    mask = os.umask(0o027)
    os.umask(mask)
    assert rank["warm"] and rank["umask"] == oct(mask)  # the client's, not the server's
    if how in ("TERM", "INT", "KILL"):
        p.send_signal(getattr(signal, f"SIG{how}"))
    assert p.wait(timeout=60) == status
    wait_for(lambda: gone(rank["pid"]), "the rank is gone")
    last = {"exit": "exiting 3", "raise": "RuntimeError: boom: no such model", "INT": "KeyboardInterrupt"}
    if how in last:
        assert lines(warm, log)[-1] == last[how]


def _wpkg(d: Path, version: int) -> None:
    pkg = d / "pkgs" / "wpkg"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(f"VERSION = {version}\n")
    (pkg / "__main__.py").write_text(WPKG_MAIN)


def _run_wpkg(d: Path, log: str, preload="wpkg") -> tuple[list[str], int]:
    p = client(d, log, "wpkg", preload=preload)
    assert p.wait(timeout=60) == 0, lines(d, log)
    out = lines(d, log)[-1].split()
    assert out[0] == "version" and out[-1] == str(len(SECRET)), out
    return out, p.pid


def test_updated_code_gets_a_new_server_and_the_old_one_leaves(warm):
    """A changed .py file of a stamped package changes the key: the next start is served by a
    new server that runs the new code; the stale one stops, as an idle one does."""
    _wpkg(warm, 1)
    first, pid1 = _run_wpkg(warm, "v1.log")
    again, _ = _run_wpkg(warm, "v1b.log")
    assert first[1] == again[1] == "1" and first[5] == again[5]  # the same server twice
    assert int(first[3]) != pid1  # forked there, not exec'd here
    old = int(first[5])
    _wpkg(warm, 22)
    second, _ = _run_wpkg(warm, "v2.log")
    assert second[1] == "22" and int(second[5]) != old
    wait_for(lambda: gone(old), "the stale server left", timeout=30)
    wait_for(lambda: gone(int(second[5])), "the idle server left", timeout=30)


def test_without_a_server_the_plain_start_runs(warm, tmp_path, monkeypatch):
    """A preload that fails to import, or a socket folder that is not private: the client
    execs the plain `python -m` (same pid, same output and status), never fails."""
    _wpkg(warm, 1)
    out, pid = _run_wpkg(warm, "broken.log", preload="wpkg,no_such_module_36")
    assert int(out[3]) == pid  # exec'd in place
    assert list((warm / "home" / ".cache" / "smolcluster" / "warm").glob("*.broken"))
    out, pid = _run_wpkg(warm, "broken2.log", preload="wpkg,no_such_module_36")
    assert int(out[3]) == pid
    home = tmp_path / "linked"
    (home / ".cache" / "smolcluster").mkdir(parents=True)
    (home / ".cache" / "smolcluster" / "warm").symlink_to(tmp_path)
    monkeypatch.setenv("HOME", str(home))
    out, pid = _run_wpkg(warm, "linked.log")
    assert int(out[3]) == pid and not list(tmp_path.glob("*.sock"))


def env_hash(env: dict) -> str:
    return hashlib.sha256(json.dumps(sorted(env.items())).encode()).hexdigest()


PLAIN = """import hashlib, json, os
print("environ", hashlib.sha256(json.dumps(sorted(os.environ.items())).encode()).hexdigest())
"""


def test_local_ranks_start_warm_and_report_as_popen_does(warm):
    """A group with a log folder and a preload list starts its local `python -m` ranks through
    the client too (a Popen of it): each rank gets the secret, its log, this process's folder
    and environment (or exactly the env= given), its own session; poll/dead report the rank's
    status (a kill of the client: -9, and the rank goes with it); a `-c` child starts afresh."""
    g = ProcessGroup(SECRET, str(warm / "logs"), preload=["torch"])
    go, never = warm / "local-go", warm / "never"
    given = {**os.environ, "SMOL_WARM_TEST": "given", "OTHER_VAR": "x"}
    try:
        g.start("la", [sys.executable, "-m", "warmchild", str(go)])
        g.start("lbad", [sys.executable, "-m", "warmchild", str(never), "3"])
        g.start("lraises", [sys.executable, "-m", "warmchild", str(never), "raise"])
        g.start("lvictim", [sys.executable, "-m", "warmchild", str(never)])
        g.start("lenv", [sys.executable, "-m", "warmchild", str(go)], env=given)
        g.start("lplain", [sys.executable, "-c", PLAIN])  # not `-m`: started afresh
        a, victim, env = started(warm, "la.log"), started(warm, "lvictim.log"), started(warm, "lenv.log")
        want = f"got {hashlib.sha256(SECRET).hexdigest()}"
        assert lines(warm, "la.log")[:3] == [want, f"env seen cwd {warm}", f"own session True argv ['{go}']"]
        mask = os.umask(0o077)
        os.umask(mask)
        assert a["warm"] and victim["ppid"] == a["ppid"] and a["umask"] == oct(mask)  # this process's
        assert b"smolnet.warm_server" in Path(f"/proc/{a['ppid']}/cmdline").read_bytes()
        wait_for(lambda: g.poll("lplain") == 0, "the plain child ran")
        assert lines(warm, "la.log")[4] == lines(warm, "lplain.log")[-1]  # what a fresh one sees
        assert lines(warm, "lenv.log")[1] == f"env given cwd {warm}" and env["warm"]
        assert lines(warm, "lenv.log")[4] == f"environ {env_hash(given)}"  # exactly env=
        assert env["ppid"] != a["ppid"]  # SMOL_* is read at import: another key, another server
        assert SECRET not in Path(f"/proc/{g.procs['la'].pid}/cmdline").read_bytes()
        wait_for(lambda: {"lbad", "lraises"} <= set(g.dead()), "the failing ranks were noticed")
        assert g.dead() == {"lbad": 3, "lraises": 1}
        assert g.log_tail("lbad") == "exiting 3" and g.log_tail("lraises") == "RuntimeError: boom: no such model"
        assert g.alive("la") and g.alive("lvictim") and g.poll("la") is None
        g.kill("lvictim")
        wait_for(lambda: "lvictim" in g.dead(), "the killed rank was noticed")
        assert g.dead()["lvictim"] == -9  # as Popen says it
        wait_for(lambda: gone(victim["pid"]), "the rank died with its client")
        go.touch()
        assert g.wait(60) == []
        assert g.poll("la") == 0 and g.log_tail("la") == "last line"
    finally:
        g.stop()


CONTROLLER = """
import sys
from smolnet.launcher import ProcessGroup
g = ProcessGroup(b"x", sys.argv[1], preload=["torch"])
g.start("rank", [sys.executable, "-m", "warmchild", "-", "0"])
sys.exit(g.wait(60) or g.poll("rank"))
"""


def test_successive_local_controllers_share_one_server(warm, monkeypatch):
    """Two controllers in a row on this machine (fresh interpreters, as two `smoltrain run
    --local` are): the second one's rank is forked by the server the first one started, so it
    did not import torch again."""
    monkeypatch.setenv("SMOL_WARM_IDLE", "30")  # its own key: no earlier server, none gone between
    ranks = []
    for run in ("one", "two"):
        logs = warm / f"controller-{run}"
        logs.mkdir(mode=0o700)
        subprocess.run([sys.executable, "-c", CONTROLLER, str(logs)], check=True, timeout=120)
        w = next(ln for ln in (logs / "rank.log").read_text().splitlines() if ln.startswith("warm "))
        ranks.append(w.split())
    assert ranks[0][1] == ranks[1][1] == "True" and ranks[0][5] == ranks[1][5]
    assert b"smolnet.warm_server" in Path(f"/proc/{ranks[1][5]}/cmdline").read_bytes()
