"""The cluster secret: one shared key that every connection must prove it knows.

Kept in a 0600 file; a controller without one creates it on first use, and hands it
to processes it starts over SSH on their standard input, never on a command line.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from smolnet.errors import SmolError

DEFAULT_SECRET_FILE = "~/.config/smolcluster/secret"
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096


class SecretError(SmolError):
    """A secret file that is missing, unreadable, too short or readable by others: an input
    error like any other (exit 2)."""

    code = 2


def secret_path(path: str | os.PathLike | None = None) -> Path:
    return Path(os.path.expanduser(str(path or DEFAULT_SECRET_FILE)))


def parse_secret(raw: bytes, where: str = "secret") -> bytes:
    """Strip whitespace; refuse secrets too short to be worth anything."""
    value = raw.strip()
    if len(value) < MIN_SECRET_BYTES:
        raise SecretError(f"{where}: secret is shorter than {MIN_SECRET_BYTES} bytes")
    if len(value) > MAX_SECRET_BYTES:
        raise SecretError(f"{where}: secret is longer than {MAX_SECRET_BYTES} bytes")
    return value


def file_mode(path: str | os.PathLike) -> int:
    return os.stat(path).st_mode & 0o777


def check_mode(p: Path) -> None:
    """Refuse a secret others can read, as OpenSSH does with private keys."""
    try:
        mode = file_mode(p)
    except OSError:
        return  # reading it reports the problem
    if mode & 0o077:
        raise SecretError(f"{p}: mode {mode:04o} lets other users read the cluster secret; run 'chmod 600 {p}'")


def load_secret(path: str | os.PathLike | None = None) -> bytes:
    p = secret_path(path)
    check_mode(p)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise SecretError(f"{p}: no cluster secret (run 'smolnet secret init')") from None
    except OSError as e:
        raise SecretError(f"{p}: cannot read cluster secret: {e.strerror}") from None
    return parse_secret(raw, str(p))


def ensure_secret(path: str | os.PathLike | None = None) -> bytes:
    """Load the secret, creating a fresh random one (0600) when there is none."""
    p = secret_path(path)
    if p.exists():
        return load_secret(p)
    p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    value = secrets.token_hex(32).encode()
    tmp = p.with_name(p.name + f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, value + b"\n")
    finally:
        os.close(fd)
    try:
        os.link(tmp, p)  # atomic, and never clobbers a secret another process just made
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return load_secret(p)
