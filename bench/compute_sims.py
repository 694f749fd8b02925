"""The sims bench/bench_compute.py runs on: the built-in scenarios and K drawn clusters.

A drawn cluster (smolnet/sim/draw.py) is named by its seed: `random:N` is `smolnet sim up
--scenario random --seed N`. The bench draws K seeds from one seed of its own, fresh each run
unless given, and prints and records it, so a run's clusters can be rebuilt and a model change
can be judged on draws other than those that motivated it.
"""

from __future__ import annotations

import functools
import json
import os
import random
from pathlib import Path

import common
from common import PY

BUILT_IN = {"home": ("cbench", "10.42.3.0/24"), "cores": ("scb1", "10.66.21.0/24"), "hidden": ("scb2", "10.66.22.0/24")}
DRAWN = ("scbd", "10.66.23.0/24")  # every draw in turn, one at a time
WEIGHT_GROUP = "smol-bench-weight"

sh = functools.partial(common.sh, ok=(0, 4))  # calibrate exits 4 when a host failed: its report says which


def draw_seeds(seed: int, k: int) -> list[int]:
    """The seeds of the bench's K drawn clusters, all from the bench's one seed."""
    from smolnet.sim.draw import MAX_SEED

    rng = random.Random(seed)
    return [rng.randint(0, MAX_SEED) for _ in range(k)]


def keys(scenarios: list[str], seed: int, k: int) -> list[str]:
    """What to run: the named built-ins, then `random:N` for each drawn seed."""
    return list(scenarios) + [f"random:{s}" for s in draw_seeds(seed, k)]


def sim_of(key: str) -> tuple[str, str]:
    """(sim name, subnet) of a scenario key."""
    return DRAWN if key.startswith("random:") else BUILT_IN[key]


def up(
    d: Path, key: str = "home", cpu_limit: str | None = None, name: str | None = None, subnet: str | None = None
) -> Path:
    """The sim of scenario `key` (home capped, or not: --cpu-limit 0), its inventory in `d`;
    `name` and `subnet` for a bench of its own beside bench_compute's sims.

    A host whose interface MTU is above its switch port's is a black hole by design (home's
    laptop, a drawn jumbo host); set it to what the wire carries, as provisioning does in the
    demo, so the runs measure the links and not the fault."""
    import yaml

    name, subnet = name or sim_of(key)[0], subnet or sim_of(key)[1]
    scenario, _, seed = key.partition(":")
    inv = d / f"{scenario}{seed}.yml"
    down(name)
    extra = ["--cpu-limit", cpu_limit] if cpu_limit is not None else []
    extra += ["--seed", seed] if seed else []
    sh([PY, "-m", "smolnet", "sim", "up", "--name", name, "--subnet", subnet, "--scenario", scenario]
       + ["--inventory", inv] + extra)  # fmt: skip
    for h in yaml.safe_load(inv.read_text())["all"]["children"]["cluster"]["hosts"].values():
        if h.get("smol_sim_port_mtu") and h["smol_sim_port_mtu"] < h["mtu"]:
            sh(["ip", "-n", h["smol_sim_netns"], "link", "set", "eth0", "mtu", h["smol_sim_port_mtu"]])
    return inv


def down(name: str) -> None:
    sh([PY, "-m", "smolnet", "sim", "down", "--name", name])


def describe(key: str) -> str:
    """A drawn cluster's hosts, one per line (empty for a built-in scenario)."""
    if not key.startswith("random:"):
        return ""
    from smolnet.sim.draw import describe as lines
    from smolnet.sim.draw import draw

    return lines(draw(int(key.partition(":")[2])))


def weigh(shares: int, names: list[str] = ()) -> None:
    """--weight: this bench (and every sim host it starts: sshd inherits the group, and a
    capped host's own cgroup gets the same) competes for the CPU with `shares` where other
    jobs have 1024 (cgroup v1 cpu.shares; v2 cpu.weight, where they have 100). On a machine
    other people use, their jobs then take less of the hosts' CPU; caps still bind."""
    from smolnet.sim import cgroup

    v = cgroup.version()
    key, val = ("cpu.shares", shares) if v == 1 else ("cpu.weight", max(1, min(10000, shares * 100 // 1024)))
    if not names:
        d = Path(cgroup.path(WEIGHT_GROUP))
        d.mkdir(exist_ok=True)
        (d / key).write_text(str(val))
        cgroup.add_pid(str(d), os.getpid())
        return
    for name in names:
        st = json.loads(sh([PY, "-m", "smolnet", "sim", "status", "--name", name, "--json"], ok=(0, 1)).stdout)
        for h in st["hosts"]:
            if h.get("cgroup"):
                Path(h["cgroup"], key).write_text(str(val))
