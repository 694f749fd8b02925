"""Which hosts that share a machine calibrate may probe at the same time.

Hosts on one kernel (the sim's namespaced hosts, several ranks on one box) share its CPUs, so
calibrate probed them one after another: each would otherwise measure the others' load
instead of its own speed. On the home sim that is four hosts' probes end to end, most of the
demo's calibrate stage. A host whose CPU is capped by a cgroup quota it can read cannot take
more than its cap, though, and when the caps of all the hosts on a machine sum to no more
than its CPUs less HEADROOM_CORES none of them can be short of its cap because of the others:
they are probed together. Anything else (a host without a cap, a cap it cannot read, as in
the `hidden` scenario, hosts under one capped cgroup, which share its cap, or caps that
overcommit the machine) keeps them one after another.

The cap is read, never guessed: the same SSH round trip that reads the boot id runs
`python -m smoltrain.calibration.together` on the host (no torch: a few tens of ms of CPU),
which prints the machine's CPUs and the tightest quota on the host's own cgroup path.
"""

from __future__ import annotations

import json
import os
import sys

# Half a core kept free of every host's cap: the controller runs its SSH clients on the same
# machine (in the sim), polling each session and decrypting its lines, and the kernel's work
# for the hosts' veth links and shaping is charged to no host's cgroup. Half a core is also
# what the sim's own scenarios leave free on a 2-core machine (their caps sum to 3/4 of the
# cores), so the home hosts (1.5 cores there) are probed together and nothing that fills the
# machine is.
HEADROOM_CORES = 0.5
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


def host_facts() -> dict:
    """What the controller needs before probing: the machine's CPUs, this host's cap, and
    which cgroups impose a cap on it (device:inode, the same for every process under one)."""
    from smolnet.sim.cgroup import own_quota, own_quotas

    cap = own_quota()
    ids = []
    for d, _ in own_quotas():
        try:
            st = os.stat(d)
            ids.append(f"{st.st_dev}:{st.st_ino}")
        except OSError:
            ids.append(d)
    return {"cpus": os.cpu_count() or 1, "cpu_limit_cores": cap[0] / cap[1] if cap else None, "cpu_cgroups": ids}


def decide(facts: dict[str, dict], cpus: int, headroom: float = HEADROOM_CORES) -> tuple[bool, str]:
    """(probe together, why) for the hosts of one machine, from each one's host_facts() (by
    host name) and the machine's CPUs. Together only when every host has a cap it can read,
    no capped cgroup is above two of them (they would share its one cap) and the caps sum to
    at most `cpus` less `headroom`."""
    if len(facts) < 2:
        return False, "alone on its machine"
    caps = {n: f.get("cpu_limit_cores") for n, f in facts.items()}
    blind = [n for n, c in caps.items() if not c]
    if blind:
        return False, f"one after another: no CPU cap {', '.join(blind)} can read"
    seen: dict[str, str] = {}
    for n, f in facts.items():
        for g in f.get("cpu_cgroups") or []:
            if g in seen:
                return False, f"one after another: {seen[g]} and {n} share one CPU cap"
            seen[g] = n
    total, room = sum(caps.values()), cpus - headroom
    if total > room + _SLACK:
        return False, f"one after another: caps sum to {total:.2f} cores, over {cpus} CPUs less {headroom:g}"
    return True, f"together: caps sum to {total:.2f} cores, within {cpus} CPUs less {headroom:g}"


if __name__ == "__main__":
    print(json.dumps(host_facts()))
    sys.exit(0)
