"""Helpers for the provisioning tests: run ansible-playbook with the repo's config and read its recap."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
RECAP_RE = re.compile(r"^(\S+)\s+:\s+ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.M)


def ansible_env() -> dict:
    env = dict(os.environ)
    env.update(
        {
            "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_FORCE_COLOR": "0",
            "ANSIBLE_LOCALHOST_WARNING": "False",
            "ANSIBLE_INVENTORY_UNPARSED_WARNING": "False",
            "PATH": f"{BIN}:{env.get('PATH', '')}",
        }
    )
    return env


def playbook(*args: str, timeout: float = 400, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ansible-playbook from the repo root (`env` added to the environment); output is
    stdout and stderr together."""
    return subprocess.run(
        [str(BIN / "ansible-playbook"), *args],
        cwd=REPO,
        env={**ansible_env(), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


def recap(output: str) -> dict[str, dict[str, int]]:
    """PLAY RECAP per host: {'pi5': {'ok': 40, 'changed': 0, 'unreachable': 0, 'failed': 0}}."""
    out = {}
    for host, ok, changed, unreachable, failed in RECAP_RE.findall(output):
        out[host] = {"ok": int(ok), "changed": int(changed), "unreachable": int(unreachable), "failed": int(failed)}
    return out


def changed_tasks(output: str) -> list[str]:
    """Names of tasks that reported a change, for a readable failure message."""
    names, current = [], None
    for line in output.splitlines():
        if line.startswith(("TASK [", "RUNNING HANDLER [")):
            current = line.split("[", 1)[1].rsplit("]", 1)[0]
        elif line.startswith("changed:") and current:
            names.append(f"{current}: {line.split(']')[0]}]")
    return names


def ns_run(ns: str, argv: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess:
    """Run a command in a sim host's network namespace (not its mount namespace)."""
    return subprocess.run(["ip", "netns", "exec", ns] + argv, capture_output=True, text=True, timeout=timeout)
