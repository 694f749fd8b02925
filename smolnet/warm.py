"""Ranks started from a warm server per host, user and key that imported their modules once.

`python -m smolnet.warm --preload A,B -- MODULE ARGS...` behaves as `python -m MODULE ARGS...`
would, started in its place (ProcessGroup.start runs it, here or on another host, when the group
has a preload list): same secret on standard input, same log, environment, folder, exit status
and signals. Underneath, this thin client (stdlib only: ~20 ms of CPU where `import torch` costs
~1.4 s) hands its argv, folder, environment and standard descriptors (SCM_RIGHTS) to a server
of this user on this host that imported the preload list once (smolnet.warm_server); the server
forks the rank. The client stays as the rank's pid: it forwards TERM/INT/HUP/QUIT/USR1/USR2,
exits with the rank's status (dying of the same signal), and if it is killed the server sees
its connection close and kills the rank, so `kill`, `kill -0` and Remote.stop of the reported
pid keep working.

The server's socket lives in a private folder (0700, the user's own, not a link: the trust
boundary, as for the logs), named by a key of everything that shapes what an import sees: the
interpreter, the preload list, the folder, the import-time environment, the namespaces and
cgroup (a forked rank inherits the server's), and a stamp of the code (sizes and mtimes), so an
updated checkout never runs old code. No server: the client starts one (detached, its own
session, in this host's namespaces and cgroup) and waits for it. Any failure of the warm path
falls back to exec'ing the plain `python -m MODULE ARGS` (same pid), never to an error.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import signal
import socket
import sys
import time

FOLDER = "~/.cache/smolcluster/warm"
# environment read at interpreter start or at import: a server started under other values
# would hand its ranks what it saw, so they are part of the key
KEY_PREFIXES = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "TORCH", "PYTORCH_", "SMOL_", "PYTHON", "LD_", "LC_")
KEY_NAMES = ("TMPDIR", "HOME", "LANG")
WAIT_S = 180.0  # a server importing torch on a 0.15-core host takes ~10 s; a stuck one is given up
FORWARD = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def command(python: str, preload: list[str], module: str, *args: str) -> list[str]:
    """The argv that runs `python -m MODULE ARGS` through this host's warm server for `preload`."""
    return [python, "-m", "smolnet.warm", "--preload", ",".join(preload), "--", module, *args]


def folder() -> str:
    """The user's private socket folder (made 0700), or raise OSError when it is not private."""
    d = os.path.expanduser(FOLDER)
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.lstat(d)
    if not os.path.isdir(d) or os.path.islink(d) or st.st_uid != os.geteuid():
        raise OSError(errno.EPERM, f"{d} is not a private folder of this user")
    if st.st_mode & 0o077:
        os.chmod(d, 0o700)
    return d


def _packages(names) -> list[str]:
    """Folders (or files) of the top-level packages named: found, not imported."""
    import importlib.util

    out = []
    for name in sorted({n.split(".")[0] for n in names}):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is not None:
            locs = list(spec.submodule_search_locations or [])
            out += locs or ([spec.origin] if spec.origin else [])
    return out


def code_stamp(names) -> str:
    """Sizes and mtimes of the named packages' .py files. An installed package (site-packages)
    is stamped by its __init__.py, which every reinstall rewrites; a checkout by every file."""
    h = hashlib.sha256()
    for loc in _packages(names):
        installed = "site-packages" in loc or "dist-packages" in loc
        if os.path.isfile(loc) or installed:
            files = [loc if os.path.isfile(loc) else os.path.join(loc, "__init__.py")]
        else:
            files = []
            for r, ds, fs in os.walk(loc):
                ds[:] = sorted(x for x in ds if x != "__pycache__")
                files += [os.path.join(r, f) for f in sorted(fs) if f.endswith(".py")]
        for f in files:
            try:
                st = os.stat(f)
                h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
            except OSError:
                h.update(f"{f}\0gone\n".encode())
    return h.hexdigest()[:16]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _where() -> dict:
    """What a forked rank inherits from the server and a fresh one gets from its own start."""
    ns = {}
    for n in ("net", "mnt", "uts", "pid", "ipc", "cgroup", "user"):
        try:
            ns[n] = os.readlink(f"/proc/self/ns/{n}")
        except OSError:
            pass
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = []
    try:
        import resource

        limits = [resource.getrlimit(getattr(resource, r)) for r in ("RLIMIT_NOFILE", "RLIMIT_STACK", "RLIMIT_AS")]
    except (ImportError, AttributeError, OSError):
        limits = []
    return {
        "limits": limits,
        "nice": os.nice(0),
        "ns": ns,
        "cgroup": _read("/proc/self/cgroup"),
        "boot": _read("/proc/sys/kernel/random/boot_id"),
        "host": socket.gethostname(),
        "cpus": cpus,
        "uid": os.geteuid(),
    }


def stamped_names(preload, module: str) -> list[str]:
    """The packages whose code a server's rank runs: the preload list, the module and smolnet."""
    return [*preload, module, "smolnet"]


def key(preload: list[str], module: str) -> tuple[str, str]:
    """(the server's key, its code stamp)."""
    stamp = code_stamp(stamped_names(preload, module))
    env = {k: v for k, v in os.environ.items() if k.startswith(KEY_PREFIXES) or k in KEY_NAMES}
    doc = {
        "python": [sys.executable, sys.version],
        "preload": list(preload),
        "cwd": os.getcwd(),
        "env": env,
        "where": _where(),
        "code": stamp,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:24], stamp


# --- the client ------------------------------------------------------------------------------


def in_folder(path: str, op) -> None:
    """op(the socket's name) run from the socket's folder: a unix socket's address is at most
    ~100 bytes, which a long HOME's absolute path would exceed; its name alone never does."""
    back = os.open(".", os.O_RDONLY)
    try:
        os.chdir(os.path.dirname(path))
        op(os.path.basename(path))
    finally:
        os.fchdir(back)
        os.close(back)


def _connect(path: str) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        in_folder(path, s.connect)
        return s
    except OSError:
        s.close()
        return None


def _spawn(d: str, k: str, lock_fd: int, preload: list[str], module: str, stamp: str) -> None:
    """Start the server detached (a double fork: its own session, no zombie here), holding the
    lock this client took: while it lives no second server starts for the key."""
    argv = [sys.executable, "-m", "smolnet.warm_server", d, k, str(lock_fd), ",".join(preload), module, stamp]
    log = os.open(os.path.join(d, f"{k}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            if os.fork() == 0:
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.set_inheritable(lock_fd, True)
                os.closerange(3, lock_fd)
                os.closerange(lock_fd + 1, 1024)
                os.execv(sys.executable, argv)
        finally:
            os._exit(0)
    os.close(log)
    os.waitpid(pid, 0)


def server(preload: list[str], module: str) -> socket.socket | None:
    """A connection to this key's server, started if none runs; None if there is none to be had."""
    d = folder()
    k, stamp = key(preload, module)
    path = os.path.join(d, f"{k}.sock")
    if os.path.exists(os.path.join(d, f"{k}.broken")):
        return None  # its preload failed: the plain start, at once
    deadline, spawned, pause = time.monotonic() + WAIT_S, False, 0.01
    while True:
        s = _connect(path)
        if s is not None:
            return s
        fd = os.open(os.path.join(d, f"{k}.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if spawned:
                return None  # the one we started is gone
            _spawn(d, k, fd, preload, module, stamp)
            spawned = True
        except BlockingIOError:
            pass  # a server holds it: starting, or about to listen
        finally:
            os.close(fd)
        if time.monotonic() > deadline:
            return None
        time.sleep(pause)
        pause = min(pause * 1.5, 0.1)


def _send_request(s: socket.socket, module: str, args: list[str]) -> None:
    mask = os.umask(0o077)
    os.umask(mask)
    req = {"module": module, "args": args, "cwd": os.getcwd(), "env": dict(os.environ), "umask": mask}
    body = json.dumps(req).encode()
    socket.send_fds(s, [len(body).to_bytes(4, "big")], [0, 1, 2])
    s.sendall(body)


def _die_as(code: int) -> None:
    """Exit as the rank did: its status, or killed by its signal (as a shell would see it)."""
    if code < 0:
        sig = -code
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # SIGKILL, SIGSTOP: default already
        os.kill(os.getpid(), sig)
        time.sleep(1.0)
        os._exit(128 + sig)
    os._exit(code & 0xFF)


def relay(s: socket.socket, module: str, args: list[str]) -> None:
    """Hand the rank to the server, then stand in for it until it exits."""
    _send_request(s, module, args)
    pid, buf = None, b""
    while pid is None:
        data = s.recv(64)
        if not data:
            raise ConnectionError("the server closed before starting the rank")
        buf += data
        if b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if not line.startswith(b"P"):
                raise ConnectionError(f"unexpected reply {line[:40]!r}")
            pid = int(line[1:])

    def forward(sig, _frame):
        try:
            s.sendall(b"S%d\n" % sig)
        except OSError:  # the server is gone: signal the rank directly
            try:
                os.kill(pid, sig)
            except OSError:
                pass

    for sig in FORWARD:
        signal.signal(sig, forward)
    while True:
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.startswith(b"X"):
                _die_as(int(line[1:]))
        try:
            data = s.recv(64)
        except OSError:
            data = b""
        if not data:
            break
        buf += data
    # the server died without the status (killed): stand in until the rank is gone
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os._exit(1)
        except OSError:
            pass
        time.sleep(0.2)


def _plain(module: str, args: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, "-m", module, *args])


def main(argv: list[str]) -> None:
    if len(argv) < 4 or argv[0] != "--preload" or argv[2] != "--":
        print("usage: python -m smolnet.warm --preload A,B -- MODULE [ARGS...]", file=sys.stderr)
        sys.exit(2)
    preload = [m for m in argv[1].split(",") if m]
    module, args = argv[3], argv[4:]
    try:
        s = server(preload, module)
    except Exception:
        s = None
    if s is None:
        _plain(module, args)
    try:
        relay(s, module, args)
    except (OSError, ConnectionError, ValueError):
        pass
    _plain(module, args)  # the server failed before it started the rank (relay never returns else)


if __name__ == "__main__":
    main(sys.argv[1:])
