"""Building a netns sim: switch, veths, shaping, overlays, host keys and sshd per host.

Split from cluster.py (which decides, locks and records; this module only makes things) so
each stays small. It saves state.json as it goes, so `down` can undo a
half-built sim.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from pathlib import Path

from smolnet.files import write_text_atomic
from smolnet.sim import cgroup, net
from smolnet.sim.net import SimError
from smolnet.sim.scenarios import HostSpec

SSHD_TIMEOUT = 20.0
CONTROLLER_MTU = 1500  # management path: SSH must work even to a host with a jumbo mismatch
# A host's own shell start-up files, over the machine's in its /root overlay. sshd runs every
# command through root's bash, which reads ~/.bashrc: the machine's is the controller's own
# (here pyenv and cargo set-up, ~0.1 CPU s a command: ~0.7 s on the 0.15-core Pi, a third of
# each Ansible task there). A Pi runs its own, not the controller's; commands name their
# interpreters by path (the inventory's `python`), so nothing needs the controller's PATH.
SHELL_RC = "# a smolnet sim host's own (smolnet/sim/build.py SHELL_RC): not the machine's\n"

_write_atomic = write_text_atomic


def _save(st: dict) -> None:
    _write_atomic(Path(st["state_dir"]) / "state.json", json.dumps(st, indent=2) + "\n")


def _ed25519_pair(comment: str) -> tuple[str, str]:
    """(private key in OpenSSH format, public key line); no ssh-keygen process needed."""
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    k = Ed25519PrivateKey.generate()
    priv = k.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.OpenSSH, ser.NoEncryption()).decode()
    pub = k.public_key().public_bytes(ser.Encoding.OpenSSH, ser.PublicFormat.OpenSSH).decode()
    return priv, f"{pub} {comment}"


def _opaque(upper_dir: Path) -> None:
    """Hide the machine's own /root/.ssh from a host: the controller's keys and known_hosts
    are not the host's, and a provisioning run must not find (and reuse) them."""
    try:
        os.setxattr(upper_dir, "trusted.overlay.opaque", b"y")
    except OSError as e:
        from smolnet.sim.cluster import STATE_ROOT  # read late: tests point it elsewhere

        raise SimError(
            f"cannot mark {upper_dir} opaque for overlayfs ({e.strerror}); "
            f"is {STATE_ROOT} on a filesystem with trusted xattrs?"
        ) from None


def _etc_hosts(host: str, address: str) -> str:
    return f"127.0.0.1\tlocalhost\n127.0.1.1\t{host}\n{address}\t{host}\n::1\tlocalhost ip6-localhost ip6-loopback\n"


def _build(st: dict, specs: list[HostSpec]) -> None:
    d = Path(st["state_dir"])
    sw, prefix, name = st["switch_netns"], st["prefix"], st["name"]
    ctl_priv, ctl_pub = _ed25519_pair(f"smolnet-sim-{name}-controller")
    _write_atomic(d / "id_ed25519", ctl_priv, 0o600)
    _write_atomic(d / "id_ed25519.pub", ctl_pub + "\n")
    known = []

    net.netns_add(sw)
    max_port = max([s.port_mtu for s in specs] + [CONTROLLER_MTU])
    net.ipn(sw, "link", "add", "br0", "mtu", str(max_port), "type", "bridge")
    net.ipn(sw, "link", "set", "br0", "up")
    for h, s in zip(st["hosts"], specs):
        ns, port = h["netns"], f"p{h['index']}"
        net.netns_add(ns)
        net.ipn(
            None,
            "link",
            "add",
            "eth0",
            "netns",
            ns,
            "mtu",
            str(s.mtu),
            "type",
            "veth",
            "peer",
            "name",
            port,
            "netns",
            sw,
            "mtu",
            str(s.port_mtu),
        )
        net.ipn(ns, "addr", "add", f"{h['address']}/{prefix}", "dev", "eth0")
        net.ipn(sw, "link", "set", port, "master", "br0")
        net.offloads_off(ns, "eth0")
        net.offloads_off(sw, port)
        net.shape(ns, "eth0", s.up_mbit, s.mtu, peak=s.link_peak)  # upload: host egress
        net.shape(sw, port, s.down_mbit, s.port_mtu, burst_ms=25, peak=s.link_peak)  # download: switch-port egress
        net.ipn(sw, "link", "set", port, "up")
        net.ipn(ns, "link", "set", "eth0", "up")
        h["port"] = port

        hd = d / "hosts" / s.name
        for sub in ("etc", "etc.work", "root", "root.work"):
            (hd / sub).mkdir(parents=True, mode=0o755)
        _write_atomic(hd / "etc" / "hostname", s.name + "\n")
        _write_atomic(hd / "etc" / "hosts", _etc_hosts(s.name, h["address"]))
        (hd / "root").chmod(0o700)
        for rc in (".bashrc", ".profile"):  # see SHELL_RC
            _write_atomic(hd / "root" / rc, SHELL_RC, 0o644)
        (hd / "root" / ".ssh").mkdir(mode=0o700)
        _opaque(hd / "root" / ".ssh")
        _write_atomic(hd / "root" / ".ssh" / "authorized_keys", ctl_pub + "\n", 0o600)
        priv, pub = _ed25519_pair(f"root@{s.name}")
        _write_atomic(hd / "ssh_host_ed25519_key", priv, 0o600)
        _write_atomic(hd / "ssh_host_ed25519_key.pub", pub + "\n")
        known.append(f"{s.name},{h['address']} {' '.join(pub.split()[:2])}")
        _write_atomic(
            hd / "sshd_config",
            net.SSHD_CONFIG.format(
                host=s.name, address=h["address"], host_key=hd / "ssh_host_ed25519_key", pid_file=hd / "sshd.pid"
            ),
        )
    _write_atomic(d / "known_hosts", "\n".join(known) + "\n")

    ctl = st["controller_iface"]
    net.ipn(
        None,
        "link",
        "add",
        ctl,
        "mtu",
        str(CONTROLLER_MTU),
        "type",
        "veth",
        "peer",
        "name",
        "pc",
        "netns",
        sw,
        "mtu",
        str(CONTROLLER_MTU),
    )
    net.ipn(sw, "link", "set", "pc", "master", "br0")
    net.ipn(sw, "link", "set", "pc", "up")
    net.ipn(None, "addr", "add", f"{st['controller']}/{prefix}", "dev", ctl)
    net.ipn(None, "link", "set", ctl, "up")
    # Set after the ports join: a bridge follows its smallest port unless told otherwise.
    net.ipn(sw, "link", "set", "br0", "mtu", str(max_port))
    for h in st["hosts"]:
        net.steer_flows(h["netns"], ["eth0"])
    net.steer_flows(sw, [h["port"] for h in st["hosts"]] + ["pc"])
    _save(st)

    cg_mount = cgroup.mount_lines() if any(h.get("cpu_cores") for h in st["hosts"]) else []
    for h in st["hosts"]:
        hd = d / "hosts" / h["name"]
        join = cgroup.host_groups(name, h, SimError)  # entered before sshd runs: sessions inherit them
        _save(st)
        extra = cg_mount + (_own_machine(hd) if h.get("own_machine") else [])
        net.start_sshd(h["netns"], h["name"], hd, hd / "sshd.log", extra, join, bool(h.get("cpu_hidden")))
    deadline = time.monotonic() + SSHD_TIMEOUT
    for h in st["hosts"]:
        hd = d / "hosts" / h["name"]
        h["pid_sshd"] = net.wait_sshd(h["name"], h["address"], hd / "sshd.pid", hd / "sshd.log", deadline)
        _save(st)


def _own_machine(hd: Path) -> list[str]:
    """Shell lines giving a host a machine identity of its own (kernel boot id and
    /etc/machine-id), so calibration and the planner treat it as its own machine, not as one
    of several hosts sharing this one's cores."""
    import uuid

    boot = uuid.uuid4()
    _write_atomic(hd / "boot_id", f"{boot}\n")
    _write_atomic(hd / "etc" / "machine-id", f"{boot.hex}\n")
    return [f"mount --bind {shlex.quote(str(hd / 'boot_id'))} /proc/sys/kernel/random/boot_id"]
