"""Seeded random clusters (`smolnet sim up --scenario random --seed N`): clusters nobody tuned on.

The built-in scenarios are the clusters the timing model was built on, so they cannot show
whether it holds elsewhere. A draw is a cluster built from the ranges real home gear spans,
picked by a seed that is printed and recorded with every result, so anyone can rebuild the
same cluster: 3-6 hosts; each on Wi-Fi (50-400 Mbit/s each way, a rated PHY speed above it),
1 GbE, 2.5 GbE, or 1 GbE behind a slow uplink (50-400 Mbit/s up); a CPU cap of 0.1-0.7 cores
(scaled so the caps fit this machine), under the sim's short CFS periods or a 10 ms or 100 ms
one, readable by the host or hidden above it (then the host is a machine of its own); a jumbo
MTU now and then, sometimes on a switch port that carries only 1500 (a silent black hole, as
in `home`); a peak rate on some hosts' shapers and a plain bucket on others (net.tbf_argv).

Only tc tbf shapes the links: the sim adds no propagation delay (that needs netem), so a link's
latency is what the shaper, the veths and the hosts' scheduling give it.
"""

from __future__ import annotations

import math
import os
import random

from smolnet.errors import UsageError

HOSTS = (3, 6)  # inclusive range of the number of hosts
CAP = (0.1, 0.7)  # cores, before scaling to fit the machine
WIFI = (50, 400)  # Mbit/s each way, drawn per direction
WIFI_PHY = (300, 433, 866, 1200)  # rated link speeds of 802.11n/ac/ax adapters
SLOW_UP = (50, 400)  # Mbit/s up on a host behind a slow uplink
LINKS = ("wifi", "gbe", "mgig", "uplink")
PERIODS = (None, 10_000, 100_000)  # None: the sim's own rule (cgroup.period_quota)
MIN_QUOTA_US = 1_000  # the kernel's smallest CFS quota
MAX_SEED = 2**32 - 1


def fresh_seed() -> int:
    """A seed for a draw nobody asked for by number (printed and recorded with the results)."""
    return random.SystemRandom().randint(0, MAX_SEED)


def check_seed(seed: int) -> int:
    if not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise UsageError(f"--seed must be an integer 0..{MAX_SEED}, got {seed!r}")
    return seed


def draw(seed: int, cpus: int | None = None) -> list:
    """The host specs of draw `seed` for a machine of `cpus` CPUs (default: this one's).

    The same seed and CPU count give the same cluster; only the caps' scale depends on the
    machine (they must sum to at most 3/4 of its cores, as every scenario's do)."""
    from smolnet.sim.scenarios import HostSpec

    rng = random.Random(check_seed(seed))
    cpus = cpus or os.cpu_count() or 1
    n = rng.randint(*HOSTS)
    specs, raw = [], []
    for i in range(1, n + 1):
        kind = rng.choice(LINKS)
        if kind == "wifi":
            up, down, nic = rng.randint(*WIFI), rng.randint(*WIFI), rng.choice(WIFI_PHY)
        elif kind == "uplink":
            up, down, nic = rng.randint(*SLOW_UP), 1000, 1000
        else:
            up = down = nic = 1000 if kind == "gbe" else 2500
        mtu = port = 1500
        if kind != "wifi" and rng.random() < 0.4:  # a jumbo host; a third of them on a 1500 port
            mtu = 9000
            port = 1500 if rng.random() < 1 / 3 else 9000
        hidden = rng.random() < 0.4
        spec = HostSpec(f"{kind}{i}", "generic", mtu, port, up, down, nic)
        spec.cpu_hidden = hidden
        spec.own_machine = hidden or rng.random() < 0.5
        spec.link_peak = rng.random() < 0.5
        spec.cpu_period_us = rng.choice(PERIODS)
        raw.append(round(rng.uniform(*CAP), 3))
        specs.append(spec)
    scale = min(1.0, 0.75 * cpus / sum(raw))
    for spec, c in zip(specs, raw):
        spec.cpu_cores = math.floor(c * scale * 1000) / 1000  # down: the caps must still fit
        if spec.cpu_period_us and spec.cpu_cores * spec.cpu_period_us < MIN_QUOTA_US:
            spec.cpu_period_us = None  # a quota under the kernel's floor would raise the cap silently
    return specs


def describe(specs: list) -> str:
    """One line per host: what a reader needs to rebuild or judge the draw."""
    lines = []
    for s in specs:
        cap = f"{s.cpu_cores:g} cores" + (" hidden" if s.cpu_hidden else "")
        cap += f", {s.cpu_period_us // 1000} ms period" if s.cpu_period_us else ""
        mtu = f"mtu {s.mtu}" + (f" on a {s.port_mtu} port" if s.port_mtu != s.mtu else "")
        peak = "peak rate" if s.link_peak else "bursting bucket"
        own = ", own machine" if s.own_machine else ""
        lines.append(f"{s.name}: {s.down_mbit:g}/{s.up_mbit:g} Mbit/s down/up ({peak}), {mtu}, {cap}{own}")
    return "\n".join(lines)
