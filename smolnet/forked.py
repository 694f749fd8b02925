"""Local processes forked from a server that imported their heavy modules once.

A fresh interpreter that imports torch spends ~1.5 s of CPU before it does anything; a
`--local 4` run paid that five times. ProcessGroup(preload=[...]) starts its local
`python -m MODULE ARGS` children from multiprocessing's forkserver instead: the server (a
fresh interpreter of its own, started once per controller) imports the preload list, and
each child is a fork of it that runs MODULE as `__main__` with its own session, log, secret
on standard input and environment, exactly as the interpreter it replaces would. A child is
still its own process: it dies alone, and its exit status (negative: the signal) is reported
as Popen reports it. smolnet names no module here: the caller says what to preload.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import subprocess
import sys
from multiprocessing import forkserver, popen_forkserver, reduction, spawn, util
from multiprocessing.context import set_spawning_popen

_ctx = None


def context(preload: list[str]):
    """The forkserver context; the first caller's preload list is the server's (it starts once)."""
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(list(preload))
    return _ctx


class Forked:
    """A forked child with the part of subprocess.Popen's interface ProcessGroup uses."""

    def __init__(self, proc):
        self.proc, self.pid, self.args = proc, proc.pid, None

    @property
    def returncode(self) -> int | None:
        return self.proc.exitcode

    def poll(self) -> int | None:
        return self.proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
        return self.proc.exitcode

    def kill(self) -> None:
        if self.proc.exitcode is None:
            self.proc.kill()

    def send_signal(self, sig: int) -> None:
        if self.proc.exitcode is None:
            os.kill(self.pid, sig)


class _Popen(popen_forkserver.Popen):
    """multiprocessing's forkserver start, less the parent's __main__: multiprocessing re-imports
    the parent's main script in every child, which would rerun a script without a __main__ guard
    (or fail on `python - < script`); a child here runs its own module and needs none of it."""

    def _launch(self, process_obj):
        prep = spawn.get_preparation_data(process_obj._name)
        prep.pop("init_main_from_path", None)
        prep.pop("init_main_from_name", None)
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        self.sentinel, w = forkserver.connect_to_new_process(self._fds)
        _parent_w = os.dup(w)  # the child's sentinel of this process, as multiprocessing keeps it
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


def start(module: str, args: list[str], log: str, secret: bytes, preload: list[str]) -> Forked:
    """Run `python -m module *args` as a forked child: stdout and stderr to the (open, truncated)
    file log, secret + newline on its standard input, this process's environment and cwd."""
    args = (module, list(args), log, secret, dict(os.environ))
    proc = context(preload).Process(target=_child, args=args, daemon=True)
    proc._Popen = _Popen  # an instance attribute: Process.start calls self._Popen(self)
    proc.start()
    return Forked(proc)


def _child(module: str, args: list[str], log: str, secret: bytes, env: dict) -> None:
    """In the fork: what a fresh `python -m module` started by Popen would see, then run it."""
    import runpy

    os.setsid()  # its own session, as start_new_session=True gives (Ctrl-C is the controller's)
    if sys.stdin is not None:
        sys.stdin.close()  # multiprocessing's /dev/null (fd 0): the secret goes there instead
    r, w = os.pipe()
    os.write(w, secret + b"\n")  # one short line: the pipe holds it without a reader
    os.close(w)
    if r != 0:
        os.dup2(r, 0)
        os.close(r)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
    for std in (1, 2):
        if fd != std:
            os.dup2(fd, std)
    if fd > 2:
        os.close(fd)
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)))
    sys.stderr = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(2, "w", closefd=False)), errors="backslashreplace", line_buffering=True
    )
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [module, *args]  # run_module sets [0] to the module's file, as -m does
    runpy.run_module(module, run_name="__main__", alter_sys=True)
