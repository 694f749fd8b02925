"""One way to run things on a host: a command, a background process, a small file.

SSH (paramiko) for remote hosts, a local subprocess for `ansible_connection: local`.
Every call has a timeout and every failure names the host and the cause, because
"it hung" and "it failed" are the two least useful things a cluster tool can say.
"""

from __future__ import annotations

import errno
import os
import select
import shlex
import socket
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from smolnet.errors import SmolError
from smolnet.inventory import Host


class RemoteError(SmolError):
    """`host: cause` in one line."""

    def __init__(self, host: str, cause: str):
        super().__init__(f"{host}: {cause}")
        self.host = host
        self.cause = cause


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str


@dataclass
class Proc:
    """A background process started on a host."""

    host: str
    pid: int
    log: str | None = None


# where processes started on a host log: private to the user (0700, theirs, not a link), never
# a predictable name in a shared /tmp that another user could plant first
LOG_HOME = "~/.cache/smolcluster/logs"


def shell_word(arg) -> str:
    """One argument for the host's shell: quoted, except that a leading `~/` is the home of the
    user the command runs as, expanded there (an inventory's `smol_python: ~/.local/...`)."""
    arg = str(arg)
    return '"$HOME"/' + shlex.quote(arg[2:]) if arg.startswith("~/") else shlex.quote(arg)


def _cmdline(argv: Sequence[str] | str) -> str:
    return argv if isinstance(argv, str) else " ".join(shell_word(a) for a in argv)


def _expand(argv: Sequence[str]) -> list[str]:
    """A local argv without a shell: `~/` expanded as the host's shell would."""
    return [os.path.expanduser(a) if isinstance(a, str) and a.startswith("~/") else a for a in argv]


class Remote(ABC):
    """Base class: run, start, stop, alive, put_file. Use connect(host)."""

    def __init__(self, host: Host):
        self.host = host

    @abstractmethod
    def run(self, argv, timeout: float = 30.0, stdin: bytes | None = None, check: bool = False) -> Result:
        """Run argv (a list, or a shell string) to completion."""

    def start(
        self, argv, stdin: bytes | None = None, log: str | None = None, timeout: float = 15.0, fresh: bool = False
    ) -> Proc:
        """Start argv detached (own session), feed stdin, return its pid and its log's path there.

        log: a file in a folder the host's shell makes private (0700, owned by the user and not a
        link) or refuses; `~/` is that user's home. fresh: start the log empty."""
        # `exec` keeps the pid; stdin stays the channel/pipe so the secret can be fed.
        if log:
            d = shell_word(os.path.dirname(log))
            script = (
                f'umask 077; d={d}; mkdir -p "$d" && [ -d "$d" ] && [ ! -L "$d" ] && [ -O "$d" ] && chmod 700 "$d" '
                f'|| {{ echo "SMOLERR:log folder $d is not a private folder of this user"; exit 1; }}; '
                f"f={shell_word(log)}; "
            )
            to = '"$f"'
        else:
            script, to = "f=/dev/null; ", "/dev/null"
        redirect = ">" if fresh and log else ">>"
        script += f'echo "SMOLPID:$$:$f"; exec {_cmdline(argv)} {redirect}{to} 2>&1'
        # -w: setsid forks (sshd's child leads its session) and would exit at once; sshd then
        # ends the session, and stdin it had not yet written into the pipe was lost (a rank read
        # an empty secret 1 time in 6 once the host's shell started in ~10 ms). Waiting keeps it.
        out = self._spawn(["setsid", "-w", "sh", "-c", script], stdin or b"", timeout)
        for line in out.splitlines():
            if line.startswith("SMOLPID:"):
                _, pid, path = line.split(":", 2)
                return Proc(self.host.name, int(pid), path)
            if line.startswith("SMOLERR:"):
                raise RemoteError(self.host.name, line.removeprefix("SMOLERR:"))
        raise RemoteError(self.host.name, f"could not start {_cmdline(argv)[:80]}: no pid reported")

    @abstractmethod
    def _spawn(self, argv, stdin: bytes, timeout: float) -> str:
        """Start argv detached, feed stdin, return its first output line."""

    def alive(self, proc: Proc, timeout: float = 10.0) -> bool:
        return self.run(["kill", "-0", str(proc.pid)], timeout=timeout).rc == 0

    def stop(self, proc: Proc, timeout: float = 5.0) -> None:
        """TERM, wait, then KILL; quiet if it is already gone."""
        self.run(["kill", "-TERM", str(proc.pid)], timeout=timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive(proc, timeout=timeout):
                return
            time.sleep(0.1)
        self.run(["kill", "-KILL", str(proc.pid)], timeout=timeout)

    def put_file(self, path: str, data: bytes, mode: int = 0o600, timeout: float = 30.0) -> None:
        """Write atomically (temp file + rename) so a reader never sees half a file."""
        d = os.path.dirname(path) or "."
        # mktemp: a fresh name made with O_EXCL, never a predictable one written through a link
        script = (
            f"umask 077 && mkdir -p {shell_word(d)} && t=$(mktemp {shell_word(d + '/.smoltmp.XXXXXX')}) && "
            f'{{ cat > "$t" && chmod {mode:o} "$t" && mv -f "$t" {shell_word(path)} || {{ rm -f "$t"; exit 1; }}; }}'
        )
        self.run(["sh", "-c", script], timeout=timeout, stdin=data, check=True)

    def close(self) -> None:  # noqa: B027 (a local runner holds nothing to close)
        """Release the connection; a no-op where there is none."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class LocalRemote(Remote):
    def run(self, argv, timeout: float = 30.0, stdin: bytes | None = None, check: bool = False) -> Result:
        shell = isinstance(argv, str)
        try:
            p = subprocess.run(
                ["sh", "-c", argv] if shell else _expand(argv), input=stdin or b"", capture_output=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            raise RemoteError(self.host.name, f"timed out after {timeout:g}s running {_cmdline(argv)[:80]}") from None
        except FileNotFoundError as e:
            raise RemoteError(self.host.name, f"command not found: {e.filename}") from None
        res = Result(p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace"))
        if check and res.rc != 0:
            raise RemoteError(self.host.name, f"{_cmdline(argv)[:80]} exited {res.rc}: {res.stderr.strip()[-200:]}")
        return res

    def _spawn(self, argv, stdin: bytes, timeout: float) -> str:
        p = subprocess.Popen(
            list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True
        )
        try:
            p.stdin.write(stdin)
            p.stdin.close()
            ready, _, _ = select.select([p.stdout], [], [], timeout)
            if not ready:
                raise RemoteError(self.host.name, f"timed out starting {_cmdline(argv)[:80]}")
            line = p.stdout.readline().decode(errors="replace")
            p.stdout.close()
        except (BrokenPipeError, OSError) as e:
            raise RemoteError(self.host.name, f"could not start process: {e}") from None
        return line


def _classify(host: Host, exc: BaseException) -> RemoteError:
    import paramiko

    where = f"{host.address}:{host.port}"
    if isinstance(exc, paramiko.BadHostKeyException):
        return RemoteError(
            host.name, f"host key changed for {where} (possible reinstall or man-in-the-middle; fix known_hosts)"
        )
    if isinstance(exc, paramiko.AuthenticationException):
        return RemoteError(host.name, f"auth failed for {host.user or 'default user'}@{where}")
    if isinstance(exc, paramiko.SSHException) and "not found in known_hosts" in str(exc):
        return RemoteError(host.name, f"unknown host key for {where} (add it to known_hosts)")
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return RemoteError(host.name, f"timed out connecting to {where}")
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        errs = {e.errno for e in exc.errors.values() if isinstance(e, OSError)}
        if errs & {errno.ECONNREFUSED}:
            return RemoteError(host.name, f"connection refused by {where}")
        return RemoteError(host.name, f"unreachable: {where}")
    if isinstance(exc, ConnectionRefusedError):
        return RemoteError(host.name, f"connection refused by {where}")
    if isinstance(exc, OSError) and exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN):
        return RemoteError(host.name, f"unreachable: {where}")
    if isinstance(exc, OSError):
        return RemoteError(host.name, f"cannot connect to {where}: {exc.strerror or exc}")
    return RemoteError(host.name, f"ssh error with {where}: {exc}")


class SSHRemote(Remote):
    def __init__(self, host: Host, connect_timeout: float = 10.0):
        super().__init__(host)
        import paramiko

        self.started: list = []  # channels of processes started here (_spawn)
        client = paramiko.SSHClient()
        if host.host_key_checking:
            try:
                client.load_system_host_keys()
            except OSError:
                pass
            if host.known_hosts_file and os.path.exists(host.known_hosts_file):
                client.load_host_keys(host.known_hosts_file)
            client.set_missing_host_key_policy(paramiko.RejectPolicy())
        else:
            client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
        try:
            client.connect(
                host.address,
                port=host.port,
                username=host.user or "root",
                key_filename=host.key_file,
                timeout=connect_timeout,
                banner_timeout=connect_timeout,
                auth_timeout=connect_timeout,
                allow_agent=host.key_file is None,
                look_for_keys=host.key_file is None,
            )
        except Exception as e:  # every paramiko failure becomes one named line
            client.close()
            raise _classify(host, e) from None
        self.client = client

    def _exec(self, cmd: str, stdin: bytes, timeout: float):
        try:
            chan = self.client.get_transport().open_session(timeout=timeout)
            chan.settimeout(timeout)
            chan.exec_command(cmd)
            if stdin:
                chan.sendall(stdin)
            chan.shutdown_write()
        except Exception as e:
            raise RemoteError(self.host.name, f"ssh channel failed: {e}") from None
        return chan

    def run(self, argv, timeout: float = 30.0, stdin: bytes | None = None, check: bool = False) -> Result:
        cmd = _cmdline(argv)
        chan = self._exec(cmd, stdin or b"", timeout)
        out, err = bytearray(), bytearray()
        deadline = time.monotonic() + timeout
        try:
            while True:
                if time.monotonic() > deadline:
                    raise RemoteError(self.host.name, f"timed out after {timeout:g}s running {cmd[:80]}")
                if chan.recv_ready():
                    out += chan.recv(65536)
                elif chan.recv_stderr_ready():
                    err += chan.recv_stderr(65536)
                elif chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                    break
                else:
                    time.sleep(0.005)
            rc = chan.recv_exit_status()
        finally:
            chan.close()
        res = Result(rc, out.decode(errors="replace"), err.decode(errors="replace"))
        if check and rc != 0:
            raise RemoteError(self.host.name, f"{cmd[:80]} exited {rc}: {res.stderr.strip()[-200:]}")
        return res

    def _spawn(self, argv, stdin: bytes, timeout: float) -> str:
        """The channel stays open until close() (see start: sshd still delivers our stdin)."""
        chan = self._exec(_cmdline(argv), stdin, timeout)
        buf = bytearray()
        try:
            while b"\n" not in buf:
                data = chan.recv(4096)
                if not data:
                    break
                buf += data
        except TimeoutError:
            chan.close()
            raise RemoteError(self.host.name, f"timed out starting {_cmdline(argv)[:80]}") from None
        self.started.append(chan)
        return buf.decode(errors="replace")

    def close(self) -> None:
        for chan in self.started:
            chan.close()
        self.client.close()


def connect(host: Host, timeout: float = 10.0) -> Remote:
    """A Remote for host: local subprocesses or an SSH session."""
    if host.local:
        return LocalRemote(host)
    return SSHRemote(host, connect_timeout=timeout)
