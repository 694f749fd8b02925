"""What tests that start smoltrain as a process share: the command, and a cluster secret."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys


def smoltrain(*args, timeout: float = 240, cwd=None) -> subprocess.CompletedProcess:
    """`python -m smoltrain ARGS`, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "smoltrain", *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


def write_secret(path) -> str:
    """A fresh cluster secret at path (0600), for runs whose workers must share one."""
    path.write_text(secrets.token_hex(32))
    os.chmod(path, 0o600)
    return str(path)
