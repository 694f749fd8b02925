"""One direction of one link, measured by asking the agents at both ends.

The controller never carries test traffic: it tells the agent on src to probe the
agent on dst and collects the figures. Each function returns plain dicts that
`report.assess_links` turns into contract link entries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from smolnet import agent_client as control
from smolnet.inventory import Host

DEFAULT_DURATION = 3.0
DEFAULT_OMIT = 1.0
DEFAULT_STREAMS = 4
RTT_COUNT = 300


@dataclass
class Endpoint:
    """A host whose agent answers: where to reach it and what it told us."""

    host: Host
    ip: str
    port: int
    iperf3: bool = False
    facts: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.host.name


def probe_rtt(src: Endpoint, dst: Endpoint, secret: bytes, count: int = RTT_COUNT) -> dict:
    return control.call(src.ip, src.port, secret, "rtt", timeout=60.0, dst=dst.ip, port=dst.port, count=count)


def probe_pmtu(src: Endpoint, dst: Endpoint, secret: bytes) -> dict:
    return control.call(src.ip, src.port, secret, "pmtu", timeout=90.0, dst=dst.ip, port=dst.port)


def pick_backend(requested: str, src: Endpoint, dst: Endpoint) -> str:
    if requested == "auto":
        return "iperf3" if (src.iperf3 and dst.iperf3) else "builtin"
    return requested


def probe_throughput(
    src: Endpoint,
    dst: Endpoint,
    secret: bytes,
    duration: float = DEFAULT_DURATION,
    backend: str = "auto",
    omit: float = DEFAULT_OMIT,
    streams: int = DEFAULT_STREAMS,
) -> dict:
    """Receiver-side goodput src -> dst, warm-up excluded."""
    method = pick_backend(backend, src, dst)
    wait = duration + omit + 45.0
    if method == "iperf3":
        if not (src.iperf3 and dst.iperf3):
            missing = src.name if not src.iperf3 else dst.name
            raise control.AgentError(f"iperf3 is not installed on {missing}")
        srv = control.call(dst.ip, dst.port, secret, "iperf3_server", timeout=15.0, lifetime=wait)
        port = int(srv["port"])
    else:
        port = dst.port
    return control.call(
        src.ip,
        src.port,
        secret,
        "throughput",
        timeout=wait,
        dst=dst.ip,
        port=port,
        duration=duration,
        omit=omit,
        streams=streams,
        backend=method,
    )
