"""Setup never degrades silently: system packages installed as root or the exact command
printed (exit 2); loopback hosts only when asked; local hosts run the interpreter that
runs the command."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from smolnet.inventory import load_inventory

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "system-deps.sh"
BASH = shutil.which("bash")


def _shims(tmp_path: Path, uid: int, installed: bool, dpkg: bool = True) -> dict:
    """PATH with fake id, dpkg-query and apt-get, so the script's choices are seen, not made."""
    d = tmp_path / "bin"
    d.mkdir()
    log = tmp_path / "apt.log"
    (d / "id").write_text(f"#!/bin/sh\necho {uid}\n")
    if dpkg:
        status = "install ok installed" if installed else "unknown ok not-installed"
        (d / "dpkg-query").write_text(f"#!/bin/sh\nprintf '%s' '{status}'\n")
    (d / "apt-get").write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    for f in d.iterdir():
        f.chmod(0o755)
    path = f"{d}:/usr/bin:/bin" if dpkg else str(d) + ":" + _path_without("dpkg-query")
    return dict(os.environ, PATH=path, SMOL_SYSTEM_DEPS="")


def _path_without(tool: str) -> str:
    return ":".join(p for p in os.environ["PATH"].split(":") if p and not (Path(p) / tool).exists())


def deps(env, *args) -> subprocess.CompletedProcess:
    return subprocess.run([BASH, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)


PACKAGES = subprocess.run([BASH, str(SCRIPT), "--list"], capture_output=True, text=True).stdout.split()


def test_package_list_covers_what_the_tests_drive():
    assert {"openssh-server", "iperf3", "iproute2", "ethtool", "nfs-ganesha", "make"} <= set(PACKAGES)
    assert "scripts/system-deps.sh" in (ROOT / ".ci" / "run").read_text()  # CI installs the same list


def test_not_root_prints_the_exact_command_and_exits_2(tmp_path):
    p = deps(_shims(tmp_path, 1000, installed=False))
    assert p.returncode == 2, p.stderr
    assert f"sudo apt-get install -y --no-install-recommends {' '.join(PACKAGES)}" in p.stderr
    assert not (tmp_path / "apt.log").exists()


def test_root_installs_the_missing_packages_with_apt(tmp_path):
    p = deps(_shims(tmp_path, 0, installed=False))
    assert p.returncode == 0, p.stderr
    calls = (tmp_path / "apt.log").read_text().splitlines()
    assert calls[0] == "update -qq"
    assert calls[1] == f"install -y -qq --no-install-recommends {' '.join(PACKAGES)}"


def test_nothing_to_do_when_installed_and_check_never_installs(tmp_path):
    env = _shims(tmp_path, 1000, installed=True)
    p = deps(env)
    assert p.returncode == 0 and "all" in p.stdout
    root = tmp_path / "root"
    root.mkdir()
    p = deps(_shims(root, 0, installed=False), "--check")
    assert p.returncode == 2 and "missing" in p.stderr and not (root / "apt.log").exists()


def test_no_dpkg_stops_unless_skipped_loudly(tmp_path):
    env = _shims(tmp_path, 1000, installed=False, dpkg=False)
    p = deps(env)
    assert p.returncode == 2 and "not a Debian/Ubuntu machine" in p.stderr
    p = deps(dict(env, SMOL_SYSTEM_DEPS="skip"))
    assert p.returncode == 0 and "SKIPPED" in p.stderr


def test_make_demo_and_test_install_the_system_packages_first():
    text = (ROOT / "Makefile").read_text()
    for target in ("test", "demo"):
        m = re.search(rf"^{target}:([^\n]*)", text, flags=re.M)
        assert m and m.group(1).split()[:1] == ["system-deps"], (target, m and m.group(0))
    p = subprocess.run(["make", "-n", "system-deps"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "scripts/system-deps.sh" in p.stdout


def test_local_hosts_default_smol_python_to_this_interpreter(tmp_path):
    inv = tmp_path / "hosts.yml"
    inv.write_text(
        "cluster:\n  hosts:\n"
        "    here: {ansible_connection: local, cluster_ip: 127.0.0.2}\n"
        "    pinned: {ansible_connection: local, cluster_ip: 127.0.0.3, smol_python: /opt/py/bin/python}\n"
        "    far: {ansible_host: 192.0.2.7}\n"
    )
    hosts = {h.name: h for h in load_inventory(inv).hosts}
    assert hosts["here"].python == sys.executable
    assert hosts["pinned"].python == "/opt/py/bin/python"
    assert hosts["far"].python == "python3"


def test_loopback_inventory_without_smol_python_trains(tmp_path):
    """The reported failure: `No module named smoltrain` from a `python3` without the project."""
    from ports import free_port

    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "python3").write_text("#!/bin/sh\necho 'No module named smoltrain' >&2\nexit 1\n")
    (shim / "python3").chmod(0o755)
    secret = tmp_path / "secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    port = free_port("127.0.0.2", "127.0.0.3")
    inv = tmp_path / "hosts.yml"
    inv.write_text(
        "cluster:\n  hosts:\n"
        "    alpha: {ansible_connection: local, cluster_ip: 127.0.0.2}\n"
        "    beta: {ansible_connection: local, cluster_ip: 127.0.0.3}\n"
        f"  vars: {{smol_train_port: {port}, smol_secret_file: {secret}}}\n"
    )
    env = dict(os.environ, PATH=f"{shim}:{os.environ['PATH']}")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "smoltrain",
            "run",
            "--strategy",
            "dp",
            "-i",
            str(inv),
            "--steps",
            "2",
            "--batch",
            "4",
            "--seq",
            "16",
            "--json",
            str(tmp_path / "r.json"),
            "--out",
            str(tmp_path),
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, p.stderr[-2000:] + p.stdout[-1000:]
    assert "No module named" not in p.stdout + p.stderr


@pytest.mark.sim
def test_sim_up_without_namespaces_refuses_unless_loopback_is_asked(tmp_path):
    """Either the sim comes up namespaced, or the CLI refuses and names --loopback; never a quiet fallback."""
    from smolnet.sim import net

    env = dict(os.environ, SMOL_SIM_LOOPBACK="0")
    inv = tmp_path / "a.yml"
    argv = [
        sys.executable,
        "-m",
        "smolnet",
        "sim",
        "up",
        "--name",
        "asetup",
        "--subnet",
        "10.45.0.0/24",
        "--scenario",
        "uniform",
        "--hosts",
        "2",
        "--inventory",
        str(inv),
    ]
    try:
        p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        if net.unavailable_reason():
            assert p.returncode == 2 and "--loopback" in p.stderr and not inv.exists()
        else:
            assert p.returncode == 0, p.stderr
            assert "ansible_connection: local" not in inv.read_text()
    finally:
        subprocess.run(
            [sys.executable, "-m", "smolnet", "sim", "down", "--name", "asetup"], capture_output=True, timeout=300
        )
