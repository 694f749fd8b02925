"""The demo's stages: each a plain command line (the ones the README teaches), logged, timed
and recorded, so the demo doubles as a check that the tutorial still works.

A stage the later ones cannot do without (the sim, the measurements, the calibration) stops
the demo when it fails; any other failing stage is recorded, the demo goes on to report what
it can, and ends non-zero naming every stage that failed.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from smolnet.errors import SmolError

ROOT = Path(__file__).resolve().parents[2]


class Stages:
    def __init__(self, console, out: Path):
        self.console = console
        self.out = out
        self.log = out / "demo.log"
        self.results: list[dict] = []
        self.log.write_text("")

    @property
    def failed(self) -> list[dict]:
        return [r for r in self.results if not r["ok"]]

    def run(
        self, title: str, argv: list, ok_codes=(0,), timeout: float = 900, required: bool = True
    ) -> subprocess.CompletedProcess | None:
        """Run one stage; a failure raises when `required`, else is recorded (and None returned)."""
        argv = [str(a) for a in argv]
        self.console.rule(f"[bold]{title}")
        self.console.print(f"[dim]$ {' '.join(shlex.quote(a) for a in argv)}")
        t0 = time.monotonic()
        env = dict(os.environ, PYTHONUNBUFFERED="1", ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"))
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
        with open(self.log, "a") as log:
            log.write(f"\n$ {' '.join(argv)}\n")
            log.flush()
            try:
                p = subprocess.run(
                    argv,
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    timeout=timeout,
                )
                out, rc = p.stdout, p.returncode
            except subprocess.TimeoutExpired as e:
                out, rc, p = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else "", -1, None
                out += f"\ntimed out after {timeout:.0f}s"
            log.write(out)
        sys.stdout.write(out[-6000:])
        ok = rc in ok_codes
        last = [ln for ln in out.strip().splitlines() if ln.strip()][-1:] or ["no output"]
        self.results.append(
            {
                "stage": title,
                "rc": rc,
                "seconds": round(time.monotonic() - t0, 1),
                "ok": ok,
                "why": None if ok else last[0][:300],
            }
        )
        if not ok:
            msg = f"stage '{title}' failed (exit {rc}): {last[0][:300]} (log: {self.log})"
            if required:
                raise SmolError(msg)
            self.console.print(f"[bold red]{msg}")
            return None
        return p


def smol(py: str, tool: str, *args) -> list[str]:
    """`python -m smoltrain|smolnet ARGS`, as strings."""
    return [py, "-m", tool, *(str(a) for a in args)]
