"""`smolnet matrix`: every ordered pair of cluster hosts, one report."""

from __future__ import annotations

from smolnet.errors import UsageError
from smolnet.inventory import load_inventory

BACKENDS = ("auto", "iperf3", "builtin")


def add_arguments(p) -> None:
    p.add_argument("-i", "--inventory", required=True, help="Ansible inventory (group 'cluster')")
    p.add_argument("--duration", type=float, default=3.0, help="seconds per throughput test after warm-up (default 3)")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="throughput probe: iperf3 when both ends have it (auto), or force one",
    )
    p.add_argument("--hosts", default=None, help="comma-separated subset of cluster hosts")
    p.add_argument("--out", default="reports", help="directory for links.json, links.md, links.png (default reports/)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the JSON report here")
    p.add_argument("--sequential", action="store_true", help="one test at a time (to compare with rounds)")
    p.add_argument("--streams", type=int, default=4, help="parallel TCP streams per test (default 4)")
    p.add_argument(
        "--secret-file", default=None, help="controller's secret (default: the inventory's smol_secret_file)"
    )


def check_args(args) -> None:
    if not 0.5 <= args.duration <= 120:
        raise UsageError(f"--duration must be 0.5..120 seconds, got {args.duration:g}")
    if not 1 <= args.streams <= 16:
        raise UsageError(f"--streams must be 1..16, got {args.streams}")


def run(args) -> int:
    from smolnet.matrix import run_cli

    check_args(args)
    inv = load_inventory(args.inventory)
    names = [n.strip() for n in args.hosts.split(",") if n.strip()] if args.hosts else None
    hosts = inv.select(names)
    if len(hosts) < 2:
        raise UsageError("a link matrix needs at least two hosts")
    if len({h.name for h in hosts}) != len(hosts):
        raise UsageError("--hosts names a host twice")
    return run_cli(hosts, args, pairs=None)
