"""`smolnet probe SRC DST`: one direction, same report schema as the matrix."""

from __future__ import annotations

from smolnet.commands.matrix import BACKENDS, check_args
from smolnet.errors import UsageError
from smolnet.inventory import load_inventory


def add_arguments(p) -> None:
    p.add_argument("src", help="sending host (inventory name)")
    p.add_argument("dst", help="receiving host (inventory name)")
    p.add_argument("-i", "--inventory", required=True, help="Ansible inventory (group 'cluster')")
    p.add_argument("--duration", type=float, default=3.0, help="seconds of throughput after warm-up (default 3)")
    p.add_argument("--backend", choices=BACKENDS, default="auto")
    p.add_argument("--json", default=None, metavar="FILE", help="write the JSON report here")
    p.add_argument("--out", default=None, help="also write links.json/md/png under this directory")
    p.add_argument("--streams", type=int, default=4, help="parallel TCP streams (default 4)")
    p.add_argument(
        "--secret-file", default=None, help="controller's secret (default: the inventory's smol_secret_file)"
    )


def run(args) -> int:
    from smolnet.matrix import run_cli

    check_args(args)
    if args.src == args.dst:
        raise UsageError("SRC and DST must be different hosts")
    inv = load_inventory(args.inventory)
    hosts = [inv.host(args.src), inv.host(args.dst)]
    args.sequential = True
    return run_cli(hosts, args, pairs=[(args.src, args.dst)])
