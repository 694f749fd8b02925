"""The inventory loader: Ansible's precedence resolved once, every bad input one clear line."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from smolnet.inventory import InventoryError, load_inventory

ROOT = Path(__file__).resolve().parents[1]


def write(base: Path, rel: str, text: str) -> Path:
    p = base / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(textwrap.dedent(text))
    return p


GOOD = """\
all:
  vars:
    smol_agent_port: 7800
  children:
    cluster:
      hosts:
        alpha:
          ansible_host: 192.0.2.10
          ansible_user: pi
          ansible_ssh_private_key_file: ~/.ssh/smol
          mtu: 9000
          link_rate_mbit: 2500
          device: pi5
        beta:
          ansible_host: beta.lan
          cluster_ip: 192.0.2.11
          ansible_port: 2222
          device: jetson-orin-nano
          smol_device: cuda
        gamma:
          ansible_connection: local
    coordinator:
      hosts:
        beta:
    nfs_server:
      hosts:
        alpha:
      vars:
        nfs_export_dir: /srv/weights
"""


def test_yaml_inventory_resolves_and_defaults(tmp_path):
    inv = load_inventory(write(tmp_path, "hosts.yml", GOOD))
    assert [h.name for h in inv.hosts] == ["alpha", "beta", "gamma"]
    a, b, g = inv.hosts
    assert (a.address, a.cluster_ip, a.user, a.mtu, a.link_rate_mbit, a.device) == (
        "192.0.2.10",
        "192.0.2.10",
        "pi",
        9000,
        2500.0,
        "pi5",
    )
    assert a.key_file == str(Path("~/.ssh/smol").expanduser())
    assert (b.address, b.cluster_ip, b.port, b.torch_device) == ("beta.lan", "192.0.2.11", 2222, "cuda")
    assert g.local and g.address == "127.0.0.1" and g.mtu == 1500 and g.link_rate_mbit is None
    assert g.device == "generic" and g.python == sys.executable and g.train_port == 7700  # local: this interpreter
    assert all(h.agent_port == 7800 for h in inv.hosts)  # all-group var
    assert inv.coordinator.name == "beta" and inv.nfs_server.name == "alpha"
    assert inv.nfs_export_dir == "/srv/weights" and inv.nfs_mount_dir == "/mnt/models"
    assert inv.select(["gamma", "alpha"])[1].name == "alpha"
    with pytest.raises(InventoryError, match="no host named 'zeta'"):
        inv.host("zeta")


def test_group_vars_and_host_vars_dirs(tmp_path):
    path = write(
        tmp_path,
        "inv/hosts.yml",
        """\
        cluster:
          hosts:
            n1: {ansible_host: 192.0.2.1}
            n2: {ansible_host: 192.0.2.2}
        """,
    )
    write(tmp_path, "inv/group_vars/cluster.yml", "mtu: 9000\ndevice: mac-mini-m4\nsmol_python: /opt/smol/bin/python\n")
    write(tmp_path, "inv/host_vars/n2.yml", "mtu: 1500\nlink_rate_mbit: 1000\n")
    inv = load_inventory(path)
    n1, n2 = inv.hosts
    assert (n1.mtu, n1.device, n1.python, n1.link_rate_mbit) == (9000, "mac-mini-m4", "/opt/smol/bin/python", None)
    assert (n2.mtu, n2.device, n2.link_rate_mbit) == (1500, "mac-mini-m4", 1000.0)  # host_vars win
    assert inv.coordinator.name == "n1" and inv.nfs_server is None


def test_ini_inventory(tmp_path):
    inv = load_inventory(
        write(
            tmp_path,
            "hosts.ini",
            """\
        [cluster]
        a ansible_host=192.0.2.1 mtu=9000
        b ansible_host=192.0.2.2 device=pi4
        [cluster:vars]
        link_rate_mbit=1000
        """,
        )
    )
    assert [(h.name, h.mtu, h.device, h.link_rate_mbit) for h in inv.hosts] == [
        ("a", 9000, "generic", 1000.0),
        ("b", 1500, "pi4", 1000.0),
    ]


def test_host_key_checking_follows_ssh_args(tmp_path):
    inv = load_inventory(
        write(
            tmp_path,
            "hosts.yml",
            """\
        cluster:
          hosts:
            a:
              ansible_host: 192.0.2.1
              ansible_ssh_common_args: -o UserKnownHostsFile=/tmp/kh -o StrictHostKeyChecking=yes
            b:
              ansible_host: 192.0.2.2
              ansible_ssh_common_args: -o StrictHostKeyChecking=no
        """,
        )
    )
    a, b = inv.hosts
    assert a.host_key_checking and a.known_hosts_file == "/tmp/kh"
    assert not b.host_key_checking


def test_ssh_arg_spellings(tmp_path):
    """`-o Key value` is as valid for ssh as `-o Key=value`; both must be understood."""
    inv = load_inventory(
        write(
            tmp_path,
            "hosts.ini",
            """\
        [cluster]
        a ansible_host=192.0.2.1 ansible_ssh_common_args="-o StrictHostKeyChecking no"
        b ansible_host=192.0.2.2 ansible_ssh_extra_args="-o UserKnownHostsFile /tmp/kh2 -o StrictHostKeyChecking=Off"
        c ansible_host=192.0.2.3 ansible_ssh_common_args="-o StrictHostKeyChecking=accept-new"
        """,
        )
    )
    a, b, c = inv.hosts
    assert not a.host_key_checking and not b.host_key_checking and c.host_key_checking
    assert b.known_hosts_file == "/tmp/kh2"


def test_address_from_name_or_cluster_ip(tmp_path):
    """Ansible connects to the inventory name when ansible_host is unset: an IP name is an address."""
    inv = load_inventory(
        write(
            tmp_path,
            "hosts.ini",
            """\
        [cluster]
        192.0.2.5
        n2 cluster_ip=192.0.2.6
        """,
        )
    )
    assert [(h.name, h.address, h.cluster_ip) for h in inv.hosts] == [
        ("192.0.2.5", "192.0.2.5", "192.0.2.5"),
        ("n2", "192.0.2.6", "192.0.2.6"),
    ]
    with pytest.raises(InventoryError, match=r"host b: ansible_host 'b\.lan' is not an IP address; set cluster_ip"):
        load_inventory(write(tmp_path, "dns.ini", "[cluster]\nb ansible_host=b.lan\n"))


def test_shipped_example_loads():
    example = ROOT / "inventory" / "hosts.example.yml"
    assert load_inventory(example).hosts


BAD = {
    "empty cluster group": (
        "cluster:\n  hosts: {}\nothers:\n  hosts:\n    x: {ansible_host: 192.0.2.9}\n",
        r"group 'cluster' is empty or missing",
    ),
    "no cluster group": (
        "others:\n  hosts:\n    x: {ansible_host: 192.0.2.9}\n",
        r"group 'cluster' is empty or missing",
    ),
    "host without address": ("cluster:\n  hosts:\n    lonely: {mtu: 1500}\n", r"host lonely: no address"),
    "duplicate cluster_ip": (
        "cluster:\n  hosts:\n    a: {ansible_host: 192.0.2.1}\n    b: {ansible_host: b.lan, cluster_ip: 192.0.2.1}\n",
        r"hosts a and b share cluster_ip 192\.0\.2\.1",
    ),
    "unknown device": (
        "cluster:\n  hosts:\n    a: {ansible_host: 192.0.2.1, device: toaster}\n",
        r"host a: unknown device profile 'toaster'",
    ),
    "mtu not a number": (
        "cluster:\n  hosts:\n    a: {ansible_host: 192.0.2.1, mtu: jumbo}\n",
        r"host a: mtu must be an integer, got 'jumbo'",
    ),
    "mtu too small": (
        "cluster:\n  hosts:\n    a: {ansible_host: 192.0.2.1, mtu: 100}\n",
        r"host a: mtu 100 is outside 576\.\.65535",
    ),
    "mtu too large": (
        "cluster:\n  hosts:\n    a: {ansible_host: 192.0.2.1, mtu: 70000}\n",
        r"host a: mtu 70000 is outside",
    ),
    "mtu boolean": (
        "cluster:\n  hosts:\n    a: {ansible_host: 192.0.2.1, mtu: true}\n",
        r"host a: mtu must be an integer",
    ),
    "cluster_ip not an address": (
        "cluster:\n  hosts:\n    a: {ansible_host: 192.0.2.1, cluster_ip: nowhere}\n",
        r"host a: cluster_ip 'nowhere' is not an IP address",
    ),
    "negative rate": (
        "cluster:\n  hosts:\n    a: {ansible_host: 192.0.2.1, link_rate_mbit: -5}\n",
        r"host a: link_rate_mbit must be positive",
    ),
    "two coordinators": (
        "cluster:\n  hosts:\n    a: {ansible_host: 192.0.2.1}\n    b: {ansible_host: 192.0.2.2}\n"
        "coordinator:\n  hosts:\n    a:\n    b:\n",
        r"group 'coordinator' has 2 hosts",
    ),
    "bad nfs impl": (
        "cluster:\n  hosts:\n    a: {ansible_host: 192.0.2.1, nfs_server_impl: samba}\n",
        r"nfs_server_impl must be kernel or ganesha",
    ),
    "not an inventory": ("just some text\n", r"no hosts found|cannot parse|group 'cluster'"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_inventory_is_one_clear_line(tmp_path, case):
    text, pattern = BAD[case]
    with pytest.raises(InventoryError, match=pattern) as e:
        load_inventory(write(tmp_path, "hosts.yml", text))
    assert "\n" not in str(e.value)


def test_malformed_yaml_is_one_line_without_ansible_warnings(tmp_path):
    """Ansible warns once per plugin it tried (~20 lines) before giving up; we say it once."""
    import subprocess

    bad = write(tmp_path, "hosts.yml", "cluster:\n  hosts:\n    a: {ansible_host: 192.0.2.1\n   b: [\n")
    r = subprocess.run(
        [sys.executable, "-m", "smolnet", "inventory", "-i", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot parse inventory" in lines[0] and "line 4, column 5" in lines[0], r.stderr


def test_missing_file_points_at_example(tmp_path):
    with pytest.raises(InventoryError, match=r"no such inventory \(copy inventory/hosts\.example\.yml"):
        load_inventory(tmp_path / "nope.yml")


def test_bad_host_vars_file_names_the_host(tmp_path):
    path = write(tmp_path, "inv/hosts.yml", "cluster:\n  hosts:\n    a: {ansible_host: 192.0.2.1}\n")
    write(tmp_path, "inv/host_vars/a.yml", "mtu: 12\n")
    with pytest.raises(InventoryError, match=r"host a: mtu 12 is outside"):
        load_inventory(path)


def test_loading_an_inventory_leaves_torch_usable():
    """Ansible patches sys.intern process-wide; torch's optimizers refuse the patched one."""
    import sys

    from smolnet.inventory import load_inventory

    original = sys.intern
    load_inventory(Path(__file__).resolve().parents[1] / "inventory" / "hosts.example.yml")
    assert sys.intern is original
    import torch

    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
