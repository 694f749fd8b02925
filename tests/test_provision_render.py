"""Provisioning paths this machine cannot run (netplan, NetworkManager, networkd, ifupdown,
dhcpcd, launchd): the roles' own tasks render their files under a temporary root, and
detection picks the right stack from each root's traces."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from provisiontools import changed_tasks, playbook, recap

pytestmark = [pytest.mark.timeout(600)]

LOCAL = ("-i", "localhost,", "tests/ansible/render.yml", "-e", f"ansible_python_interpreter={sys.executable}")
IFACE, MAC = "enp3s0", "52:54:00:12:34:56"
STACK_TRACES = {  # what each stack leaves on a host, for detection
    "netplan": ["etc/netplan/50-cloud-init.yaml"],
    "networkmanager": ["run/NetworkManager/NetworkManager.pid", "etc/network/interfaces"],
    "networkd": ["run/systemd/netif/links/2", "etc/systemd/network/20-wired.network"],
    "ifupdown": ["etc/network/interfaces", "etc/dhcpcd.conf"],
    "dhcpcd": ["etc/dhcpcd.conf", "etc/systemd/network/.keep"],
    "link": ["etc/systemd/network/.keep"],
    "none": ["etc/hostname"],
}
INTERFACES = f"auto lo\niface lo inet loopback\n\nauto {IFACE}\niface {IFACE} inet dhcp\n    hostname pi5\n"


def _prepare(root: Path) -> None:
    for stack in ("netplan", "networkmanager", "networkd", "ifupdown", "dhcpcd", "link"):
        for d in ("etc/netplan", "etc/NetworkManager/conf.d", "etc/systemd/network", "etc/network"):
            (root / stack / d).mkdir(parents=True, exist_ok=True)
    (root / "ifupdown/etc/network/interfaces").write_text(INTERFACES)
    for stack, files in STACK_TRACES.items():
        for f in files:
            p = root / f"detect-{stack}" / f
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(INTERFACES if f.endswith("interfaces") else "x\n")
    for os_family, d in (("Debian", "etc/systemd/system"), ("Darwin", "Library/LaunchDaemons")):
        (root / f"agent-{os_family}" / d).mkdir(parents=True)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    root = tmp_path_factory.mktemp("render")
    _prepare(root)
    first = playbook(*LOCAL, "-e", f"render_dir={root}", timeout=240)
    assert recap(first.stdout).get("localhost", {}).get("failed") == 0, first.stdout[-4000:]
    return root, first


def test_netplan_file(rendered):
    root, _ = rendered
    p = root / "netplan/etc/netplan/60-smolcluster-mtu.yaml"
    import yaml

    doc = yaml.safe_load(p.read_text())
    assert doc == {"network": {"version": 2, "ethernets": {IFACE: {"mtu": 9000}}}}
    assert p.stat().st_mode & 0o777 == 0o600  # netplan warns about readable files


def test_networkmanager_default(rendered):
    text = (rendered[0] / "networkmanager/etc/NetworkManager/conf.d/60-smolcluster-mtu.conf").read_text()
    assert f"[connection-smolcluster-mtu-{IFACE}]" in text
    assert f"match-device=interface-name:{IFACE}" in text
    assert "ethernet.mtu=9000" in text.splitlines()


def test_networkd_dropin(rendered):
    p = rendered[0] / "networkd/etc/systemd/network/20-wired.network.d/60-smolcluster-mtu.conf"
    lines = p.read_text().splitlines()
    assert "[Link]" in lines and "MTUBytes=9000" in lines


def test_ifupdown_stanza(rendered):
    text = (rendered[0] / "ifupdown/etc/network/interfaces").read_text()
    lines = text.splitlines()
    i = lines.index(f"iface {IFACE} inet dhcp")
    # The MTU line sits inside the stanza, right after its iface line, and the rest is kept.
    assert f"post-up ip link set dev {IFACE} mtu 9000" in "\n".join(lines[i + 1 : i + 4])
    assert "    hostname pi5" in lines and "iface lo inet loopback" in lines


@pytest.mark.parametrize("stack", ["dhcpcd", "link"])
def test_udev_link_file(rendered, stack):
    text = (rendered[0] / f"{stack}/etc/systemd/network/10-smolcluster-{IFACE}.link").read_text()
    lines = text.splitlines()
    assert f"MACAddress={MAC}" in lines and "MTUBytes=9000" in lines
    assert any(line.startswith("NamePolicy=") for line in lines)  # keeps the interface's name


def test_detection_picks_each_stack(rendered):
    root, _ = rendered
    for stack in STACK_TRACES:
        assert (root / f"detected-{stack}").read_text().strip() == stack, stack


def test_agent_service_files(rendered):
    root, _ = rendered
    unit = (root / "agent-Debian/etc/systemd/system/smolnet-agent.service").read_text()
    exec_line = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert "-m smolnet agent --bind 192.0.2.11 --port 7650" in exec_line
    assert "~" not in exec_line  # systemd does not expand ~
    assert "--iface eth0" in exec_line
    plist = (root / "agent-Darwin/Library/LaunchDaemons/dev.smolcluster.agent.plist").read_text()
    assert "<string>dev.smolcluster.agent</string>" in plist and "<string>192.0.2.11</string>" in plist


def test_second_render_in_check_mode_changes_nothing(rendered):
    """Rendering every stack and both agent files again, in check mode, over the first render's
    files reports no change: the persistence tasks are idempotent. Detection (`--skip-tags
    detect`) only reads, and writes its per-stack record, so it is left out of this run."""
    root, _ = rendered
    again = playbook(*LOCAL, "-e", f"render_dir={root}", "--check", "--skip-tags", "detect", timeout=240)
    r = recap(again.stdout).get("localhost")
    assert r and r["failed"] == 0, again.stdout[-4000:]
    assert r["changed"] == 0, changed_tasks(again.stdout)


def test_ganesha_start_takes_a_ganesha_already_running_as_done(tmp_path):
    """The role's own start command, against the real start-stop-daemon: after a restart in the
    same run ganesha writes its pidfile a moment after the status check read none (CI saw the
    start then fail with "already running"). The start is skipped after a restart, and where it
    still meets a running one it exits 0 and reports no change."""
    import subprocess

    import jinja2
    import yaml

    tasks = yaml.safe_load(Path("playbooks/roles/nfs_server/tasks/ganesha.yml").read_text())
    start = next(t for t in tasks if t["name"] == "Start ganesha")
    env = jinja2.Environment()
    facts = {
        "nfs_server_ganesha_state_dir": str(tmp_path),
        "nfs_server_ganesha_bin": "/usr/bin/sleep",  # stands in for ganesha.nfsd: a real process
        "nfs_server_ganesha_conf": str(tmp_path / "smolcluster.conf"),
    }
    argv = [env.from_string(a).render(**facts) for a in start["ansible.builtin.command"]["argv"]]
    when = env.compile_expression(start["when"])
    assert when(**facts, nfs_server_ganesha_running=False) is True
    assert when(**facts, nfs_server_ganesha_running=False, nfs_server_ganesha_restarted=True) is False
    running = subprocess.Popen(["/usr/bin/sleep", "600"])
    try:
        (tmp_path / "ganesha.pid").write_text(f"{running.pid}\n")
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stdout + done.stderr
        changed = env.compile_expression(start["changed_when"])
        assert changed(nfs_server_ganesha_start={"stdout": done.stdout}) is False
        assert running.poll() is None  # the one ganesha, untouched
    finally:
        running.kill()
        running.wait()
