"""macOS as far as a Linux machine can check it: the host roles in check mode against this
machine with Darwin facts (tests/ansible/darwin.yml), macOS's own tools replaced by shims that
answer as a Mac does. What runs is Ansible's choice of tasks, variables and templates for
Darwin (become, the launchd plist, networksetup, the mount point off the read-only volume, the
Python check); the modules themselves run as on Linux, and nothing here ran on a real Mac.
"""

from __future__ import annotations

import json
import sys

import pytest
from provisiontools import REPO, playbook, recap

pytestmark = [pytest.mark.timeout(600)]

SHIMS = {
    "networksetup": 'case "$1" in -listValidMTURange) echo "Valid MTU Range: 1280-9000";;'
    ' -getMTU) echo "Active MTU: 1500 (Current Setting: 1500)";; esac',
    "scutil": "echo macmini",
    "launchctl": "exit 0",
    "dscacheutil": "exit 0",
}
FACTS = {
    "ansible_system": "Darwin",
    "ansible_os_family": "Darwin",
    "ansible_distribution": "MacOSX",
    "ansible_distribution_version": "15.1",
    "ansible_architecture": "arm64",
    "ansible_service_mgr": "launchd",
    "ansible_interfaces": ["lo0", "en0"],
    "ansible_en0": {
        "device": "en0",
        "ipv4": [{"address": "192.0.2.13", "netmask": "255.255.255.0"}],
        "macaddress": "5e:00:00:00:00:13",
        "mtu": 1500,
    },
    "ansible_all_ipv4_addresses": ["192.0.2.13"],
}


def _run(tmp_path, python: str, mount_dir: str = "/opt/smolcluster/models", tags=()):
    shims = tmp_path / "bin"
    shims.mkdir(exist_ok=True)
    for name, body in SHIMS.items():
        (shims / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {tmp_path}/calls\n{body}\n')
        (shims / name).chmod(0o755)
    cache = tmp_path / "facts"
    cache.mkdir(exist_ok=True)
    # the jsonfile cache as ansible-core 2.19 (constraints.txt) writes it
    payload = json.dumps({**FACTS, "_ansible_facts_gathered": True})
    (cache / "s1_macmini").write_text(json.dumps({"__payload__": payload}))
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n")
    inv = tmp_path / "hosts.yml"
    inv.write_text(
        f"""cluster:
  hosts:
    macmini:
      ansible_connection: local
      ansible_host: 192.0.2.13
      ansible_python_interpreter: {sys.executable}
      cluster_iface: en0
      device: mac-mini-m4
      mtu: 1500
      smol_firewall: true
      smol_python: {sys.executable}
      smolcluster_base_python: {python}
      smolcluster_install: auto
      smolcluster_agent_service: true
      smolcluster_project_dir: {REPO}
      smolcluster_controller_secret_file: {tmp_path}/secret
      smol_secret_file: {tmp_path}/host-secret
      nfs_mount_dir: {mount_dir}
      nfs_checkpoint_dir: /srv/checkpoints
      nfs_checkpoint_mount_dir: /opt/smolcluster/checkpoints
      nfs_client_fstab: {tmp_path}/fstab
      hostname_hosts_file: {hosts}
nfs_server:
  hosts:
    macmini:
"""
    )
    env = {
        "PATH": f"{shims}:{sys.prefix}/bin:/usr/bin:/bin:/usr/sbin:/sbin",
        "ANSIBLE_CACHE_PLUGIN": "jsonfile",
        "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(cache),
        "ANSIBLE_CACHE_PLUGIN_TIMEOUT": "0",
        "ANSIBLE_BECOME_EXE": "/nonexistent/sudo",
    }
    return playbook("-i", str(inv), "tests/ansible/darwin.yml", "--check", "--diff", "-v", *tags, timeout=300, env=env)


def test_darwin_tasks_in_check_mode(tmp_path):
    p = _run(tmp_path, sys.executable)
    r = recap(p.stdout).get("macmini")
    assert p.returncode == 0 and r and r["failed"] == 0, p.stdout[-6000:]
    out = p.stdout
    # launchd, not systemd: the plist for the login user, the venv's python, as root
    assert "+  <string>dev.smolcluster.agent</string>" in out, out[-4000:]
    assert f"+    <string>{sys.executable}</string>" in out and "+    <string>192.0.2.13</string>" in out
    assert "RUNNING HANDLER [smolcluster : Bootstrap the measurement agent (launchd)]" in out
    assert "ExecStart=" not in out
    # the MTU read with networksetup; the shares mounted off the read-only volume, rw for checkpoints
    calls = (tmp_path / "calls").read_text()
    assert "networksetup -listValidMTURange en0" in calls and "networksetup -getMTU en0" in calls, calls
    assert "ro,resvport,vers=4" in out and "rw,resvport,vers=4" in out, out[-4000:]
    assert "pf is not managed here" in out  # the firewall role's macOS note


def test_apples_python_is_refused_naming_what_to_install(tmp_path):
    old = tmp_path / "python3.9"
    old.write_text("#!/bin/sh\necho 3.9.6\n")
    old.chmod(0o755)
    p = _run(tmp_path, str(old))
    assert p.returncode != 0, p.stdout[-3000:]
    assert "needs Python 3.11+" in p.stdout and "is 3.9.6" in p.stdout and "brew install python" in p.stdout


def test_a_mount_point_on_the_read_only_volume_is_refused(tmp_path):
    p = _run(tmp_path, sys.executable, mount_dir="/mnt/models")
    assert p.returncode != 0, p.stdout[-3000:]
    assert "/mnt/models would lie on macOS's read-only system volume" in p.stdout, p.stdout[-3000:]
