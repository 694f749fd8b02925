"""Namespace plumbing for the sim: netns, veth, bridge, tc shaping, per-host sshd.

Thin wrappers around `ip`, `tc`, `ethtool` and `sshd`, each with a timeout and a
one-line error, so smolnet/sim/cluster.py reads as the recipe rather than the mechanics.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from smolnet.errors import SmolError

IP = "ip"
CMD_TIMEOUT = 20.0


class SimError(SmolError):
    """The sim could not be built, found or torn down."""


class SimUnavailable(SimError):
    """This machine cannot run namespaced hosts (no root, no netns, missing tools)."""


def sh(
    argv: list[str], timeout: float = CMD_TIMEOUT, check: bool = True, stdin: bytes | None = None
) -> subprocess.CompletedProcess:
    """Run one tool; a failure is a SimError naming the command and its stderr."""
    try:
        p = subprocess.run(argv, input=stdin, capture_output=True, timeout=timeout)
    except FileNotFoundError:
        raise SimUnavailable(f"{argv[0]} is not installed (needed by the sim)") from None
    except subprocess.TimeoutExpired:
        raise SimError(f"timed out after {timeout:g}s: {shlex.join(argv)}") from None
    if check and p.returncode != 0:
        err = p.stderr.decode(errors="replace").strip().splitlines()
        raise SimError(f"{shlex.join(argv)} failed: {err[-1] if err else 'exit ' + str(p.returncode)}")
    return p


def unavailable_reason() -> str | None:
    """Why namespaced hosts cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "the sim needs root for network namespaces (run as root, or use the loopback fallback)"
    for tool in ("ip", "tc", "ethtool", "unshare", "setsid"):
        if not shutil.which(tool):
            return f"{tool} is not installed (apt-get install iproute2 ethtool util-linux)"
    if not os.path.exists("/usr/sbin/sshd"):
        return "/usr/sbin/sshd is missing (apt-get install openssh-server)"
    if not os.path.exists("/proc/self/ns/net") or not os.path.exists("/proc/self/ns/uts"):
        return "this kernel has no network/UTS namespaces"
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "this kernel has no overlay filesystem (modprobe overlay)"
    return None


# --- namespaces and links -------------------------------------------------------------


def netns_list() -> set[str]:
    p = sh([IP, "-j", "netns", "list"], check=False)
    try:
        return {n["name"] for n in json.loads(p.stdout or b"[]")}
    except ValueError:
        return set()


def netns_add(ns: str) -> None:
    sh([IP, "netns", "add", ns])
    sh([IP, "-n", ns, "link", "set", "lo", "up"])


def netns_pids(ns: str) -> list[int]:
    p = sh([IP, "netns", "pids", ns], check=False)
    return [int(x) for x in p.stdout.split() if x.strip().isdigit()]


def netns_del(ns: str) -> None:
    sh([IP, "netns", "del", ns], check=False)


def link_exists(ifname: str, ns: str | None = None) -> bool:
    argv = [IP] + (["-n", ns] if ns else []) + ["link", "show", "dev", ifname]
    return sh(argv, check=False).returncode == 0


def root_routes() -> list[dict]:
    p = sh([IP, "-j", "-4", "route", "show", "table", "all"], check=False)
    try:
        return json.loads(p.stdout or b"[]")
    except ValueError:
        return []


def ipn(ns: str | None, *args: str) -> None:
    sh([IP] + (["-n", ns] if ns else []) + list(args))


def in_ns(ns: str, argv: list[str], **kw) -> subprocess.CompletedProcess:
    """Run argv inside a netns only (nsenter: no extra mount namespace, cheaper than ip netns exec)."""
    return sh(["nsenter", f"--net=/run/netns/{ns}"] + argv, **kw)


def offloads_off(ns: str, ifname: str) -> None:
    """Segmentation offloads pass super-frames across a veth whatever its MTU, which hides
    every MTU fault and bypasses the shaper's per-frame accounting; turn them off."""
    in_ns(ns, ["ethtool", "-K", ifname, "tso", "off", "gso", "off", "gro", "off"], check=False)


PEAK = 1.1  # a shaped link's fastest pace, as a multiple of its rate
PEAK_FRAMES = 16  # frames that may leave back to back at memory speed


def tbf_argv(ifname: str, rate_mbit: float, mtu: int, burst_ms: float = 10.0, peak: bool = False) -> list[str]:
    """The tc command for an egress token bucket of `rate_mbit`.

    The bucket (`burst`) is large: a shaper whose queue drains by timer (a switch port that
    is the bottleneck for a faster sender) loses tokens whenever a busy machine runs its
    timer late; the burst absorbs that delay (measured: 1 ms lost up to 60% under load, 25
    ms nothing) and adds < 1% to a 3 s test. Queue: twice the burst, above what TCP small
    queues let one socket park in it, so the sender's own shaper never drops.

    A large bucket alone lets a link that idled send its whole bucket at memory speed: a
    200 KB message after 30 ms idle crossed a 500 Mbit link in 0.75-0.82 ms (the wire takes
    3.3), so fsdp's and tp's per-layer collectives, with compute in between, ran faster
    than any wire of that rate carries them. `peak` (the `cores` and `hidden` scenarios)
    adds a peak rate, PEAK x the rate, PEAK_FRAMES frames at a time: every transfer goes
    near the rate (3.0-3.3 ms), as on a real link, and the bucket still makes up a late
    timer at the peak's margin (sustained iperf3 under a load of 5.7 on 2 cores: 464-480
    Mbit/s with the peak, 482-484 without, truth 478). It also stops the bucket from hiding
    a CFS-capped sender's stalls: while the sender is throttled its flow stops and the wire
    idles, which a burst afterwards had made up. A 0.15-core `home`
    host then sends at 149-212 Mbit/s on a 1 Gbit link instead of 868-956, so `home`, whose
    tests and plans assume the latter, keeps the plain bucket (docs/compute.md)."""
    bytes_per_s = rate_mbit * 1e6 / 8
    burst = int(max(bytes_per_s * burst_ms / 1000, 4 * (mtu + 14)))
    argv = ["tc", "qdisc", "replace", "dev", ifname, "root", "tbf", "rate", f"{rate_mbit:g}mbit"]
    argv += ["burst", str(burst), "limit", str(2 * burst)]
    if peak:
        argv += ["peakrate", f"{rate_mbit * PEAK:g}mbit", "minburst", str(PEAK_FRAMES * (mtu + 14))]
    return argv


def shape(ns: str, ifname: str, rate_mbit: float | None, mtu: int, burst_ms: float = 10.0, peak: bool = False) -> None:
    """Shape the interface's egress to `rate_mbit` (tbf_argv); None or 0: unshaped."""
    if rate_mbit:
        in_ns(ns, tbf_argv(ifname, rate_mbit, mtu, burst_ms, peak))


def _cpu_mask() -> str:
    """All CPUs in the comma-separated 32-bit hex groups sysfs wants."""
    n = os.cpu_count() or 1
    mask = (1 << n) - 1
    groups = []
    while True:
        groups.append(f"{mask & 0xFFFFFFFF:08x}")
        mask >>= 32
        if not mask:
            break
    return ",".join(reversed(groups))


def steer_flows(ns: str, ifnames: list[str]) -> None:
    """Receive packet steering by flow hash: without it a veth delivers a flow on whichever
    CPU sent each packet, reordering it, and TCP reads reordering as loss."""
    mask = _cpu_mask()
    script = "; ".join(f"echo {mask} > /sys/class/net/{shlex.quote(i)}/queues/rx-0/rps_cpus" for i in ifnames)
    sh([IP, "netns", "exec", ns, "sh", "-c", script], check=False)


# --- per-host sshd ----------------------------------------------------------------------

SSHD_CONFIG = """\
# sshd for sim host {host} (written by smolnet sim up)
ListenAddress {address}
Port 22
HostKey {host_key}
PidFile {pid_file}
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
UseDNS no
PrintMotd no
AuthorizedKeysFile .ssh/authorized_keys
MaxStartups 200:30:400
MaxSessions 100
Subsystem sftp internal-sftp
LogLevel ERROR
"""


def start_sshd(
    ns: str, host: str, d: Path, log: Path, extra: list[str] = (), join: list[str] = (), cgroup_ns: bool = False
) -> None:
    """Launch sshd inside the host's netns plus fresh UTS and mount namespaces.

    Overlays make /etc and /root per host (hostname, /etc/hosts, home) on top of the
    machine's; the host's /root/.ssh is opaque (authorized_keys only), so the controller's
    keys never leak in. /root itself cannot start empty: interpreters (this venv's python
    among them) may live under it. Every SSH session is a child of this sshd, so it
    inherits all three namespaces.
    `join`: cgroup directories the sshd enters before anything else runs (its CPU cap and
    cpuset); `cgroup_ns`: a cgroup namespace rooted there, so the host sees its own cgroup as
    the root and no cap above it.
    `setsid -f` double-forks, so the sshd outlives us and init reaps it.
    """
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    q = shlex.quote
    script = " && ".join(
        [
            f"mount -t overlay smol-etc -o lowerdir=/etc,upperdir={q(str(d / 'etc'))},workdir={q(str(d / 'etc.work'))} /etc",  # noqa: E501
            f"mount -t overlay smol-root -o lowerdir=/root,upperdir={q(str(d / 'root'))},workdir={q(str(d / 'root.work'))} /root",  # noqa: E501
            f"hostname {q(host)}",
            *extra,  # e.g. the cgroup mount (smolnet/sim/cgroup.py)
            f"exec /usr/sbin/sshd -D -e -f {q(str(d / 'sshd_config'))}",
        ]
    )
    enter = "".join(f"echo $$ > {q(str(Path(g, 'cgroup.procs')))} && " for g in join)
    argv = [
        "setsid",
        "-f",
        "sh",
        "-c",
        enter + 'exec "$@"',
        "sh",
        IP,
        "netns",
        "exec",
        ns,
        "unshare",
        "--uts",
        "--mount",
        *(["--cgroup"] if cgroup_ns else []),
        "--propagation",
        "private",
        "sh",
        "-c",
        script,
    ]
    with open(log, "ab") as out:
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, timeout=CMD_TIMEOUT)
    if p.returncode != 0:
        raise SimError(f"{host}: could not start sshd (see {log})")


def wait_sshd(host: str, address: str, pid_file: Path, log: Path, deadline: float) -> int:
    """Block until the host's sshd sends its banner; return its pid."""
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((address, 22), timeout=1.0) as s:
                s.settimeout(2.0)
                if s.recv(64).startswith(b"SSH-"):
                    pid = int(pid_file.read_text().strip())
                    return pid
                last = "no SSH banner"
        except (OSError, ValueError) as e:
            last = str(e)
        time.sleep(0.05)
    tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
    raise SimError(f"{host}: sshd on {address}:22 did not answer ({last}); log: {' | '.join(tail) or 'empty'}")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_all(pids: set[int], grace: float = 3.0) -> set[int]:
    """TERM, wait up to `grace`, then KILL; return pids that still live."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            pids = {p for p in pids if pid_alive(p)}
            if not pids:
                return set()
            time.sleep(0.05)
    return pids
