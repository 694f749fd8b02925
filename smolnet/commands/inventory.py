"""`smolnet inventory -i FILE [--json]`: what every part of smolcluster will read."""

from __future__ import annotations

import json

from smolnet.inventory import load_inventory


def add_arguments(p) -> None:
    p.add_argument("-i", "--inventory", required=True)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args) -> int:
    inv = load_inventory(args.inventory)
    if args.json:
        print(
            json.dumps(
                {
                    "coordinator": inv.coordinator.name,
                    "nfs_server": inv.nfs_server.name if inv.nfs_server else None,
                    "hosts": [h.to_dict() for h in inv.hosts],
                },
                indent=2,
            )
        )
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{inv.path}: {len(inv.hosts)} hosts, coordinator {inv.coordinator.name}")
    for col in ("host", "ssh", "cluster_ip", "iface", "mtu", "rate Mbit/s", "device", "connection"):
        t.add_column(col)
    for h in inv.hosts:
        t.add_row(
            h.name,
            f"{h.user or ''}@{h.address}:{h.port}",
            h.cluster_ip,
            h.cluster_iface or "auto",
            str(h.mtu),
            f"{h.link_rate_mbit:g}" if h.link_rate_mbit else "unknown",
            h.device,
            "local" if h.local else "ssh",
        )
    Console().print(t)
    return 0
