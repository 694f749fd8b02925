"""The sim's built-in clusters and the truth each one carries.

A scenario is a list of host specs: name, device profile, interface MTU, switch-port
MTU and shaped rates. Tests and users check every smolnet tool against these numbers,
so they live in one place and the README states the same values.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from smolnet.errors import UsageError

SCENARIOS = ("home", "uniform", "mtu-lab", "cores", "hidden", "random", "fastpair")
DEFAULT_UNIFORM_HOSTS = 3
DEFAULT_UNIFORM_RATE = 1000
DEFAULT_UNIFORM_MTU = 1500
MAX_HOSTS = 32


@dataclass
class HostSpec:
    name: str
    device: str = "generic"
    mtu: int = 1500  # the host's eth0 MTU (what its owner configured)
    port_mtu: int = 1500  # the switch port's MTU (what the wire really carries)
    up_mbit: float | None = None  # shaped host -> switch rate; None = unshaped
    down_mbit: float | None = None  # shaped switch -> host rate; None = unshaped
    nic_mbit: float | None = None  # rated NIC speed, written as link_rate_mbit
    cpu_cores: float | None = None  # CPU cap (cgroup quota, in cores); None = uncapped
    cpu_period_us: int | None = None  # the cap's CFS period; None = the sim's rule (cgroup.period_quota)
    cpu_hidden: bool = False  # the cap sits above the host's cgroup, where it cannot read it
    cpuset: str | None = None  # the CPUs the host runs on (a cpuset of its own); None = all
    own_machine: bool = False  # a boot id of its own: calibration and the plan see a machine of its own
    link_peak: bool = False  # its shapers hold every transfer near the rate (net.tbf_argv)

    def to_dict(self) -> dict:
        return asdict(self)


# CPU caps of the home hosts, in cores: about the ratio of a Pi 5, a Jetson, a Mac mini and
# a laptop training a small model on CPU, summing to 1.5 so a 2-core machine holds them all.
HOME_CPU = (0.15, 0.25, 0.45, 0.65)


def _home() -> list[HostSpec]:
    specs = [
        HostSpec("pi5", "pi5", 1500, 1500, 1000, 1000, 1000),
        HostSpec("jetson", "jetson-orin-nano", 1500, 1500, 300, 1000, 1000),  # slow uplink
        HostSpec("macmini", "mac-mini-m4", 9000, 9000, 2500, 2500, 2500),
        HostSpec("laptop", "rtx4050-laptop", 9000, 1500, 1000, 1000, 1000),  # silent mismatch
    ]
    scale = _fit(HOME_CPU)  # caps must fit the machine
    for s, c in zip(specs, HOME_CPU):
        s.cpu_cores = round(c * scale, 3)
    return specs


# The whole-core cluster: one host per CPU of this machine (at most 4), a cpuset each and no
# quota, so the plan's uncapped path is checked. Links alternate 1000 and 500 Mbit, with a
# peak rate (no bursts after idling), as in `hidden`.
CORES_RATES = (1000, 500)
MAX_CORE_HOSTS = 4

# The hidden-cap cluster, built unlike home: caps (cores) on a parent cgroup the host cannot
# read, a 10 ms CFS period for every host, 300-800 Mbit links with a peak rate, each host
# its own machine.
HIDDEN = (("pi4", 0.15, 300), ("nuc", 0.3, 500), ("mini", 0.4, 650), ("desk", 0.6, 800))
HIDDEN_PERIOD_US = 10_000


# The fast-pair cluster, for a mesh's placement (smoltrain.mesh): two hosts on 10 Gbit, whose
# pair a tp axis should ride, two on 1 GbE, one of them with a 300 Mbit uplink; every host
# capped alike (0.3 cores), so which pair is fast is the links' doing, not the CPUs'. Links with a
# peak rate, as real ones: without it tp's per-layer all-reduces left a link that idled at
# memory speed (4.7 MB over the 300 Mbit uplink in 100 ms, the wire takes 130), which no link
# of that rate does, so 1-D tp ran 1.55x its plan (BENCHMARKS.md, "Meshes on the fastpair sim").
FASTPAIR = (("fast1", 10_000, 10_000), ("fast2", 10_000, 10_000), ("gbe", 1000, 1000), ("slowup", 300, 1000))


def _fastpair() -> list[HostSpec]:
    scale = _fit((0.3,) * len(FASTPAIR))
    return [
        HostSpec(n, "generic", 1500, 1500, up, down, down, cpu_cores=round(0.3 * scale, 3), link_peak=True)
        for n, up, down in FASTPAIR
    ]


def _fit(caps: tuple[float, ...]) -> float:
    """Scale for caps so that they sum to at most 3/4 of this machine's cores."""
    return min(1.0, 0.75 * (os.cpu_count() or 1) / sum(caps))


def _cores(hosts: int | None) -> list[HostSpec]:
    ncpu = os.cpu_count() or 1
    n = min(MAX_CORE_HOSTS, ncpu) if hosts is None else hosts
    if not 1 <= n <= ncpu:
        raise UsageError(f"scenario cores has one host per CPU: --hosts must be 1..{ncpu}, got {n}")
    out = []
    for i in range(n):
        r = CORES_RATES[i % len(CORES_RATES)]
        spec = HostSpec(f"core{i}", "generic", 1500, 1500, r, r, r, cpuset=str(i), own_machine=True, link_peak=True)
        out.append(spec)
    return out


def _hidden() -> list[HostSpec]:
    scale = _fit(tuple(c for _, c, _ in HIDDEN))
    return [
        HostSpec(n, "generic", 1500, 1500, r, r, r, round(c * scale, 3), HIDDEN_PERIOD_US, True, None, True, True)
        for n, c, r in HIDDEN
    ]


def cpu_limits(text: str | None, n: int) -> list[float | None] | None:
    """--cpu-limit: one figure for every host or one per host (comma-separated), in cores;
    0 uncaps. None when not given (the scenario's own caps stay)."""
    if text is None:
        return None
    try:
        vals = [float(x) for x in str(text).split(",")]
    except ValueError:
        raise UsageError(f"--cpu-limit wants cores like 0.5 or 0.15,0.25,...; got {text!r}") from None
    if len(vals) == 1:
        vals = vals * n
    if len(vals) != n:
        raise UsageError(f"--cpu-limit has {len(vals)} figures for {n} hosts")
    if any(v < 0 for v in vals):
        raise UsageError(f"--cpu-limit figures must be >= 0 cores (0 = uncapped), got {text}")
    total = sum(vals)
    if total > (os.cpu_count() or 1):
        raise UsageError(f"--cpu-limit caps sum to {total:g} cores, more than this machine's {os.cpu_count()}")
    return [v or None for v in vals]


def _mtu_lab() -> list[HostSpec]:
    return [
        HostSpec("j1", mtu=9000, port_mtu=9000),
        HostSpec("j2", mtu=9000, port_mtu=9000),
        HostSpec("jm", mtu=9000, port_mtu=1500),  # jumbo host on a 1500 switch port
        HostSpec("s1", mtu=1500, port_mtu=1500),  # plain host: MSS clamp hides the mismatch
    ]


def scenario(
    name: str,
    hosts: int | None = None,
    rate_mbit: float | None = None,
    mtu: int | None = None,
    cpu_limit: str | None = None,
    seed: int | None = None,
) -> list[HostSpec]:
    """Host specs for a scenario; `seed` picks the cluster of `random` (smolnet/sim/draw.py)."""
    if seed is not None and name != "random":
        raise UsageError(f"--seed applies to scenario 'random' only (not {name})")
    if name == "random" and seed is None:
        raise UsageError("scenario random needs --seed N (the draw's number, printed with its results)")
    specs = _scenario(name, hosts, rate_mbit, mtu, seed)
    caps = cpu_limits(cpu_limit, len(specs))
    if caps is not None:
        for s, c in zip(specs, caps):
            s.cpu_cores = c
    return specs


def _scenario(
    name: str, hosts: int | None = None, rate_mbit: float | None = None, mtu: int | None = None, seed: int | None = None
) -> list[HostSpec]:
    """Host specs for a scenario; options the scenario cannot honour are usage errors."""
    if name not in SCENARIOS:
        raise UsageError(f"unknown sim scenario {name!r} (one of {', '.join(SCENARIOS)})")
    if rate_mbit is not None and rate_mbit < 0:
        raise UsageError(f"--rate-mbit must be >= 0 (0 = unshaped), got {rate_mbit:g}")
    if name == "uniform":
        n = DEFAULT_UNIFORM_HOSTS if hosts is None else hosts
        if not 1 <= n <= MAX_HOSTS:
            raise UsageError(f"--hosts must be 1..{MAX_HOSTS}, got {n}")
        m = DEFAULT_UNIFORM_MTU if mtu is None else mtu
        if not 576 <= m <= 9000:
            raise UsageError(f"--mtu must be 576..9000, got {m}")
        rate = DEFAULT_UNIFORM_RATE if rate_mbit is None else rate_mbit
        shaped = rate or None
        return [HostSpec(f"node{i}", "generic", m, m, shaped, shaped, shaped) for i in range(1, n + 1)]
    if name == "cores":
        specs = _cores(hosts)
        hosts = None
    elif name == "random":
        from smolnet.sim.draw import draw

        specs = draw(seed)
    else:
        specs = {"home": _home, "mtu-lab": _mtu_lab, "hidden": _hidden, "fastpair": _fastpair}[name]()
    if hosts is not None and hosts != len(specs):
        raise UsageError(f"scenario {name} has {len(specs)} hosts; --hosts applies to 'uniform' and 'cores' only")
    if mtu is not None:
        raise UsageError(f"--mtu applies to scenario 'uniform' only ({name} fixes each host's MTU)")
    if rate_mbit is not None:  # one rate for every host and direction; 0 = unshaped
        for s in specs:
            s.up_mbit = s.down_mbit = s.nic_mbit = rate_mbit or None
    return specs


def tcp_goodput_mbit(rate_mbit: float, mtu: int) -> float:
    """TCP goodput through a tc tbf of `rate_mbit` at `mtu` (tbf counts the 14-byte
    Ethernet header, TCP/IP with timestamps costs 52 bytes)."""
    return rate_mbit * (mtu - 52) / (mtu + 14)


def path_truth(src: HostSpec, dst: HostSpec) -> dict:
    """What a src -> dst TCP flow should see: effective MTU, shaped rate, goodput.

    Frames above a switch port's MTU vanish silently, so when the larger of the two
    interface MTUs exceeds the smallest port MTU on the path while both interfaces allow
    it, TCP negotiates a segment size the wire cannot carry: a black hole.
    """
    iface = min(src.mtu, dst.mtu)
    wire = min(src.mtu, src.port_mtu, dst.port_mtu, dst.mtu)
    rates = [r for r in (src.up_mbit, dst.down_mbit) if r]
    rate = min(rates) if rates else None
    blackhole = wire < iface
    return {
        "mtu_configured": iface,
        "mtu_effective": wire,
        "blackhole": blackhole,
        "rate_mbit": rate,
        "goodput_mbit": None if (rate is None or blackhole) else tcp_goodput_mbit(rate, iface),
    }
