"""Provisioning on the sim: lint, converge, idempotence, check mode, `make verify`, and the
jumbo-MTU refusal on the sim's mismatched host (iface 9000, switch port 1500).

One sim (name a1, 10.213.21.0/24) for the whole module. Its inventory is copied into a
temporary directory with two overrides: the laptop's `mtu` is 1500 (its port carries no
more) and the model share lives in the temporary directory, so nothing outside is touched.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from need import sim_up
from provisiontools import BIN, REPO, ansible_env, changed_tasks, ns_run, playbook, recap

# Converging four hosts takes minutes on a busy 2-core machine; the fixture's time counts
# against the first test that uses it.
pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

SIM, SUBNET = "a1", "10.213.21.0/24"
HOSTS = ("pi5", "jetson", "macmini", "laptop")
TARGET_MTU = {"pi5": 1500, "jetson": 1500, "macmini": 9000, "laptop": 1500}


def test_lint_production_profile_offline():
    """ansible-lint runs with the production profile, offline. Whether the playbooks pass it is
    `make lint`'s gate (`ansible-lint playbooks/`, which CI runs before the tests; that it is a
    gate there: test_lint_gates.test_make_lint_runs_every_gate), not run a second time here."""
    import yaml

    cfg = yaml.safe_load((REPO / ".ansible-lint").read_text())
    assert cfg["profile"] == "production" and cfg["offline"] is True


def test_syntax_check_on_the_example_inventory():
    p = playbook(
        "-i", "inventory/hosts.example.yml", "--syntax-check", "playbooks/site.yml", "playbooks/verify.yml", timeout=120
    )
    assert p.returncode == 0, p.stdout[-3000:]


def test_example_inventory_is_the_reference_cluster():
    from smolnet.inventory import load_inventory

    inv = load_inventory(REPO / "inventory/hosts.example.yml")
    devices = {h.name: h.device for h in inv.hosts}
    assert devices == {"pi5": "pi5", "jetson": "jetson-orin-nano", "laptop": "rtx4050-laptop", "macmini": "mac-mini-m4"}
    assert inv.nfs_server is not None and inv.coordinator.name == "macmini"
    assert all(h.address.startswith("192.0.2.") for h in inv.hosts)  # documentation addresses only


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from smolnet.sim import cluster as sim

    d = tmp_path_factory.mktemp("provision")
    inv = d / "hosts.yml"
    # uncapped: provisioning is not what the CPU caps test, and Ansible under a 0.15-core cap
    # takes minutes per converge
    st = sim_up(sim, name=SIM, subnet=SUBNET, inventory=str(inv), cpu_limit="0")
    try:
        export = d / "models"
        (d / "host_vars").mkdir()
        (d / "host_vars" / "laptop.yml").write_text("mtu: 1500\n")
        (d / "group_vars").mkdir()
        (d / "group_vars" / "cluster.yml").write_text(
            f"nfs_export_dir: {export}\nnfs_server_ganesha_state_dir: {d / 'ganesha'}\n"
            # The sim's hosts share this machine's files: the project is installed already.
            "smolcluster_install: false\n"
        )
        yield {
            "dir": d,
            "inventory": str(inv),
            "export": export,
            "state": st,
            "ns": {h["name"]: h["netns"] for h in st["hosts"]},
            "addr": {h["name"]: h["address"] for h in st["hosts"]},
        }
    finally:
        sim.down(name=SIM)


@pytest.fixture(scope="module")
def converged(cluster):
    first = playbook("-i", cluster["inventory"], "playbooks/site.yml")
    r = recap(first.stdout)
    assert first.returncode == 0 and set(r) == set(HOSTS), first.stdout[-6000:]
    assert all(v["failed"] == 0 and v["unreachable"] == 0 for v in r.values()), r
    return cluster


def test_second_converge_changes_nothing(converged):
    """Idempotence: a converge over the converged cluster changes nothing on any host."""
    again = playbook("-i", converged["inventory"], "playbooks/site.yml")
    r = recap(again.stdout)
    assert again.returncode == 0 and set(r) == set(HOSTS), again.stdout[-6000:]
    assert {h: v["changed"] for h, v in r.items()} == {h: 0 for h in HOSTS}, changed_tasks(again.stdout)


def test_check_mode_after_converge_changes_nothing(converged):
    """`--check --diff` on the converged cluster runs every role to the end and predicts no change
    (a separate guarantee from idempotence: check mode's own paths, e.g. skipped installs)."""
    check = playbook("-i", converged["inventory"], "playbooks/site.yml", "--check", "--diff")
    r = recap(check.stdout)
    assert check.returncode == 0 and set(r) == set(HOSTS), check.stdout[-6000:]
    assert {h: v["changed"] for h, v in r.items()} == {h: 0 for h in HOSTS}, changed_tasks(check.stdout)


def test_verify_passes_from_the_hosts(converged):
    """verify.yml: names, getent, SSH by name for every pair, DF pings, secret, NFS read and refused write."""
    p = playbook("-i", converged["inventory"], "playbooks/verify.yml", "-v")
    r = recap(p.stdout)
    assert p.returncode == 0 and set(r) == set(HOSTS), p.stdout[-6000:]
    assert "NFS4ERR_ROFS" in p.stdout  # the write was refused by the server, not skipped
    assert p.stdout.count("StrictHostKeyChecking=yes") >= len(HOSTS)


def test_hosts_state_seen_directly(converged):
    """Independent of the playbooks: look at each host over SSH and in its namespace."""
    from smolnet.inventory import load_inventory
    from smolnet.remote import connect

    inv = load_inventory(converged["inventory"])
    secrets = set()
    names = [h.name for h in inv.hosts]
    for h in inv.hosts:
        with connect(h) as rem:
            facts = rem.run(
                ["sh", "-c", 'uname -n; cat /etc/hostname; stat -c %a "$1"; sha256sum "$1"', "sh", h.secret_file]
            ).stdout.split()
            assert facts[:3] == [h.name, h.name, "600"], (h.name, facts)
            secrets.add(facts[3])
            resolved = {}
            for line in rem.run(["getent", "hosts", *names]).stdout.splitlines():
                addr, *aliases = line.split()
                resolved.update({a: addr for a in aliases})
            assert resolved == {p.name: p.cluster_ip for p in inv.hosts}, (h.name, resolved)
            for peer in inv.hosts:
                if peer.name != h.name:
                    res = rem.run(
                        [
                            "ssh",
                            "-o",
                            "BatchMode=yes",
                            "-o",
                            "StrictHostKeyChecking=yes",
                            "-o",
                            "ConnectTimeout=10",
                            peer.name,
                            "uname -n",
                        ],
                        timeout=30,
                    )
                    assert res.rc == 0 and res.stdout.strip() == peer.name, (h.name, peer.name, res.stderr)
        mtu = ns_run(converged["ns"][h.name], ["cat", "/sys/class/net/eth0/mtu"]).stdout.strip()
        assert int(mtu) == TARGET_MTU[h.name], (h.name, mtu)
    assert len(secrets) == 1


def test_nfs_share_read_only_over_nfsv4(converged):
    """libnfs from a client host: the marker reads back, a write is refused."""
    export, ns, server = converged["export"], converged["ns"]["jetson"], converged["addr"]["pi5"]
    url = f"nfs://{server}{export}/.smolcluster?version=4"
    p = ns_run(ns, ["nfs-cat", url])
    assert p.returncode == 0 and p.stdout == "smolcluster model share on pi5\n", p.stderr
    w = ns_run(ns, ["nfs-cp", "/etc/hostname", f"nfs://{server}{export}/written?version=4"])
    assert w.returncode != 0 and not (export / "written").exists()


def test_jumbo_mtu_on_the_mismatched_host_is_refused(converged):
    """laptop: iface takes 9000, its switch port carries 1500. With `mtu: 9000` the play
    refuses, names host and peer, and leaves the laptop reachable at an MTU its path carries.
    Only the pair runs (`--limit laptop,macmini`, the MTU role alone): the check is per pair,
    and the pi5 and jetson paths were proven by the converge."""
    hv = converged["dir"] / "host_vars" / "laptop.yml"
    hv.write_text("mtu: 9000\n")
    try:
        seen = subprocess.run(
            [str(BIN / "ansible-inventory"), "-i", converged["inventory"], "--host", "laptop"],
            cwd=REPO,
            env=ansible_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert json.loads(seen.stdout)["mtu"] == 9000, seen.stdout + seen.stderr
        p = playbook("-i", converged["inventory"], "playbooks/site.yml", "--tags", "mtu", "--limit", "laptop,macmini")
    finally:
        hv.write_text("mtu: 1500\n")
    assert p.returncode != 0, p.stdout[-8000:]
    assert recap(p.stdout)["laptop"]["failed"] == 1, p.stdout[-4000:]
    assert "MTU error: laptop" in p.stdout and "path to macmini" in p.stdout, p.stdout[-4000:]
    ns = converged["ns"]
    mtu = int(ns_run(ns["laptop"], ["cat", "/sys/class/net/eth0/mtu"]).stdout)
    assert mtu == 1500
    # macmini was not changed in this run, so it keeps its jumbo MTU.
    assert int(ns_run(ns["macmini"], ["cat", "/sys/class/net/eth0/mtu"]).stdout) == 9000
    # The laptop still answers Ansible and carries full 1500-byte frames both ways.
    ping = subprocess.run(
        [str(BIN / "ansible"), "-i", converged["inventory"], "laptop", "-m", "ansible.builtin.ping"],
        cwd=REPO,
        env=ansible_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ping.returncode == 0, ping.stdout + ping.stderr
    addr = converged["addr"]
    for src, dst in (("laptop", "macmini"), ("macmini", "laptop")):
        q = ns_run(ns[src], ["ping", "-M", "do", "-s", "1472", "-c", "2", "-i", "0.2", "-W", "2", addr[dst]])
        assert q.returncode == 0, (src, dst, q.stdout)
