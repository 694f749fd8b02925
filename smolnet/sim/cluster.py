"""The single-machine cluster: real namespaced hosts behind one shaped switch.

Each host is a network namespace with its own UTS and mount namespaces, overlays over
/etc and /root (with a private /root/.ssh), and sshd on its address with its own host key. A switch namespace
holds a bridge; a controller veth in the root namespace reaches every host. Links
are shaped with tc tbf and carry per-host and per-switch-port MTUs, so the faults
smolnet hunts (slow uplinks, jumbo mismatches) are real here, not mocked.

`up` records everything it makes in state.json (the making itself is in build.py);
`down` removes exactly that.
Without root or namespaces, `up(loopback=True)` gives the same hosts as
`ansible_connection: local` processes on 127.x addresses so the flow still runs.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import re
import shutil
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from smolnet.sim import cgroup, net
from smolnet.sim.build import _build, _save, _write_atomic
from smolnet.sim.inventory import inventory_text, remove_inventory
from smolnet.sim.net import SimError, SimUnavailable, unavailable_reason
from smolnet.sim.scenarios import SCENARIOS, path_truth, tcp_goodput_mbit

__all__ = [
    "up",
    "down",
    "status",
    "SimError",
    "SimUnavailable",
    "SCENARIOS",
    "path_truth",
    "tcp_goodput_mbit",
    "state_dir",
    "unavailable_reason",
]


def _state_root() -> Path:
    """/run (tmpfs on most machines: a reboot forgets the sim, as it forgets the namespaces);
    a per-user directory when not root, where only the loopback fallback can run."""
    if os.environ.get("SMOL_SIM_STATE"):
        return Path(os.environ["SMOL_SIM_STATE"])
    if os.geteuid() == 0:
        return Path("/run/smolcluster/sim")
    base = os.environ.get("XDG_RUNTIME_DIR") or os.path.expanduser("~/.cache")
    return Path(base) / "smolcluster" / "sim"


STATE_ROOT = _state_root()
LOCK_TIMEOUT = 60.0
NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,9}$")


def state_dir(name: str) -> Path:
    return STATE_ROOT / name


def _check_name(name: str) -> None:
    if not NAME_RE.match(name or ""):
        raise SimError(
            f"bad sim name {name!r}: 1-10 lowercase letters/digits, starting with a letter "
            "(it becomes part of interface names, which Linux caps at 15 characters)",
            code=2,
        )


@contextmanager
def _lock():
    """Serialize up/down across processes: they share the root namespace's routes."""
    STATE_ROOT.mkdir(parents=True, exist_ok=True, mode=0o755)
    with open(STATE_ROOT / ".lock", "w") as f:
        deadline = time.monotonic() + LOCK_TIMEOUT
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise SimError(f"another sim up/down held {STATE_ROOT}/.lock for {LOCK_TIMEOUT:g}s") from None
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _load(name: str) -> dict | None:
    p = state_dir(name) / "state.json"
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise SimError(f"{p}: unreadable sim state ({e}); remove {p.parent} by hand") from None


def _addresses(subnet: str, n: int) -> tuple[ipaddress.IPv4Network, list[str], str]:
    try:
        net_ = ipaddress.ip_network(subnet, strict=True)
    except ValueError as e:
        raise SimError(f"bad subnet {subnet!r}: {e}", code=2) from None
    if net_.version != 4:
        raise SimError(f"subnet {subnet} must be IPv4", code=2)
    if net_.num_addresses - 2 < n + 1:
        raise SimError(f"subnet {subnet} is too small for {n} hosts and the controller", code=2)
    return net_, [str(net_.network_address + i) for i in range(1, n + 1)], str(net_.broadcast_address - 1)


def _loopback_addresses(net_: ipaddress.IPv4Network, n: int) -> list[str]:
    """127.B.C.i for subnet A.B.C.0: distinct per subnet, so two loopback sims never collide."""
    b, c = net_.network_address.packed[1:3]
    return [f"127.{b}.{c}.{i}" for i in range(1, n + 1)]


# --- up -----------------------------------------------------------------------------------


def up(
    name: str = "smol",
    scenario: str = "home",
    hosts: int | None = None,
    subnet: str = "10.213.0.0/24",
    inventory: str = "inventory/sim.yml",
    rate_mbit: float | None = None,
    mtu: int | None = None,
    loopback: bool | None = None,
    cpu_limit: str | None = None,
    seed: int | None = None,
) -> dict:
    """Build the sim and write its inventory; return the recorded state (`seed`: the draw of
    scenario random, recorded as `seed`).

    loopback=None follows $SMOL_SIM_LOOPBACK (default off); off raises SimUnavailable when
    this machine cannot run namespaced hosts, on builds 127.x `ansible_connection: local` hosts.
    """
    from smolnet.sim.scenarios import scenario as make_scenario

    _check_name(name)
    specs = make_scenario(scenario, hosts, rate_mbit, mtu, cpu_limit, seed)
    net_, addrs, controller = _addresses(subnet, len(specs))
    if loopback is None:
        loopback = os.environ.get("SMOL_SIM_LOOPBACK", "") not in ("", "0")
    if not loopback:
        reason = net.unavailable_reason()
        if reason:
            raise SimUnavailable(reason)
    inv_path = Path(inventory).expanduser().resolve()
    d = state_dir(name)
    with _lock():
        if _load(name) is not None:
            raise SimError(f"sim {name} is already up (smolnet sim down --name {name} first)")
        st = {
            "name": name,
            "scenario": scenario,
            "seed": seed,
            "mode": "loopback" if loopback else "netns",
            "subnet": str(net_),
            "prefix": net_.prefixlen,
            "inventory": str(inv_path),
            "controller": None if loopback else controller,
            "controller_iface": None if loopback else f"{name}-ctl",
            "switch_netns": None if loopback else f"smol-{name}-sw",
            "state_dir": str(d),
            "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "status": "building",
            "hosts": [],
        }
        for i, (s, a) in enumerate(zip(specs, addrs), 1):
            h = s.to_dict()
            h.update({"index": i, "address": a, "netns": None, "pid_sshd": None, "cgroup": None, "cpuset_cgroup": None})
            if loopback:
                h["address"] = _loopback_addresses(net_, len(specs))[i - 1]
            else:
                h["netns"] = f"smol-{name}-{s.name}"
            st["hosts"].append(h)
        if not loopback:
            _preflight(st)
            cgroup.check_caps(st["hosts"], explicit=cpu_limit is not None, error=SimError)
        if d.exists():
            shutil.rmtree(d)  # leftovers of a crashed run without state.json
        d.mkdir(parents=True, mode=0o700)
        _save(st)
        try:
            if not loopback:
                _build(st, specs)
            from smolnet.secret import ensure_secret

            ensure_secret(d / "secret")
            st["status"] = "up"
            _save(st)
            _write_atomic(inv_path, inventory_text(st))
        except BaseException:
            _teardown(st)
            raise
    return st


def _preflight(st: dict) -> None:
    """Refuse to touch anything that is not ours: existing namespaces, links, routes."""
    existing = net.netns_list()
    mine = [st["switch_netns"]] + [h["netns"] for h in st["hosts"]]
    clash = [n for n in mine if n in existing]
    if clash:
        raise SimError(
            f"network namespace {clash[0]} already exists without sim state "
            f"(leftover? try: smolnet sim down --name {st['name']})"
        )
    if net.link_exists(st["controller_iface"]):
        raise SimError(
            f"interface {st['controller_iface']} already exists (leftover? try: smolnet sim down --name {st['name']})"
        )
    sub = ipaddress.ip_network(st["subnet"])
    for r in net.root_routes():
        dst = r.get("dst", "")
        if dst in ("default", "") or r.get("type") in ("local", "broadcast"):
            continue
        try:
            if ipaddress.ip_network(dst, strict=False).overlaps(sub):
                raise SimError(f"subnet {sub} overlaps route {dst} on {r.get('dev', '?')}; choose another --subnet")
        except ValueError:
            continue


# --- down ---------------------------------------------------------------------------------


def _teardown(st: dict) -> list[str]:
    """Remove everything `st` says was made; return what could not be removed."""
    left: list[str] = []
    host_ns = [h["netns"] for h in st.get("hosts", []) if h.get("netns")]
    pids: set[int] = set()
    for h in st.get("hosts", []):
        pid = h.get("pid_sshd")
        if pid and net.pid_alive(pid) and h.get("netns") and pid in net.netns_pids(h["netns"]):
            pids.add(pid)
    all_ns = host_ns + ([st["switch_netns"]] if st.get("switch_netns") else [])
    existing = net.netns_list() if all_ns else set()
    for ns in all_ns:  # agents, iperf3, tcpdump: whatever runs in a sim namespace dies with it
        if ns in existing:
            pids.update(net.netns_pids(ns))
    pids.discard(os.getpid())
    left += [f"process {p}" for p in net.kill_all(pids)]
    groups = [h.get(k) for h in st.get("hosts", []) for k in ("cgroup", "cpuset_cgroup") if h.get(k)]
    left += [f"cgroup {g}" for g in groups if not cgroup.remove(g)]
    ctl = st.get("controller_iface")
    if ctl and net.link_exists(ctl):
        net.sh([net.IP, "link", "del", ctl], check=False)
    for ns in all_ns:
        if ns in existing:
            net.netns_del(ns)
    # netns deletion frees links asynchronously; wait so "down" means gone.
    deadline = time.monotonic() + 10.0
    while ctl and net.link_exists(ctl) and time.monotonic() < deadline:
        time.sleep(0.05)
    if ctl and net.link_exists(ctl):
        left.append(f"link {ctl}")
    still = net.netns_list() if all_ns else set()
    left += [f"netns {ns}" for ns in all_ns if ns in still]
    remove_inventory(st)
    d = Path(st.get("state_dir") or state_dir(st["name"]))
    if d.is_dir() and d.parent == STATE_ROOT:
        shutil.rmtree(d, ignore_errors=True)
        if d.exists():
            left.append(f"directory {d}")
    return left


def down(name: str = "smol") -> dict | None:
    """Tear the sim down; idempotent. Returns the state it removed (None if none was up)."""
    _check_name(name)
    with _lock():
        st = _load(name)
        if st is None:
            st = _orphans(name)
            if st is None:
                return None
        left = _teardown(st)
    if left:
        raise SimError(f"sim {name}: could not remove {', '.join(left)}")
    return st


def _orphans(name: str) -> dict | None:
    """State lost but namespaces left (a crash mid-up): find ours by their names."""
    if net.unavailable_reason():
        return None
    prefix = f"smol-{name}-"
    found = sorted(n for n in net.netns_list() if n.startswith(prefix))
    ctl = f"{name}-ctl"
    has_ctl = net.link_exists(ctl)
    if not found and not has_ctl and not state_dir(name).exists():
        return None
    hosts = [{"name": n[len(prefix) :], "netns": n} for n in found if n != f"{prefix}sw"]
    for h in hosts:  # a cap or cpuset made before the crash has the host's name
        h["cgroup"] = cgroup.existing(cgroup.cap_name(name, h["name"]))
        h["cpuset_cgroup"] = cgroup.existing_cpuset(cgroup.cap_name(name, h["name"]))
    return {
        "name": name,
        "hosts": hosts,
        "switch_netns": f"{prefix}sw" if f"{prefix}sw" in found else None,
        "controller_iface": ctl if has_ctl else None,
        "state_dir": str(state_dir(name)),
    }


# --- status -------------------------------------------------------------------------------


def status(name: str = "smol") -> dict | None:
    """The recorded state plus live checks (sshd alive, netns present); None if not up."""
    _check_name(name)
    st = _load(name)
    if st is None:
        return None
    present = net.netns_list() if st["mode"] == "netns" else set()
    for h in st["hosts"]:
        if st["mode"] == "netns":
            h["netns_present"] = h["netns"] in present
            h["sshd_alive"] = bool(h.get("pid_sshd")) and net.pid_alive(h["pid_sshd"])
            h["ok"] = h["netns_present"] and h["sshd_alive"]
        else:
            h["ok"] = True
    st["inventory_present"] = Path(st["inventory"]).is_file()
    return st
