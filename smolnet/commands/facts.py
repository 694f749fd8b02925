"""`smolnet facts`: CPUs, memory and interfaces of every cluster host, read by its agent."""

from __future__ import annotations

import json


def add_arguments(p) -> None:
    p.add_argument("-i", "--inventory", required=True, help="Ansible inventory (group 'cluster')")
    p.add_argument("--hosts", default=None, help="comma-separated subset of cluster hosts")
    p.add_argument("--json", default=None, metavar="FILE", help="write the facts here as JSON")
    p.add_argument(
        "--secret-file", default=None, help="controller's secret (default: the inventory's smol_secret_file)"
    )


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from smolnet.inventory import load_inventory
    from smolnet.matrix import AgentPool, default_secret_path, host_entries
    from smolnet.report import write_atomic
    from smolnet.secret import ensure_secret

    inv = load_inventory(args.inventory)
    hosts = inv.select([n.strip() for n in args.hosts.split(",") if n.strip()] if args.hosts else None)
    pool = AgentPool(ensure_secret(args.secret_file or default_secret_path(hosts)))
    try:
        pool.ensure_all(hosts)
    finally:
        pool.stop_all()
    entries = host_entries(hosts, pool)
    for e in entries:
        ep = pool.endpoints.get(e["name"])
        e["facts"] = ep.facts if ep else None
    doc = {"schema": "smolnet.facts/1", "hosts": entries}
    if args.json:
        write_atomic(args.json, json.dumps(doc, indent=2) + "\n")
    t = Table(title="smolnet facts")
    for c in (
        "host",
        "hostname",
        "CPUs",
        "memory GiB",
        "cluster iface",
        "address",
        "MTU",
        "Mbit/s",
        "iperf3",
        "status",
    ):
        t.add_column(c)
    for e in entries:
        f = e["facts"] or {}
        t.add_row(
            e["name"],
            f.get("hostname", "-"),
            str(f.get("cpus_logical", "-")),
            f"{f['memory_bytes'] / 2**30:.1f}" if f.get("memory_bytes") else "-",
            e["iface"] or "-",
            e["address"],
            str(e["mtu_configured"] or "-"),
            str(e["link_rate_mbit"] or "unknown"),
            "yes" if e["iperf3"] else "no",
            e["status"] + (f": {e['error']}" if e["error"] else ""),
        )
    Console().print(t)
    return 0 if all(e["status"] == "ok" for e in entries) else 4
