"""Drive an elastic `smoltrain run` from a test: a newcomer joins while it runs, a rank is killed.

The run's output is read line by line: as soon as it prints its control channel, one joiner
(`smoltrain worker --join`, the secret on its standard input) is started; at the first line
`kill_when` accepts, the victim rank is SIGKILLed. Everything is bounded by a deadline.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path


def watch(
    proc: subprocess.Popen, secret_file: str, kill_when, victim: str = "rank2", limit: float = 200
) -> tuple[int, str]:
    """(exit status, output) of the run `proc` (stdout piped, text), with one joiner and one kill;
    the joiner's own output, if any, ends the output. kill_when(line, lines so far) -> bool."""
    lines, joiner, killed = [], None, False
    joined = tempfile.TemporaryFile()  # noqa: SIM115 (closed below): the joiner's own output, for a failure's message
    timer = threading.Timer(limit, proc.kill)
    timer.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"control channel (\S+)", line)
            if m and joiner is None:  # a newcomer, started while the run is under way
                joiner = subprocess.Popen(
                    [sys.executable, "-m", "smoltrain", "worker", "--control", m.group(1), "--join"],
                    stdin=subprocess.PIPE,
                    stdout=joined,
                    stderr=subprocess.STDOUT,
                )
                joiner.stdin.write(Path(secret_file).read_bytes() + b"\n")
                joiner.stdin.close()
            if not killed and kill_when(line, lines):
                pid = int(re.search(rf"worker {victim} pid (\d+)", "".join(lines)).group(1))
                os.kill(pid, signal.SIGKILL)
                killed = True
        rc = proc.wait(timeout=30)
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
        if joiner is not None:
            try:
                joiner.wait(timeout=30)
            except subprocess.TimeoutExpired:
                joiner.kill()
        joined.seek(0)
        said = joined.read().decode(errors="replace")[-1500:]
        joined.close()
    return rc, "".join(lines) + (f"\n--- the joiner's output ---\n{said}" if said else "")
