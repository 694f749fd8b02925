"""A host whose root is a fresh minimal Debian: what a new Pi or server is before provisioning.

mmdebstrap (minbase, plus what an OS image ships: python3, openssh-server, sudo, iproute2)
makes the root once into a cache outside the repository (SMOL_TEST_CACHE, default
/var/cache/smolcluster-tests); each test run unpacks a fresh copy. sshd runs chrooted into it, in
a network namespace of its own (a veth to this machine, NAT for apt and pip) and private UTS and
mount namespaces, so the host's hostname, mounts and firewall are its own. Nothing here touches
the repository; `down` removes the namespace, the NAT and the copy.
"""

from __future__ import annotations

import fcntl
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

SUITE = "bookworm"
IMAGE_PACKAGES = "openssh-server,python3,sudo,iproute2,ca-certificates"
NS, VETH, NET = "smolfresh", "smolfresh0", "10.213.40"
CTL, HOST = f"{NET}.1", f"{NET}.2"
WHEELS = "/opt/wheels"  # this machine's local torch wheel, bound read-only into the root


def mirror() -> list[str]:
    """The archive this machine's own apt is set up with, for mmdebstrap (none found: mmdebstrap's
    default), so the root is built from where this machine already gets its packages."""
    for f in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        for stanza in f.read_text().split("\n\n"):
            fields = dict(
                line.split(":", 1) for line in stanza.splitlines() if ":" in line and not line.startswith("#")
            )
            if SUITE in fields.get("Suites", "").split() and fields.get("URIs", "").strip():
                return [fields["URIs"].split()[0]]
    try:
        for line in Path("/etc/apt/sources.list").read_text().splitlines():
            words = line.split()
            if len(words) >= 3 and words[0] == "deb" and words[2] == SUITE and not words[1].startswith("["):
                return [words[1]]
    except OSError:
        pass
    return []


def cache_dir() -> Path:
    d = Path(os.environ.get("SMOL_TEST_CACHE", "/var/cache/smolcluster-tests"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def image() -> Path:
    """The cached root as a tarball, made by mmdebstrap on first use (under a lock). mmdebstrap
    rather than debootstrap: it writes the tarball itself and took 26 s where debootstrap took 45
    and its tar a few more (2026-12-07), which a fresh machine's test run pays."""
    d = cache_dir()
    tar = d / f"debian-{SUITE}-minbase.tar"
    with open(d / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if tar.exists():
            return tar
        tmp = d / f"root.{os.getpid()}.tar"
        p = subprocess.run(
            ["mmdebstrap", "--variant=minbase", f"--include={IMAGE_PACKAGES}", SUITE, str(tmp), *mirror()],
            capture_output=True,
            text=True,
            timeout=900,
        )
        if p.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"mmdebstrap failed: {p.stdout[-2000:]}{p.stderr[-2000:]}")
        tmp.rename(tar)
        return tar


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=check)


SSHD = """\
ListenAddress {host}
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UseDNS no
PrintMotd no
LogLevel ERROR
"""


class FreshHost:
    """up(): unpack, network, sshd; down(): undo all of it. The controller logs in as root with
    `key`, as a fresh image's first user would, until playbooks/user.yml has made `smol`."""

    def __init__(self, work: Path):
        self.work, self.root = work, work / "root"
        self.key = work / "id_ed25519"
        self.known_hosts = work / "known_hosts"
        self.pid: int | None = None
        self._forward = None
        self._mounted = False

    def up(self) -> FreshHost:
        self.root.mkdir(parents=True)
        # in memory: unpacking, installing and removing ~1.5 GB of small files on disk took minutes
        _sh("mount", "-t", "tmpfs", "-o", "size=6g,mode=0755", "smolfresh", str(self.root))
        self._mounted = True
        subprocess.run(["tar", "-C", str(self.root), "-xf", str(image())], check=True, timeout=300)
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key))
        ssh = self.root / "root" / ".ssh"
        ssh.mkdir(mode=0o700, parents=True, exist_ok=True)
        shutil.copy(f"{self.key}.pub", ssh / "authorized_keys")
        (self.root / "etc/ssh/sshd_config.d/smolfresh.conf").write_text(SSHD.format(host=HOST))
        shutil.copy("/etc/resolv.conf", self.root / "etc/resolv.conf")
        # this network's CA bundle: its proxy signs the mirrors' certificates
        shutil.copy("/etc/ssl/certs/ca-certificates.crt", self.root / "etc/ssl/certs/ca-certificates.crt")
        (self.root / "etc/hostname").write_text("debian\n")
        pub = (self.root / "etc/ssh/ssh_host_ed25519_key.pub").read_text().split()[:2]
        self.known_hosts.write_text(f"{HOST} {' '.join(pub)}\n")
        pip_cache = cache_dir() / "pip"
        pip_cache.mkdir(exist_ok=True)
        pip_cache.chmod(0o1777)
        self._network()
        mounts = [
            f"mount -t proc proc {self.root}/proc",
            f"mount -t sysfs sysfs {self.root}/sys",
            f"mount --rbind /dev {self.root}/dev",
            f"mount -t tmpfs tmpfs {self.root}/run",
            f"mkdir -p {self.root}{WHEELS} {self.root}/var/cache/smol-pip {self.root}/run/sshd",
            f"mount --bind -o ro {WHEELS} {self.root}{WHEELS}",
            f"mount --bind {pip_cache} {self.root}/var/cache/smol-pip",
            "hostname debian",
            f"exec chroot {self.root} /usr/sbin/sshd -D -e",
        ]
        script = "set -e; " + "; ".join(mounts)
        with open(self.work / "sshd.log", "w") as log:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", NS, "unshare", "--mount", "--propagation", "private", "--uts"]
                + ["sh", "-c", script],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pid = proc.pid
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"sshd in the fresh root exited: {(self.work / 'sshd.log').read_text()[-2000:]}")
            if self.ssh("root", "true", check=False).returncode == 0:
                return self
            time.sleep(0.3)
        raise RuntimeError(f"sshd in the fresh root never answered: {(self.work / 'sshd.log').read_text()[-2000:]}")

    def _network(self) -> None:
        self._teardown_network()
        _sh("ip", "netns", "add", NS)
        _sh("ip", "link", "add", VETH, "type", "veth", "peer", "name", "eth0", "netns", NS)
        _sh("ip", "addr", "add", f"{CTL}/24", "dev", VETH)
        _sh("ip", "link", "set", VETH, "up")
        for argv in (
            ["addr", "add", f"{HOST}/24", "dev", "eth0"],
            ["link", "set", "eth0", "up"],
            ["link", "set", "lo", "up"],
            ["route", "add", "default", "via", CTL],
        ):
            _sh("ip", "-n", NS, *argv)
        # apt and pip reach the mirrors through this machine
        self._forward = Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
        _sh("nft", "add", "table", "ip", NS)
        _sh("nft", "add", "chain", "ip", NS, "post", "{ type nat hook postrouting priority 100; }")
        _sh("nft", "add", "rule", "ip", NS, "post", "ip", "saddr", f"{NET}.0/24", "oifname", "!=", VETH, "masquerade")

    def _teardown_network(self) -> None:
        _sh("nft", "delete", "table", "ip", NS, check=False)
        _sh("ip", "link", "del", VETH, check=False)
        _sh("ip", "netns", "del", NS, check=False)

    def down(self) -> None:
        if self.pid:
            try:
                os.killpg(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        # the agent and anything else started over SSH run in the namespace: end them there
        pids = _sh("ip", "netns", "pids", NS, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        if self._forward is not None:
            Path("/proc/sys/net/ipv4/ip_forward").write_text(self._forward + "\n")
        self._teardown_network()
        if self._mounted:  # the sshd's private copy of this mount goes with its last process
            _sh("umount", "--lazy", str(self.root), check=False)
        shutil.rmtree(self.root, ignore_errors=True)

    def ssh(self, user: str, command: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        argv = [
            "ssh",
            "-i",
            str(self.key),
            "-o",
            f"UserKnownHostsFile={self.known_hosts}",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            "BatchMode=yes",
            "-o",
            "ConnectTimeout=5",
            f"{user}@{HOST}",
            command,
        ]
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if check and p.returncode != 0:
            raise RuntimeError(f"ssh {user}@{HOST} {shlex.quote(command)}: rc {p.returncode}: {p.stderr[-1500:]}")
        return p
