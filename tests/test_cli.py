"""The command-line surface: entry points, one-line errors, the secret file."""

import os
import stat
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def run(*argv, **kw):
    return subprocess.run(list(argv), capture_output=True, text=True, cwd=ROOT, timeout=120, **kw)


def test_module_entry_points_show_help():
    for pkg in ("smolnet", "smoltrain"):
        r = run(PY, "-m", pkg, "--help")
        assert r.returncode == 0, r.stderr
        assert pkg in r.stdout


def test_console_scripts_installed():
    bindir = Path(PY).parent
    for name in ("smolnet", "smoltrain"):
        r = run(str(bindir / name), "--help")
        assert r.returncode == 0, r.stderr


def test_missing_inventory_is_one_line_error(tmp_path):
    r = run(PY, "-m", "smolnet", "inventory", "-i", str(tmp_path / "nope.yml"))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "hosts.example.yml" in lines[0]


def test_secret_init_creates_0600_once(tmp_path):
    path = tmp_path / "cfg" / "secret"
    r = run(PY, "-m", "smolnet", "secret", "init", "--secret-file", str(path))
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    first = path.read_bytes()
    assert len(first.strip()) >= 32
    r = run(PY, "-m", "smolnet", "secret", "init", "--secret-file", str(path))
    assert r.returncode == 0 and "exists" in r.stdout
    assert path.read_bytes() == first


def test_make_provision_without_inventory_points_at_example(tmp_path):
    r = run("make", "-s", "provision", f"INVENTORY={tmp_path}/hosts.yml")
    assert r.returncode != 0
    assert "hosts.example.yml" in r.stderr
