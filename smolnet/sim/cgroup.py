"""CPU caps and cpusets for sim hosts: one cgroup per host, v1 or v2.

Why: the sim's hosts are processes on one machine, so without a cap they all compute at
the machine's speed and a compute prediction cannot be checked. A quota on everything a
host's sshd starts makes hosts that differ in compute the way a Pi and a laptop do, with
the truth known (the cap); a cpuset gives a host a core of its own and no quota at all.
The sshd enters its cgroups before it starts (children inherit them); `ip netns exec`
remounts /sys, so inside a host the cgroup filesystem is mounted again (mount_lines) for
probes to read their own limit, unless the cap is hidden above a cgroup namespace.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from smolnet.errors import SmolError

ROOT = Path(os.environ.get("SMOL_CGROUP_ROOT", "/sys/fs/cgroup"))
PERIOD_US = 5_000
MIN_QUOTA_US = 2_500  # the shortest slice a host runs in (the kernel's floor is 1 ms)


def period_quota(cores: float, period_us: int | None = None) -> tuple[int, int]:
    """(period, quota) in microseconds for a cap of `cores`; `period_us` fixes the period (a
    scenario built unlike the sim's own rule). Otherwise a 5 ms period, longer only where
    the quota would be under 2.5 ms, so a capped host is slow all the time, as a real Pi
    is. With the kernel's 100 ms period a rank idle between bursts (a pipeline stage) ran
    its next burst at full speed on the quota it had saved, and mp/pp measured 2x faster
    than the cap said. Each slice starts on a cold core (on a VM, a woken vCPU): at 1 ms
    slices the 0.15-core Pi did 0.67-0.77 of its share's work, at 1.25 ms the Jetson
    0.88-0.95, at 2.25-3.25 ms the others 0.95-0.99."""
    if period_us:
        return period_us, max(1_000, int(round(cores * period_us)))
    period = min(1_000_000, max(PERIOD_US, int(round(MIN_QUOTA_US / cores))))  # kernel max 1 s
    return period, max(1_000, int(round(cores * period)))


class CgroupError(SmolError):
    """A cap could not be set or removed."""


def version(root: Path = ROOT, controller: str = "cpu", marker: str = "cpu.cfs_quota_us") -> int | None:
    """1 (the controller mounted at root/<controller>), 2 (unified with it enabled), or None."""
    if (root / controller / marker).exists():
        return 1
    ctl = root / "cgroup.controllers"
    if ctl.exists() and controller in ctl.read_text().split():
        return 2
    return None


def unavailable_reason(root: Path = ROOT) -> str | None:
    if version(root) is None:
        return f"no cgroup cpu controller under {root} (v1 {root}/cpu or v2 with cpu enabled)"
    if os.geteuid() != 0:
        return "capping CPU needs root"
    return None


def _dir(name: str, root: Path, v: int) -> Path:
    return (root / "cpu" / name) if v == 1 else (root / name)


def create(name: str, cores: float, root: Path = ROOT, period_us: int | None = None) -> str:
    """Make cgroup `name` capped at `cores` CPUs; return its directory."""
    if cores <= 0:
        raise CgroupError(f"cpu cap must be > 0 cores, got {cores:g}")
    v = version(root)
    if v is None:
        raise CgroupError(unavailable_reason(root) or "no cgroup cpu controller")
    d = _dir(name, root, v)
    try:
        d.mkdir(exist_ok=True)
        period, quota = period_quota(cores, period_us)
        if v == 1:  # lift the quota first: a period under the current quota is refused
            (d / "cpu.cfs_quota_us").write_text("-1")
            (d / "cpu.cfs_period_us").write_text(str(period))
            (d / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            sub = root / "cgroup.subtree_control"
            if "cpu" not in sub.read_text().split():
                sub.write_text("+cpu")
            (d / "cpu.max").write_text(f"{quota} {period}")
    except OSError as e:
        raise CgroupError(f"cannot cap {d} at {cores:g} cores: {e.strerror or e}") from None
    return str(d)


def add_pid(path: str, pid: int) -> None:
    try:
        Path(path, "cgroup.procs").write_text(str(pid))
    except OSError as e:
        raise CgroupError(f"cannot move pid {pid} into {path}: {e.strerror or e}") from None


def pids(path: str) -> list[int]:
    try:
        return [int(x) for x in Path(path, "cgroup.procs").read_text().split()]
    except OSError:
        return []


def remove(path: str, timeout: float = 5.0) -> bool:
    """Move what is left to the parent and remove the cgroup and any child cgroups (a hidden
    cap's host group); True when it is gone."""
    d = Path(path)
    if not d.is_dir():
        return True
    for child in [c for c in d.iterdir() if c.is_dir()]:
        remove(str(child), timeout)
    deadline = time.monotonic() + timeout
    while True:
        for pid in pids(path):
            try:
                (d.parent / "cgroup.procs").write_text(str(pid))
            except OSError:
                pass
        try:
            d.rmdir()
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


def quota(path: str) -> tuple[int, int] | None:
    """(quota, period) in microseconds of the cgroup at `path`; None when unlimited or unreadable."""
    d = Path(path)
    try:
        if (d / "cpu.max").exists():
            q, p = (d / "cpu.max").read_text().split()[:2]
            return None if q == "max" else (int(q), int(p))
        q = int((d / "cpu.cfs_quota_us").read_text())
        p = int((d / "cpu.cfs_period_us").read_text())
        return None if q < 0 else (q, p)
    except (OSError, ValueError):
        return None


def limit(path: str) -> float | None:
    """Cores the cgroup at `path` may use; None when unlimited or unreadable."""
    qp = quota(path)
    return None if qp is None else qp[0] / qp[1]


def own_quota(root: Path = ROOT, proc_cgroup: str = "/proc/self/cgroup") -> tuple[int, int] | None:
    """(quota, period) in microseconds of the tightest CPU cap on this process's cgroup path,
    or None. The period matters as well as the cap: a host idle for a period starts its next
    burst on a whole quota at full speed."""
    caps = [qp for _, qp in own_quotas(root, proc_cgroup)]
    return min(caps, key=lambda qp: qp[0] / qp[1]) if caps else None


def own_quotas(root: Path = ROOT, proc_cgroup: str = "/proc/self/cgroup") -> list[tuple[str, tuple[int, int]]]:
    """(directory, (quota, period)) of every capped cgroup on this process's path, its own
    first: two processes under one of them share its cap (calibration.together)."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return []
    out = []
    for ln in lines:
        hid, ctrls, rel = (ln.split(":", 2) + ["", ""])[:3]
        if hid == "0" and ctrls == "":
            base = root
        elif "cpu" in ctrls.split(","):
            base = root / "cpu" if (root / "cpu").is_dir() else root / ctrls
        else:
            continue
        parts = [p for p in rel.strip("/").split("/") if p]
        for i in range(len(parts), -1, -1):  # every ancestor may cap too
            d = str(base.joinpath(*parts[:i]))
            qp = quota(d)
            if qp is not None:
                out.append((d, qp))
    return out


def own_limit(root: Path = ROOT, proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """The CPU cap this process runs under (the tightest on its cgroup path), or None."""
    qp = own_quota(root, proc_cgroup)
    return None if qp is None else qp[0] / qp[1]


def _v1_cpu_options(proc_cgroup: str = "/proc/self/cgroup") -> str:
    """The cpu hierarchy's controller list (cpu, or cpu,cpuacct where they are co-mounted)."""
    try:
        for ln in Path(proc_cgroup).read_text().splitlines():
            ctrls = (ln.split(":", 2) + [""])[1].split(",")
            if "cpu" in ctrls:
                return ",".join(ctrls)
    except OSError:
        pass
    return "cpu"


def mount_lines() -> list[str]:
    """Shell lines for a host's private mount namespace, after `ip netns exec` gave it a
    fresh /sys: mount the cpu controller again so probes can read their own cap. Failing
    to mount costs only that reading (calibrate reports the cap as unknown)."""
    v = version()
    if v == 1:
        body = (
            "mount -t tmpfs smol-cg /sys/fs/cgroup && mkdir -p /sys/fs/cgroup/cpu && "
            f"mount -t cgroup -o {_v1_cpu_options()} smol-cgcpu /sys/fs/cgroup/cpu"
        )
    elif v == 2:
        body = "mount -t cgroup2 smol-cg2 /sys/fs/cgroup"
    else:
        return []
    return [f"{{ {body}; }} 2>/dev/null || true"]


def cap_name(sim: str, host: str) -> str:
    return f"smol-{sim}-{host}"


def path(name: str, root: Path = ROOT) -> str:
    return str(_dir(name, root, version(root) or 1))


def existing(name: str) -> str | None:
    """The cgroup of that name when it exists (teardown after lost state)."""
    p = path(name)
    return p if version() and Path(p).is_dir() else None


def check_caps(hosts: list[dict], explicit: bool, error=CgroupError) -> None:
    """Caps the user asked for (--cpu-limit) must be possible here; a scenario's default caps
    are dropped, with a warning, so the sim still runs where cgroups cannot be written."""
    why = unavailable_reason() if any(h.get("cpu_cores") for h in hosts) else None
    if why and explicit:
        raise error(f"cannot cap CPU: {why} (--cpu-limit 0: uncapped)")
    if why:
        print(f"smolnet: sim hosts run uncapped: {why}", file=sys.stderr)
    for h in hosts:
        h["cpu_required"] = explicit
        if why:
            h["cpu_cores"] = None


def cpuset_version(root: Path = ROOT) -> int | None:
    return version(root, "cpuset", "cpuset.cpus")


def _cpuset_dir(name: str, root: Path = ROOT) -> Path:
    return (root / "cpuset" / name) if cpuset_version(root) == 1 else (root / name)


def existing_cpuset(name: str) -> str | None:
    """The cpuset cgroup of that name when it exists (teardown after lost state)."""
    d = _cpuset_dir(name)
    return str(d) if cpuset_version() and d.is_dir() else None


def create_cpuset(name: str, cpus: str, root: Path = ROOT) -> str:
    """Make cgroup `name` whose processes run on `cpus` only (a list like "0" or "2-3");
    return its directory. The host owns those cores as far as the sim's hosts go; other
    processes of the machine are not moved off them."""
    v = cpuset_version(root)
    if v is None:
        raise CgroupError(f"no cgroup cpuset controller under {root}")
    d = _cpuset_dir(name, root)
    try:
        d.mkdir(exist_ok=True)
        if v == 1:  # a v1 cpuset starts empty: mems as well as cpus must be set
            (d / "cpuset.mems").write_text((d.parent / "cpuset.mems").read_text().strip())
        else:
            sub = root / "cgroup.subtree_control"
            if "cpuset" not in sub.read_text().split():
                sub.write_text("+cpuset")
        (d / "cpuset.cpus").write_text(cpus)
    except OSError as e:
        raise CgroupError(f"cannot pin {d} to CPUs {cpus}: {e.strerror or e}") from None
    return str(d)


HIDDEN_CHILD = "host"  # a hidden cap's host runs here, in a cgroup namespace rooted here


def host_groups(sim: str, h: dict, error=CgroupError) -> list[str]:
    """Make host `h`'s cgroups before its sshd starts, record them in `h` (`cgroup`,
    `cpuset_cgroup`) and return the directories its sshd joins. A hidden cap (`cpu_hidden`)
    sits on the parent; the host joins a child without one, in a cgroup namespace rooted
    there (net.start_sshd), so it cannot read its cap, as no real slow machine can. A cap
    that fails raises `error` when required, else is reported and the host runs uncapped."""
    name, join = cap_name(sim, h["name"]), []
    if h.get("cpuset"):
        try:
            h["cpuset_cgroup"] = create_cpuset(name, h["cpuset"])
        except CgroupError as e:
            raise error(f"{name}: {e}") from None
        join.append(h["cpuset_cgroup"])
    if h.get("cpu_cores"):
        try:
            h["cgroup"] = create(name, h["cpu_cores"], ROOT, h.get("cpu_period_us"))
            cpu_dir = h["cgroup"]
            if h.get("cpu_hidden"):
                cpu_dir = str(Path(cpu_dir, HIDDEN_CHILD))
                Path(cpu_dir).mkdir(exist_ok=True)
            if cpu_dir != h.get("cpuset_cgroup"):  # v2: one directory holds both
                join.append(cpu_dir)
        except (CgroupError, OSError) as e:
            if h.get("cpu_required", True):
                raise error(f"{name}: {e}") from None
            print(f"smolnet: {name} runs uncapped: {e}", file=sys.stderr)
            if h.get("cgroup"):
                remove(h["cgroup"])
            h["cgroup"] = None
    return join
