"""The warm server behind smolnet.warm: imports a preload list once, then forks ranks.

Started by a client (`python -m smolnet.warm_server FOLDER KEY LOCKFD PRELOAD MODULE STAMP`),
detached, holding the key's lock (no second server for the key while it lives). Single-threaded
and it never runs a torch op, as multiprocessing's forkserver: a fork of it is safe. Per
connection it receives the client's standard descriptors, argv, folder and environment, forks
a child that becomes what `python -m MODULE ARGS` would have been, sends `P<pid>` and later
`X<status>` (negative: the signal), forwards the client's `S<signal>` lines, and kills the child
when the connection closes first (the client was killed). It exits when idle (no child, no
request for SMOL_WARM_IDLE seconds, default 600) and stops taking requests once its code stamp
is stale. It runs nothing but `python -m` of the module asked.
"""

from __future__ import annotations

import fcntl
import importlib
import json
import os
import selectors
import signal
import socket
import sys
import time
import traceback

from smolnet.warm import code_stamp, in_folder, stamped_names

STAMP_EVERY_S = 3.0


def _child(fds: list[int], req: dict, close: list) -> None:
    """In the fork: what a fresh `python -m module` started by the client's shell would see.
    close: the server's sockets, selector and lock (objects with close(), or descriptors)."""
    import io
    import runpy

    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        for c in close:
            c.close() if hasattr(c, "close") else os.close(c)
        for std, fd in enumerate(fds):
            os.dup2(fd, std)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(req["cwd"])
        os.umask(int(req.get("umask", 0o022)))
        os.environ.clear()
        os.environ.update(req["env"])
        sys.path[0] = os.getcwd()  # as `python -m` puts its folder first
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
        sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), write_through=unbuffered)
        sys.stderr = io.TextIOWrapper(
            io.BufferedWriter(io.FileIO(2, "w", closefd=False)), errors="backslashreplace", line_buffering=True
        )
        sys.argv = [req["module"], *req["args"]]  # run_module sets [0] to the module's file, as -m does
        try:
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = _exit_code(e.code)
        except KeyboardInterrupt:
            sys.excepthook(*sys.exc_info())
            code = -signal.SIGINT  # Python dies of SIGINT after printing it
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        import threading

        threading._shutdown()  # a fresh interpreter waits for its threads, then runs atexit
        import atexit

        atexit._run_exitfuncs()
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:
                pass
    except BaseException:  # the start itself failed (a folder gone): said where the rank logs
        traceback.print_exc()
        code = 1
    finally:
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code if code >= 0 else 1)


def _exit_code(code) -> int:
    """SystemExit's argument as the interpreter turns it into a status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _read_request(conn: socket.socket) -> tuple[list[int], dict]:
    conn.settimeout(10.0)
    head, fds, _, _ = socket.recv_fds(conn, 4, 3)
    try:
        while len(head) < 4:
            more = conn.recv(4 - len(head))
            if not more:
                raise ConnectionError("short header")
            head += more
        n, body = int.from_bytes(head, "big"), b""
        while len(body) < n:
            more = conn.recv(min(65536, n - len(body)))
            if not more:
                raise ConnectionError("short request")
            body += more
        if len(fds) != 3:
            raise ConnectionError("expected three descriptors")
        req = json.loads(body)
        if not isinstance(req.get("module"), str) or not isinstance(req.get("args"), list):
            raise ConnectionError("bad request")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    conn.settimeout(None)
    return fds, req


class Server:
    def __init__(self, folder: str, key: str, lock_fd: int, preload: list[str], module: str, stamp: str):
        self.path = os.path.join(folder, f"{key}.sock")
        self.lock_fd, self.preload, self.module, self.stamp = lock_fd, preload, module, stamp
        self.idle_s = float(os.environ.get("SMOL_WARM_IDLE", "600"))
        self.sel = selectors.DefaultSelector()
        self.children: dict[int, socket.socket] = {}  # pid -> its client's connection
        self.conns: dict[socket.socket, int] = {}  # connection -> its child's pid
        self.last = time.monotonic()
        self.listener: socket.socket | None = None
        self.ino = None

    def listen(self) -> None:
        try:
            os.unlink(self.path)  # a dead server's (we hold the lock: no live one owns it)
        except FileNotFoundError:
            pass
        old = os.umask(0o077)
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            in_folder(self.path, s.bind)
        finally:
            os.umask(old)
        s.listen(64)
        self.listener, self.ino = s, os.stat(self.path).st_ino
        self.sel.register(s, selectors.EVENT_READ, "accept")

    def stop_listening(self) -> None:
        """Take no more requests: the socket goes (if still ours) and so does the lock."""
        if self.listener is None:
            return
        self.sel.unregister(self.listener)
        self.listener.close()
        self.listener = None
        try:
            if os.stat(self.path).st_ino == self.ino:
                os.unlink(self.path)
        except OSError:
            pass
        os.close(self.lock_fd)
        self.lock_fd = -1

    def accept(self, wake: list) -> None:
        conn, _ = self.listener.accept()
        self.last = time.monotonic()
        try:
            fds, req = _read_request(conn)
        except (OSError, ConnectionError, ValueError):
            conn.close()
            return
        close = [self.sel, self.listener, conn, *wake, *self.conns]
        close += [self.lock_fd] if self.lock_fd >= 0 else []
        pid = os.fork()
        if pid == 0:
            _child(fds, req, close)
        for fd in fds:
            os.close(fd)
        self.children[pid], self.conns[conn] = conn, pid
        self.sel.register(conn, selectors.EVENT_READ, "client")
        try:
            conn.sendall(b"P%d\n" % pid)
        except OSError:
            self.lost(conn)

    def lost(self, conn: socket.socket) -> None:
        """The client is gone (killed): so goes its rank, as a fresh one dies with its pid."""
        pid = self.conns.get(conn)
        if pid in self.children:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.drop(conn)

    def drop(self, conn: socket.socket) -> None:
        if conn in self.conns:
            self.sel.unregister(conn)
            del self.conns[conn]
        conn.close()

    def client(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(256)
        except OSError:
            data = b""
        if not data:
            self.lost(conn)
            return
        pid = self.conns[conn]
        for line in data.split(b"\n"):  # S<signal> lines: a few bytes each, never split in practice
            if line.startswith(b"S") and line[1:].isdigit() and pid in self.children:
                try:
                    os.kill(pid, int(line[1:]))
                except OSError:
                    pass

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            self.last = time.monotonic()
            if conn is not None:
                try:
                    conn.sendall(b"X%d\n" % os.waitstatus_to_exitcode(status))
                except OSError:
                    pass
                self.drop(conn)

    def serve(self) -> None:
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        signal.set_wakeup_fd(wake_w.fileno())
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.sel.register(wake_r, selectors.EVENT_READ, "wake")
        checked = time.monotonic()
        while True:
            for k, _ in self.sel.select(timeout=STAMP_EVERY_S / 2):
                if k.data == "accept" and self.listener is not None:
                    self.accept([wake_r, wake_w])
                elif k.data == "wake":
                    try:
                        wake_r.recv(4096)
                    except BlockingIOError:
                        pass
                elif k.data == "client":
                    self.client(k.fileobj)
            self.reap()
            now = time.monotonic()
            if self.listener is not None and now - checked > STAMP_EVERY_S:
                checked = now
                if code_stamp(stamped_names(self.preload, self.module)) != self.stamp:
                    self.stop_listening()  # an updated checkout: its clients start a new server
            if not self.children and (self.listener is None or now - self.last > self.idle_s):
                self.stop_listening()
                return


def _sweep(folder: str, mine: str) -> None:
    """Remove other keys' files whose server is gone (their lock is free): old checkouts' keys."""
    for name in os.listdir(folder):
        k, ext = os.path.splitext(name)
        if ext != ".lock" or k == mine:
            continue
        try:
            fd = os.open(os.path.join(folder, name), os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            for e in (".sock", ".log", ".broken", ".lock"):
                try:
                    os.unlink(os.path.join(folder, k + e))
                except OSError:
                    pass
        except OSError:
            pass
        finally:
            os.close(fd)


def main(argv: list[str]) -> None:
    folder, key, lock_fd, preload, module, stamp = argv
    preload_list = [m for m in preload.split(",") if m]
    lock = int(lock_fd)
    os.set_inheritable(lock, False)
    try:
        for m in preload_list:
            importlib.import_module(m)
    except BaseException:
        traceback.print_exc()
        with open(os.path.join(folder, f"{key}.broken"), "w") as f:  # its clients start plainly at once
            f.write("preload failed: see the log\n")
        sys.exit(1)
    _sweep(folder, key)
    server = Server(folder, key, lock, preload_list, module, stamp)
    server.listen()
    server.serve()


if __name__ == "__main__":
    main(sys.argv[1:])
