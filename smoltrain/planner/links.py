"""The links the plan lays traffic on: measured (a smolnet.links/1 report) or a link class.

Each directed pair gets a goodput (Mbit/s) and a per-message latency alpha; a ring or a
star then takes its time from these. Latency alpha is half the measured application-level
round trip (one way), which already includes a Python peer on each end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from smolnet.errors import UsageError
from smolnet.files import read_json
from smoltrain.planner.devices import LINK_CLASSES, get_link_class

LINKS_SCHEMA = "smolnet.links/1"


@dataclass
class Link:
    rate_mbit: float | None  # None or 0: down
    rtt_us: float
    status: str = "ok"

    @property
    def up(self) -> bool:
        return bool(self.rate_mbit) and self.status != "down"

    @property
    def bytes_per_s(self) -> float:
        return (self.rate_mbit or 0.0) * 1e6 / 8

    @property
    def alpha_s(self) -> float:
        return self.rtt_us / 2 * 1e-6

    def seconds(self, nbytes: float, messages: float = 1) -> float:
        """The one link-time formula of the planner: messages x alpha + bytes / goodput
        (inf on a down link). Every plan times its transfers here, so they cannot drift."""
        return messages * self.alpha_s + nbytes / self.bytes_per_s if self.up else math.inf


@dataclass
class LinkModel:
    """Directed links between named hosts, and where the figures came from."""

    source: dict
    links: dict[tuple[str, str], Link] = field(default_factory=dict)
    default: Link | None = None  # used for every pair when built from a link class
    nic_mbit: dict[str, float] = field(default_factory=dict)  # each host's rated NIC speed
    wire: LinkModel | None = None  # links before each host's CPU cost was added
    cpu_bytes_s: dict[str, float] = field(default_factory=dict)  # bytes/s a host's CPU moves

    def get(self, src: str, dst: str) -> Link:
        if (src, dst) in self.links:
            return self.links[(src, dst)]
        if self.default is not None:
            return self.default
        raise UsageError(
            f"links report has no measurement {src} -> {dst} (run `smolnet matrix` again over these hosts)"
        )

    def egress_bytes_per_s(self, host: str, peers: list[str]) -> float:
        """A host's own NIC: what it sends to all peers at once (a server's star)."""
        return self._nic(host, peers, out=True)

    def ingress_bytes_per_s(self, host: str, peers: list[str]) -> float:
        return self._nic(host, peers, out=False)

    def _nic(self, host: str, peers: list[str], out: bool) -> float:
        """The best goodput the host showed with anyone (the others share it), scaled up to
        its rated speed where that pair was held back by a slower peer's NIC: a 2.5 Gbit Mac
        mini measured against 1 Gbit hosts feeds two and a half of them at once. No faster
        than the host's CPU moves bytes, where that was measured."""
        if self.wire is not None:
            wire = self.wire._nic(host, peers, out)
            cpu = self.cpu_bytes_s.get(host)
            return min(wire, cpu) if cpu else wire
        best = 0.0
        mine = self.nic_mbit.get(host)
        for p in peers:
            if p == host:
                continue
            rate = (self.get(host, p) if out else self.get(p, host)).bytes_per_s
            theirs = self.nic_mbit.get(p)
            if mine and theirs and theirs < mine:
                rate *= mine / theirs
            best = max(best, rate)
        return best


def from_class(name: str) -> LinkModel:
    lc = get_link_class(name)
    return LinkModel(
        source={
            "kind": "link-class",
            "link_class": lc.name,
            "rated_mbit": lc.rated_mbit,
            "goodput_mbit": lc.goodput_mbit,
            "rtt_us": lc.rtt_us,
        },
        default=Link(lc.goodput_mbit, lc.rtt_us),
    )


def read_report(path: str) -> dict:
    p = Path(path)
    doc = read_json(p, "links report", " (run `smolnet matrix -i INVENTORY`)", schema=LINKS_SCHEMA)
    doc.setdefault("_path", str(p))
    return doc


def report_hosts(doc: dict) -> list[str]:
    names = [h.get("name") for h in doc.get("hosts") or [] if isinstance(h, dict) and h.get("name")]
    if not names:  # older or partial reports: take the names from the links themselves
        for ln in doc.get("links") or []:
            for k in ("src", "dst"):
                if ln.get(k) and ln[k] not in names:
                    names.append(ln[k])
    return names


def from_report(doc: dict, hosts: list[str]) -> LinkModel:
    """Links among `hosts` from a report; a clear error when the report lacks any of them."""
    where = doc.get("_path", "links report")
    if not isinstance(doc, dict) or doc.get("schema") != LINKS_SCHEMA:
        raise UsageError(f"{where}: not a {LINKS_SCHEMA} report")
    known = set(report_hosts(doc))
    missing = [h for h in hosts if h not in known]
    if missing:
        raise UsageError(
            f"{where} lacks hosts {', '.join(missing)} of the inventory "
            f"(it has {', '.join(sorted(known)) or 'none'}; run `smolnet matrix` again)"
        )
    model = LinkModel(source={"kind": "links-report", "path": where, "created": doc.get("created")})
    for h in doc.get("hosts") or []:
        if isinstance(h, dict) and h.get("name") in hosts and h.get("link_rate_mbit"):
            model.nic_mbit[h["name"]] = float(h["link_rate_mbit"])
    for ln in doc.get("links") or []:
        src, dst = ln.get("src"), ln.get("dst")
        if src not in hosts or dst not in hosts:
            continue
        rtt = ln.get("rtt_us") or {}
        p50 = rtt.get("p50") if isinstance(rtt, dict) else rtt
        status = ln.get("status", "ok")
        rate = ln.get("throughput_mbit")
        model.links[(src, dst)] = Link(
            float(rate) if rate and status != "down" else None, float(p50) if p50 else 200.0, status
        )
    absent = [f"{a} -> {b}" for a in hosts for b in hosts if a != b and (a, b) not in model.links]
    if absent:
        raise UsageError(
            f"{where}: no measurement for {', '.join(absent[:4])}"
            f"{' ...' if len(absent) > 4 else ''} (run `smolnet matrix` again)"
        )
    return model


def find_report(hosts: list[str], paths=("reports/links.json",)) -> dict | None:
    """The newest links report that covers all `hosts` (what `smoltrain run` plans on), or None."""
    best = None
    for p in paths:
        try:
            doc = read_report(p)
        except UsageError:
            continue
        newer = best is None or str(doc.get("created") or "") > str(best.get("created") or "")
        if set(hosts) <= set(report_hosts(doc)) and newer:
            best = doc
    return best


def link_model(names: list[str], hosts=None, links: dict | None = None, link_class: str | None = None) -> LinkModel:
    """Measured links first, then a named class, then the inventory's rated speeds."""
    if links is not None and link_class is not None:
        raise UsageError("give either a links report or a link class, not both")
    if links is not None:
        return from_report(links, names)
    if link_class is not None:
        return from_class(link_class)
    if hosts is None or all(getattr(h, "local", False) for h in hosts):
        lm = from_class("loopback")
        lm.source["assumed"] = "no links report or link class; ranks on this machine"
        return lm
    rates = [h.link_rate_mbit for h in hosts if getattr(h, "link_rate_mbit", None)]
    if rates:
        lc = LINK_CLASSES["1gbe"]
        good = min(rates) * lc.goodput_mbit / lc.rated_mbit
        return LinkModel(
            source={
                "kind": "inventory",
                "rated_mbit": min(rates),
                "goodput_mbit": good,
                "rtt_us": lc.rtt_us,
                "assumed": "link_rate_mbit from the inventory",
            },
            default=Link(good, lc.rtt_us),
        )
    lm = from_class("1gbe")
    lm.source["assumed"] = "no links report, link class or link_rate_mbit; 1 GbE assumed"
    return lm
