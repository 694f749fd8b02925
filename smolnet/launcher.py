"""One way to start a group of processes (training ranks, inference ranks, bench ranks, agents).

Each process is named and gets the cluster secret on standard input, never in argv
(where `ps` would show it to every user of the host). With a log directory, processes
on this machine run as children writing `<log_dir>/<name>.log`; every other process,
and every process of a group without a log directory, starts detached through
smolnet.remote with its log on its host. The group knows which children died, reads
the last log line for error messages, and stops everything best-effort, because a
failure while cleaning up must never hide the failure that made us clean up.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

from smolnet.inventory import Host
from smolnet.remote import LOG_HOME, RemoteError, connect

LOCAL = subprocess.Popen  # a child on this machine (else (Remote, Proc))


class ProcessGroup:
    def __init__(self, secret: bytes, log_dir: str | None = None, preload: list[str] | None = None):
        """preload: modules a `python -m` child imports anyway; such children, here or on another
        host, then start through smolnet.warm: forked from a server per host, user and key that
        imported them once and stays warm between runs (successive controllers share it)."""
        self.secret, self.log_dir, self.preload = secret, log_dir, preload
        self.procs: dict[str, object] = {}  # name -> Popen (local child) or (Remote, Proc)
        self.logs: dict[str, str] = {}  # name -> log path (on this machine or on the process's host)
        self.stopped: set[str] = set()
        self.lock = threading.Lock()

    def start(
        self, name: str, argv: list[str], host: Host | None = None, log: str | None = None, env=None, fresh=False
    ) -> None:
        """Start argv as `name`: a child here (host None or local, with a log_dir) or on host via remote.

        log: the log path on the host (remote starts; `~/` is its user's home, see remote_log);
        fresh: start it empty so an old log's errors are not read as new ones. A remote start that
        fails closes its connection and raises.
        """
        if host is None or (host.local and self.log_dir is not None):
            path = os.path.join(self.log_dir, f"{name}.log")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            handle: object = self._popen(self._warm(argv), fd, env)
        else:
            remote = connect(host)
            try:
                started = remote.start(self._warm(argv), stdin=self.secret + b"\n", log=log, fresh=fresh)
                handle, path = (remote, started), started.log
            except RemoteError:
                remote.close()
                raise
        with self.lock:
            self.procs[name] = handle
            self.logs[name] = path

    def _warm(self, argv: list[str]) -> list[str]:
        """`python -m MODULE ARGS` as `python -m smolnet.warm --preload LIST -- MODULE ARGS` when the
        group has a preload list (the client hands its whole environment to the rank); else argv."""
        if self.preload and len(argv) > 2 and argv[1] == "-m":
            from smolnet import warm

            return warm.command(argv[0], self.preload, *argv[2:])
        return argv

    def _popen(self, argv: list[str], fd: int, env) -> subprocess.Popen:
        """A fresh local child writing to fd, the secret on its standard input."""
        with open(fd, "wb") as out:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                [os.path.expanduser(a) if a.startswith("~/") else a for a in argv],  # as the host's shell would
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )
        proc.stdin.write(self.secret + b"\n")
        proc.stdin.close()
        return proc

    def names(self) -> list[str]:
        with self.lock:
            return list(self.procs)

    def poll(self, name: str) -> int | None:
        """A local child's exit status, None while it runs (or for a remote process: ask alive())."""
        proc = self.procs.get(name)
        return proc.poll() if isinstance(proc, LOCAL) else None

    def dead(self) -> dict[str, int]:
        """Local children that exited with a non-zero status, in start order: name -> status."""
        out = {}
        for name, proc in list(self.procs.items()):
            if isinstance(proc, LOCAL) and proc.poll() not in (None, 0):
                out[name] = proc.returncode
        return out

    def alive(self, name: str) -> bool:
        """Whether name still runs (a remote check is one round trip; it may raise RemoteError)."""
        proc = self.procs[name]
        if isinstance(proc, LOCAL):
            return proc.poll() is None
        remote, rproc = proc
        return remote.alive(rproc)

    def log_lines(self, name: str, n: int = 1) -> list[str]:
        """The last n non-empty lines of name's log; a remote read may raise RemoteError."""
        proc = self.procs.get(name)
        if isinstance(proc, tuple):
            remote, rproc = proc
            out = remote.run(["tail", "-n", str(n), rproc.log], timeout=5.0).stdout
        else:
            path = self.logs.get(name) or os.path.join(self.log_dir or "", f"{name}.log")
            try:
                out = Path(path).read_text(errors="replace")
            except OSError:
                return []
        return [ln.strip() for ln in out.splitlines() if ln.strip()][-n:]

    def log_text(self, name: str) -> str:
        """A local child's whole log ('' when there is none)."""
        try:
            return Path(self.logs[name]).read_text(errors="replace")
        except (KeyError, OSError):
            return ""

    def log_tail(self, name: str) -> str:
        """The last log line (200 characters at most) for an error message; '' if unreadable."""
        try:
            lines = self.log_lines(name, 1)
        except Exception:
            return ""
        return lines[-1][:200] if lines else ""

    def kill(self, name: str) -> None:
        proc = self.procs.get(name)
        if isinstance(proc, LOCAL) and proc.poll() is None:
            proc.kill()

    def wait(self, timeout: float) -> list[str]:
        """Wait up to timeout (together) for the local children to exit; the names still running."""
        deadline = time.monotonic() + timeout
        left = []
        for name, proc in list(self.procs.items()):
            if isinstance(proc, LOCAL):
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    left.append(name)
        return left

    def stop(self, spare=()) -> None:
        """Kill the local children, stop the remote processes (but those in spare) and close.

        Best effort and in parallel: errors are swallowed, so the failure that led here is the
        one reported. Stopping twice is harmless.
        """
        with self.lock:
            items = [(n, p) for n, p in self.procs.items() if n not in self.stopped]
            self.stopped.update(n for n, _ in items)

        def one(name: str, proc) -> None:
            try:
                if isinstance(proc, LOCAL):
                    if proc.poll() is None:
                        proc.kill()
                    proc.wait(timeout=10)
                    return
                remote, rproc = proc
                try:
                    if name not in spare:
                        remote.stop(rproc)
                finally:
                    remote.close()
            except Exception:  # best effort: never mask the real failure
                pass

        threads = [threading.Thread(target=one, args=item, daemon=True) for item in items]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30.0
        for t in threads:
            while t.is_alive() and time.monotonic() < deadline:
                t.join(0.2)  # short slices, so Ctrl-C gets through


def remote_log(log_dir: str, name: str) -> str:
    """A process's log on its host, named for this run (its local log folder's name): sim hosts
    share one filesystem and real ones keep old logs, so a fixed path per host name would hand
    an earlier run's last line to this run's error message. In the user's private log folder
    (remote.LOG_HOME), never a predictable name in a shared /tmp."""
    return f"{LOG_HOME}/{os.path.basename(os.path.normpath(log_dir))}-{name}.log"
