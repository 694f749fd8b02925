"""The controller's first lines: scripts/bootstrap.sh installs what `make` needs and runs
`make setup`; make-venv.sh refuses a Python older than 3.11 in one line; torch-index.sh picks
PyTorch's CPU index on x86-64 Linux unless pip already has a source of its own. External tools
(apt-get, sudo, id, make, the old Python) are shims that record their calls."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
BASH = shutil.which("bash")


def _shim(d: Path, name: str, body: str) -> None:
    d.mkdir(exist_ok=True)
    (d / name).write_text(f"#!/bin/sh\n{body}\n")
    (d / name).chmod(0o755)


def _run(argv, env=None, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=60)


def test_too_old_python_is_refused_in_one_line(tmp_path):
    _shim(tmp_path / "bin", "python3.9", 'case "$1" in -V) echo "Python 3.9.6";; -c) exit 1;; esac')
    venv = tmp_path / "venv"
    p = _run([BASH, str(SCRIPTS / "make-venv.sh"), str(tmp_path / "bin" / "python3.9"), str(venv)])
    assert p.returncode == 2 and not venv.exists(), p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "needs Python 3.11+" in p.stderr and "Python 3.9.6" in p.stderr and "PYTHON=" in p.stderr
    p = _run([BASH, str(SCRIPTS / "make-venv.sh"), str(tmp_path / "no-such-python"), str(venv)])
    assert p.returncode == 2 and "not found" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_make_setup_refuses_it_before_making_anything(tmp_path):
    _shim(tmp_path / "bin", "python3.9", 'case "$1" in -V) echo "Python 3.9.6";; -c) exit 1;; esac')
    venv = tmp_path / "venv"
    p = _run(["make", "-s", "setup", f"VENV={venv}", f"PYTHON={tmp_path / 'bin' / 'python3.9'}"])
    assert p.returncode != 0 and not venv.exists(), p.stdout + p.stderr
    assert "error: smolcluster needs Python 3.11+" in p.stderr.splitlines()[0], p.stderr


def test_a_working_python_makes_the_venv(tmp_path):
    venv = tmp_path / "venv"
    p = _run([BASH, str(SCRIPTS / "make-venv.sh"), sys.executable, str(venv)])
    assert p.returncode == 0, p.stderr
    assert (venv / "bin" / "python").exists()


def test_torch_index_choices(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # no pip.conf: a bare controller
    pip = str(Path(sys.executable).parent / "pip")
    script = [BASH, str(SCRIPTS / "torch-index.sh")]
    bare = _run(script + ["auto", pip], env=env).stdout.strip()
    if platform.system() == "Linux" and platform.machine() == "x86_64":
        assert bare == "--extra-index-url https://download.pytorch.org/whl/cpu"
    else:
        assert bare == ""
    served = _run(script + ["auto", pip], env=dict(env, PIP_FIND_LINKS="/opt/wheels")).stdout.strip()
    assert served == ""  # a local wheel or mirror serves torch as it is
    assert _run(script + ["", pip], env=env).stdout.strip() == ""
    assert _run(script + ["http://mirror/whl", pip], env=env).stdout.strip() == "--extra-index-url http://mirror/whl"


def test_bootstrap_installs_what_make_needs_then_runs_make_setup(tmp_path):
    bin_ = tmp_path / "bin"
    log = tmp_path / "calls"
    _shim(bin_, "id", "echo 1000")
    _shim(bin_, "apt-get", f'echo "apt-get $*" >> {log}')
    _shim(bin_, "sudo", f'echo "sudo $1" >> {log}; exec "$@"')
    _shim(bin_, "make", f'echo "make $*" >> {log}')
    _shim(bin_, "bash", f'echo "bash $*" >> {log}')
    env = dict(os.environ, PATH=f"{bin_}:/usr/bin:/bin")
    p = _run(["sh", str(SCRIPTS / "bootstrap.sh")], env=env)
    assert p.returncode == 0, p.stderr
    calls = log.read_text().splitlines()
    install = next(c for c in calls if c.startswith("apt-get install"))
    assert {"make", "git", "python3", "python3-venv", "ca-certificates"} <= set(install.split())
    assert "bash scripts/system-deps.sh" in calls and calls[-1] == "make setup", calls
    assert calls.index("sudo apt-get") < calls.index("make setup")


def test_bootstrap_without_apt_says_what_to_do(tmp_path):
    for tool in ("dirname", "id"):  # a machine with the basics but no apt-get
        (tmp_path / tool).symlink_to(shutil.which(tool))
    env = dict(os.environ, PATH=str(tmp_path))
    p = subprocess.run(["/bin/sh", str(SCRIPTS / "bootstrap.sh")], env=env, capture_output=True, text=True)
    assert p.returncode == 2 and "no apt-get" in p.stderr and len(p.stderr.strip().splitlines()) == 1
