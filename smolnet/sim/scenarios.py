"""The sim's built-in clusters and the truth each one carries.

A scenario is a list of host specs: name, device profile, interface MTU, switch-port
MTU and shaped rates. Tests and users check every smolnet tool against these numbers,
so they live in one place and the README states the same values.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from smolnet.errors import UsageError

SCENARIOS = ("home", "uniform", "mtu-lab")
DEFAULT_UNIFORM_HOSTS = 3
DEFAULT_UNIFORM_RATE = 1000
DEFAULT_UNIFORM_MTU = 1500
MAX_HOSTS = 32


@dataclass
class HostSpec:
    name: str
    device: str = "generic"
    mtu: int = 1500                  # the host's eth0 MTU (what its owner configured)
    port_mtu: int = 1500             # the switch port's MTU (what the wire really carries)
    up_mbit: float | None = None     # shaped host -> switch rate; None = unshaped
    down_mbit: float | None = None   # shaped switch -> host rate; None = unshaped
    nic_mbit: float | None = None    # rated NIC speed, written as link_rate_mbit

    def to_dict(self) -> dict:
        return asdict(self)


def _home() -> list[HostSpec]:
    return [
        HostSpec("pi5", "pi5", 1500, 1500, 1000, 1000, 1000),
        HostSpec("jetson", "jetson-orin-nano", 1500, 1500, 300, 1000, 1000),   # slow uplink
        HostSpec("macmini", "mac-mini-m4", 9000, 9000, 2500, 2500, 2500),
        HostSpec("laptop", "rtx4050-laptop", 9000, 1500, 1000, 1000, 1000),    # silent mismatch
    ]


def _mtu_lab() -> list[HostSpec]:
    return [
        HostSpec("j1", mtu=9000, port_mtu=9000),
        HostSpec("j2", mtu=9000, port_mtu=9000),
        HostSpec("jm", mtu=9000, port_mtu=1500),    # jumbo host on a 1500 switch port
        HostSpec("s1", mtu=1500, port_mtu=1500),    # plain host: MSS clamp hides the mismatch
    ]


def scenario(name: str, hosts: int | None = None, rate_mbit: float | None = None,
             mtu: int | None = None) -> list[HostSpec]:
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
    specs = _home() if name == "home" else _mtu_lab()
    if hosts is not None and hosts != len(specs):
        raise UsageError(f"scenario {name} has {len(specs)} hosts; --hosts applies to 'uniform' only")
    if mtu is not None:
        raise UsageError(f"--mtu applies to scenario 'uniform' only ({name} fixes each host's MTU)")
    if rate_mbit is not None:   # one rate for every host and direction; 0 = unshaped
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
