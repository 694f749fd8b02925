"""Which hosts that share a machine calibrate may probe at the same time.

Hosts on one kernel (the sim's namespaced hosts, several ranks on one box) share its CPUs, so
calibrate probed them one after another: each would otherwise measure the others' load
instead of its own speed. A host whose CPU is capped by a cgroup quota it can read cannot take
more than its cap, and when nothing else can take what each is owed, its figures are its own:
the probes running at once have a CPU for each of their threads and their caps sum to no more
than the CPUs less HEADROOM_CORES. `lanes` says how many of a machine's hosts may be probed at
once on those terms (the busiest caps and the most threads counted): all of them (together),
some (the home sim on 2 CPUs: two one-thread probes, 1.1 cores at most), or one. Anything
else (a host without a cap, a cap it cannot read, as in the `hidden` scenario, hosts under
one capped cgroup, which share its cap) keeps them one after another.

Why the threads, not only the caps: a quota bounds a host's CPU per period, not when it gets
it. The home sim's four one-thread probes on 2 CPUs (caps 1.5 cores) wait on each other
within a period, and together the laptop (0.65 cores in 5 ms periods) read its training
step 1.2-1.4x slower than one after another, the macmini ~1.1x; the laptop ran out its
quota in 0.39-0.57 of its periods against 0.70-0.76 alone (BENCHMARKS.md, "calibrate: hosts
of one machine probed together"). And a cap is an upper bound: on a machine other work keeps
busy a capped host gets min(cap, its fair share), and every host probed at once shrinks the
others' share (the laptop's matmul read 0.53 of its figure one after another, with other
jobs running). So the room is the CPUs less HEADROOM_CORES or less what other work kept busy
just before, whichever is more.

The cap is read, never guessed: the same SSH round trip that reads the boot id runs
`python -m smoltrain.calibration.together` on the host (no torch: a few tens of ms of CPU),
which prints the machine's CPUs, the CPUs the host may use, how many were busy over
BUSY_WINDOW and the tightest quota on the host's own cgroup path.
"""

from __future__ import annotations

import json
import os
import sys
import time

# Half a core kept free of every host's cap: the controller runs its SSH clients on the same
# machine (in the sim), polling each session and decrypting its lines (2.5-2.8 CPU seconds
# over a whole 85-90 s calibrate of the home sim), and the kernel's work for the hosts' veth
# links and shaping is charged to no host's cgroup (a host's sshd is: it runs in the host's
# cgroups). Half a core leaves room beyond both, and is what the sim's own scenarios leave
# free on a 2-core machine (their caps sum to 3/4 of the cores).
HEADROOM_CORES = 0.5
BUSY_WINDOW = 0.5  # seconds of /proc/stat: a few scheduler ticks on every CPU
_SLACK = 1e-6  # a quota of 2500 us in a 16667 us period is 0.149997 cores, not 0.15

ID_COMMAND = "cat /proc/sys/kernel/random/boot_id 2>/dev/null || cat /etc/machine-id"


def read_command(python: str) -> str:
    """One shell line: the machine id on the first line, then this module's JSON (absent when
    the host's Python cannot run it: the cap is then unknown)."""
    from smolnet.remote import shell_word

    return f"{ID_COMMAND}; {shell_word(python)} -m smoltrain.calibration.together 2>/dev/null || true"


def parse(stdout: str) -> tuple[str, dict]:
    """(machine id, facts) from read_command's output; facts {} when the JSON line is missing."""
    lines = [ln.strip() for ln in stdout.splitlines() if ln.strip()]
    mid = lines[0] if lines else ""
    try:
        facts = json.loads(lines[1]) if len(lines) > 1 else {}
    except ValueError:
        facts = {}
    return mid, facts if isinstance(facts, dict) else {}


def machine_busy(window: float = BUSY_WINDOW) -> float | None:
    """CPUs the whole machine kept busy over `window` seconds (/proc/stat counts every process
    on the kernel, in any namespace or cgroup; time a hypervisor stole counts as busy), or None
    where there is no /proc/stat."""

    def read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        return sum(v), v[3] + v[4]  # all, idle + iowait

    try:
        t0, i0 = read()
        time.sleep(window)
        t1, i1 = read()
    except (OSError, ValueError):
        return None
    return (os.cpu_count() or 1) * (1 - (i1 - i0) / (t1 - t0)) if t1 > t0 else None


def host_facts() -> dict:
    """What the controller needs before probing: the machine's CPUs and how busy they are,
    this host's cap, and which cgroups impose a cap on it (device:inode, the same for every
    process under one)."""
    from smolnet.sim.cgroup import own_quota, own_quotas

    cap = own_quota()
    ids = []
    for d, _ in own_quotas():
        try:
            st = os.stat(d)
            ids.append(f"{st.st_dev}:{st.st_ino}")
        except OSError:
            ids.append(d)
    from smolnet.cpus import usable_cpus

    return {
        "cpus": os.cpu_count() or 1,
        "cores": usable_cpus(cap),  # the probe's threads where smol_threads is not set
        "busy_cpus": machine_busy(),
        "cpu_limit_cores": cap[0] / cap[1] if cap else None,
        "cpu_cgroups": ids,
    }


def lanes(facts: dict[str, dict], cpus: int, busy: float | None, headroom: float = HEADROOM_CORES) -> tuple[int, str]:
    """(how many probes run at once, why) for the hosts of one machine, from each one's
    host_facts() (by host name, with `threads`: the probe's), the machine's CPUs and how many
    other work kept busy (None: unknown). More than one only when every host has a cap it can
    read and no capped cgroup is above two of them (they would share its one cap); then as many
    as the busiest of them fit at once: their probes' threads no more than the CPUs (each thread
    a CPU of its own) and their caps at most `cpus` less `headroom` or less `busy`, whichever is
    more. As many as there are hosts: all together."""
    if len(facts) < 2:
        return 1, "alone on its machine"
    caps = {n: f.get("cpu_limit_cores") for n, f in facts.items()}
    blind = [n for n, c in caps.items() if not c]
    if blind:
        return 1, f"one after another: no CPU cap {', '.join(blind)} can read"
    seen: dict[str, str] = {}
    for n, f in facts.items():
        for g in f.get("cpu_cgroups") or []:
            if g in seen:
                return 1, f"one after another: {seen[g]} and {n} share one CPU cap"
            seen[g] = n
    if busy is None:
        return 1, "one after another: how busy the machine is cannot be read"
    threads = sorted((f.get("threads") or f.get("cores") or cpus + 1 for f in facts.values()), reverse=True)
    most = sorted(caps.values(), reverse=True)
    kept = max(headroom, busy)
    room = f"{cpus} CPUs less {kept:.2f} (headroom {headroom:g}, other work {busy:.2f})"
    k, why = 1, ""
    for n in range(2, len(facts) + 1):
        if sum(threads[:n]) > cpus:
            why = f"{sum(threads[:n])} probe threads, more than {cpus} CPUs"
            break
        if sum(most[:n]) > cpus - kept + _SLACK:
            why = f"caps sum to {sum(most[:n]):.2f} cores, over {room}"
            break
        k = n
    if k == len(facts):
        return k, f"together: caps sum to {sum(most):.2f} cores, within {room}"
    if k == 1:
        return 1, f"one after another: {why}"
    return k, f"{k} at a time: {k + 1} would be {why}"


if __name__ == "__main__":
    print(json.dumps(host_facts()))
    sys.exit(0)
