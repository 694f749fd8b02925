"""One probe process per host, kept open across calibration rounds.

Why: starting the probe costs a host an SSH session, a Python and torch's import (about
1.4 CPU seconds: 9 s of wall time on the sim's 0.15-core Pi, 15 s of every round over the
four home hosts), and none of it is measured. The process (`python -m
smoltrain.calibration.probe --serve`) imports once and runs one whole probe for each line
the controller sends, so the rounds still go host by host (a, b, c, a, b, c) while each
host pays the start once. An idle session waits on its input and takes no CPU. The process
is forked from the host's warm server of training workers (calibration.cluster.probe_argv), so
the import it pays is the one the runs after it would pay.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import tempfile
import time

from smolnet.inventory import Host
from smolnet.remote import RemoteError, SSHRemote, connect, shell_word


def _last_line(err: bytes, rc: int | None) -> str:
    lines = [ln for ln in err.decode(errors="replace").strip().splitlines() if ln.strip()]
    return lines[-1] if lines else f"probe exited {rc}"


class ProbeSession:
    """`argv` started on `h` with a pipe both ways; `probe()` asks for one probe and returns
    its JSON document, or raises RemoteError naming the host and the cause."""

    def __init__(self, h: Host, argv: list[str], timeout: float):
        self.name, self.timeout = h.name, timeout
        self.remote = connect(h)
        self.proc = self.chan = None
        try:
            if isinstance(self.remote, SSHRemote):
                self.chan = self.remote.client.get_transport().open_session(timeout=timeout)
                self.chan.exec_command(" ".join(shell_word(a) for a in argv))
            else:
                local = [os.path.expanduser(a) if a.startswith("~/") else a for a in argv]
                self.err = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close()); a file: never fills
                self.proc = subprocess.Popen(local, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err)
        except Exception as e:
            self.close()
            raise RemoteError(h.name, f"could not start the probe: {e}") from None
        self.buf = bytearray()

    def probe(self) -> dict:
        try:
            self._send(b"probe\n")
        except OSError:
            pass  # it exited already: the read below says why
        line = self._readline(time.monotonic() + self.timeout)
        try:
            return json.loads(line)
        except ValueError:
            raise RemoteError(self.name, f"probe printed no JSON: {line[-120:]!r}") from None

    def _send(self, data: bytes) -> None:
        if self.chan is not None:
            self.chan.sendall(data)
        else:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()

    def _readline(self, deadline: float) -> str:
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RemoteError(self.name, f"timed out after {self.timeout:g}s waiting for the probe")
            data = self._recv(min(left, 1.0))
            if data == b"":  # the process ended without a line: its last words say why
                raise RemoteError(self.name, self._exit_reason())
            if data:
                self.buf += data
        line, _, rest = bytes(self.buf).partition(b"\n")
        self.buf = bytearray(rest)
        return line.decode(errors="replace").strip()

    def _recv(self, wait: float) -> bytes | None:
        """Some output, b"" at its end, None when nothing came within `wait` seconds."""
        if self.chan is not None:
            if self.chan.recv_ready():
                return self.chan.recv(65536)
            if self.chan.exit_status_ready() and not self.chan.recv_ready():
                return b""
            time.sleep(min(wait, 0.01))
            return None
        ready, _, _ = select.select([self.proc.stdout], [], [], wait)
        return os.read(self.proc.stdout.fileno(), 65536) if ready else None

    def _exit_reason(self) -> str:
        if self.chan is not None:
            err = bytearray()
            while self.chan.recv_stderr_ready():
                err += self.chan.recv_stderr(65536)
            return _last_line(bytes(err), self.chan.recv_exit_status())
        rc = self.proc.wait(timeout=10)
        self.err.seek(0)
        return _last_line(self.err.read(), rc)

    def close(self) -> None:
        """End the process (its input closes, so it exits) and the connection."""
        try:
            if self.chan is not None:
                self.chan.shutdown_write()  # its input ends: the probe exits
                deadline = time.monotonic() + 10
                while not self.chan.exit_status_ready() and time.monotonic() < deadline:
                    time.sleep(0.01)
                self.chan.close()
            if self.proc is not None:
                self.proc.stdin.close()
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
                self.proc.stdout.close()
                self.err.close()
        except Exception:  # closing a session that failed: nothing more to say
            pass
        finally:
            self.remote.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
