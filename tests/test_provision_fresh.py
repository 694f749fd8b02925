"""A fresh host, for real: the host roles against a root that is a fresh minimal Debian 12
(tests/freshroot.py), the path a new Pi or server takes. playbooks/user.yml makes the `smol`
user from the image's root login; then preflight, hostname, smolcluster (apt python3-venv, a venv,
pip with the controller's constraints, the agent's unit) and the firewall (nftables, on).

What it cannot do: the root has no init, so the agent is started from the unit's own command
line as the unit's user, not by systemd. torch comes from this machine's local wheel directory
(smolcluster_torch_find_links) because PyTorch's CPU index is out of this machine's reach; every
other package from PyPI through pip, as on a real host.
"""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import sys

import pytest
from freshroot import CTL, HOST, WHEELS, FreshHost
from need import need_sim, need_tool
from provisiontools import REPO, changed_tasks, playbook, recap

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

VENV_PY = "/home/smol/.local/share/smolcluster/venv/bin/python"
EXTRA = [
    "-e",
    "smolcluster_install=auto smolcluster_agent_service=true smolcluster_agent_start=false",
    "-e",
    f"smolcluster_torch_index='' smolcluster_torch_find_links={WHEELS}",
    "-e",
    # this network's CA (its proxy signs PyPI's certificate), which pip's own bundle lacks
    "smolcluster_pip_extra_args='--cache-dir /var/cache/smol-pip --cert /etc/ssl/certs/ca-certificates.crt'",
    "-e",
    f"smolcluster_project_dir={REPO}",
]


def _pins() -> dict[str, str]:
    text = (REPO / "constraints.txt").read_text()
    return dict(re.findall(r"(?m)^([A-Za-z0-9_.-]+)==(\S+)", text))


def _inventory(path, fresh: FreshHost, secret, user: str) -> None:
    path.write_text(
        f"""cluster:
  hosts:
    fresh:
      ansible_host: {HOST}
      ansible_user: {user}
      ansible_ssh_private_key_file: {fresh.key}
      ansible_ssh_common_args: >-
        -o UserKnownHostsFile={fresh.known_hosts} -o StrictHostKeyChecking=yes -o IdentitiesOnly=yes
      ansible_python_interpreter: /usr/bin/python3
      cluster_iface: eth0
      smol_python: ~/.local/share/smolcluster/venv/bin/python
      smol_firewall: true
      smol_agent_port: 7650
      smol_train_port: 7700
  vars:
    smolcluster_controller_secret_file: {secret}
"""
    )


@pytest.fixture(scope="module")
def provisioned(tmp_path_factory):
    need_sim()
    for tool in ("mmdebstrap", "nft"):
        need_tool(tool)
    work = tmp_path_factory.mktemp("fresh")
    fresh = FreshHost(work)
    secret = work / "secret"
    try:
        fresh.up()
        as_root = work / "root.yml"
        _inventory(as_root, fresh, secret, "root")
        made = playbook("-i", str(as_root), "playbooks/user.yml", "-e", f"user_pubkey_file={fresh.key}.pub")
        assert made.returncode == 0, made.stdout[-4000:]
        inv = work / "hosts.yml"
        _inventory(inv, fresh, secret, "smol")
        first = playbook("-i", str(inv), "tests/ansible/fresh_host.yml", *EXTRA, timeout=800)
        r = recap(first.stdout).get("fresh")
        assert first.returncode == 0 and r and r["failed"] == 0, first.stdout[-6000:]
        yield {"fresh": fresh, "inventory": inv, "secret": secret, "work": work, "first": first}
    finally:
        fresh.down()


def test_user_play_made_smol_with_passwordless_sudo(provisioned):
    p = provisioned["fresh"].ssh("smol", "id -un; sudo -n id -un")
    assert p.stdout.split() == ["smol", "root"], p.stdout + p.stderr


def test_installed_at_the_controllers_pins(provisioned):
    pins = _pins()
    code = (
        "import json, importlib.metadata as m, smolnet, smoltrain; "
        "print(json.dumps({d: m.version(d) for d in ('smolcluster', 'torch', 'numpy', 'paramiko')}))"
    )
    p = provisioned["fresh"].ssh("smol", f"{VENV_PY} -c {shlex.quote(code)}")
    got = json.loads(p.stdout)
    assert got["torch"].split("+")[0] == pins["torch"], got
    assert got["numpy"] == pins["numpy"] and got["paramiko"] == pins["paramiko"], got
    status = provisioned["fresh"].ssh("smol", "dpkg-query -W -f='${Status}' python3-venv").stdout
    assert status == "install ok installed"
    assert provisioned["fresh"].ssh("smol", "uname -n").stdout.strip() == "fresh"  # the hostname role


def test_second_converge_changes_nothing(provisioned):
    again = playbook("-i", str(provisioned["inventory"]), "tests/ansible/fresh_host.yml", *EXTRA, timeout=600)
    r = recap(again.stdout).get("fresh")
    assert again.returncode == 0 and r and r["failed"] == 0, again.stdout[-4000:]
    assert r["changed"] == 0, changed_tasks(again.stdout)


def _connects(port: int, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=timeout):
            return True
    except OSError:
        return False


def test_agent_from_its_unit_measured_by_matrix_through_the_firewall(provisioned):
    """The unit's own ExecStart, as its User, in the fresh root; `smolnet matrix` between this
    machine and the fresh host measures the link with the firewall on; a port outside the
    table stays closed."""
    fresh, work = provisioned["fresh"], provisioned["work"]
    unit = (fresh.root / "etc/systemd/system/smolnet-agent.service").read_text()
    exec_start = re.search(r"(?m)^ExecStart=(.*)$", unit).group(1)
    user = re.search(r"(?m)^User=(.*)$", unit).group(1)
    assert user == "smol" and exec_start.startswith(VENV_PY), unit
    fresh.ssh(user, f"setsid {exec_start} >/tmp/agent.log 2>&1 < /dev/null &")
    table = fresh.ssh("root", "nft list table inet smolcluster").stdout
    assert "policy drop" in table and "7650" in table and "7700-7733" in table, table
    # a listener outside the table: dropped, while the agent's port answers
    fresh.ssh("smol", f"setsid python3 -m http.server 7649 --bind {HOST} >/dev/null 2>&1 < /dev/null &")
    inside = f"python3 -c \"import socket; socket.create_connection(('{HOST}', 7649), 5)\""
    assert fresh.ssh("smol", inside).returncode == 0  # it listens: the firewall is what stops us
    assert _connects(7650) and not _connects(7649)

    inv = work / "matrix.yml"
    inv.write_text(
        provisioned["inventory"]
        .read_text()
        .replace(
            "cluster:\n  hosts:\n",
            f"cluster:\n  hosts:\n    here:\n      ansible_connection: local\n      cluster_ip: {CTL}\n"
            f"      smol_secret_file: {provisioned['secret']}\n",
        )
        .replace("      smol_python:", f"      smol_known_hosts_file: {fresh.known_hosts}\n      smol_python:")
    )
    out = work / "matrix"
    p = subprocess.run(
        [sys.executable, "-m", "smolnet", "matrix", "-i", str(inv), "--duration", "1", "--backend", "builtin"]
        + ["--out", str(out), "--json", str(work / "links.json")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert p.returncode in (0, 4), p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads((work / "links.json").read_text())
    links = {(x["src"], x["dst"]): x for x in report["links"]}
    assert set(links) == {("here", "fresh"), ("fresh", "here")}, links.keys()
    for pair, link in links.items():
        assert link["status"] != "down" and link["throughput_mbit"] > 0, (pair, link)
        assert link["mtu_effective"] and link["rtt_us"]["p50"] > 0, (pair, link)


def test_training_runs_through_the_firewall(provisioned):
    """dp across this machine (rank 0) and the fresh host, whose firewall opens only the ports
    table's: rank 0 listens here on smol_train_port, the fresh host's rank on
    smol_train_port + 2, behind its firewall."""
    fresh, work = provisioned["fresh"], provisioned["work"]
    inv = work / "train.yml"
    inv.write_text(
        provisioned["inventory"]
        .read_text()
        .replace(
            "cluster:\n  hosts:\n",
            f"cluster:\n  hosts:\n    here:\n      ansible_connection: local\n      cluster_ip: {CTL}\n"
            f"      smol_secret_file: {provisioned['secret']}\n      smol_train_port: 7700\n",
        )
        .replace("      smol_python:", f"      smol_known_hosts_file: {fresh.known_hosts}\n      smol_python:")
    )
    p = subprocess.run(
        [sys.executable, "-m", "smoltrain", "run", "--strategy", "dp", "-i", str(inv), "--steps", "2"]
        + ["--batch", "4", "--seq", "16", "--control-port", "7699", "--json", str(work / "run.json")]
        + ["--out", str(work)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=work,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    run = json.loads((work / "run.json").read_text())
    assert run["world_size"] == 2 and len(run["steps"]) == 2, run.keys()
