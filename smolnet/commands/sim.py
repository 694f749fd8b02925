"""`smolnet sim up|down|status`: the single-machine cluster of namespaced hosts."""

from __future__ import annotations

import sys

from smolnet.errors import UsageError
from smolnet.sim.scenarios import SCENARIOS


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION")
    u = sub.add_parser("up", help="build the sim and write its inventory")
    u.add_argument("--name", default="smol", help="sim name (default smol); several sims can run side by side")
    u.add_argument("--scenario", default="home", choices=SCENARIOS)
    u.add_argument(
        "--hosts", type=int, default=None, help="number of hosts (uniform: default 3; cores: one per CPU, up to 4)"
    )
    u.add_argument("--subnet", default="10.213.0.0/24", help="IPv4 subnet of the sim switch")
    u.add_argument(
        "--rate-mbit",
        type=float,
        default=None,
        help="shape every host to this rate both ways (0 = unshaped; uniform default 1000)",
    )
    u.add_argument("--mtu", type=int, default=None, help="interface and switch MTU (scenario uniform; default 1500)")
    u.add_argument("--inventory", default="inventory/sim.yml", help="where to write the inventory")
    u.add_argument(
        "--seed",
        type=int,
        default=None,
        help="scenario random: the draw to build (smolnet/sim/draw.py); a fresh one, printed, when not given",
    )
    u.add_argument(
        "--cpu-limit",
        default=None,
        metavar="CORES",
        help="cap each host's CPU (cgroup quota): one figure for all or one per host, "
        "comma-separated; 0 = uncapped (home default: 0.15,0.25,0.45,0.65)",
    )
    u.add_argument(
        "--loopback",
        action="store_true",
        help="no namespaces, no shaping: local hosts on 127.x addresses (also SMOL_SIM_LOOPBACK=1); "
        "only when asked, never as a silent fallback",
    )
    d = sub.add_parser("down", help="remove everything `sim up` made")
    d.add_argument("--name", default="smol")
    s = sub.add_parser("status", help="show the sim's hosts and whether they are alive")
    s.add_argument("--name", default="smol")
    s.add_argument("--json", action="store_true", help="print the state as JSON")


def _rate(h: dict) -> str:
    def fmt(r):
        return f"{r:g}" if r else "unshaped"

    return f"{fmt(h.get('down_mbit'))}/{fmt(h.get('up_mbit'))}"


def _cpu(h: dict) -> str:
    """The host's CPU: its cap (hidden: one it cannot read) and the CPUs it owns."""
    parts = []
    if h.get("cgroup") and h.get("cpu_cores"):
        parts.append(f"{h['cpu_cores']:g} cores" + (" (hidden)" if h.get("cpu_hidden") else ""))
    if h.get("cpuset_cgroup"):
        parts.append(f"cpu {h['cpuset']}")
    return ", ".join(parts) or "none"


def _table(st: dict):
    from rich.table import Table

    loop = st["mode"] == "loopback"
    where = "loopback (no namespaces, no shaping)" if loop else f"{st['subnet']}, controller {st['controller']}"
    seed = f" --seed {st['seed']}" if st.get("seed") is not None else ""
    t = Table(
        title=f"sim {st['name']}: scenario {st['scenario']}{seed}, {where}", caption=f"inventory {st['inventory']}"
    )
    t.add_column("host", no_wrap=True)
    t.add_column("address", no_wrap=True)
    t.add_column("device")
    t.add_column("mtu (port)", no_wrap=True)
    t.add_column("down/up Mbit/s", no_wrap=True)
    t.add_column("cpu cap", no_wrap=True)
    t.add_column("netns")
    t.add_column("sshd pid")
    for h in st["hosts"]:
        ok = h.get("ok", True)
        sshd = "local" if loop else (str(h["pid_sshd"]) if h.get("sshd_alive") else "[red]dead[/]")
        t.add_row(
            h["name"],
            h["address"],
            h["device"],
            str(h["mtu"]) if loop else f"{h['mtu']} ({h['port_mtu']})",
            "unshaped" if loop else _rate(h),
            _cpu(h),
            h.get("netns") or "-",
            sshd if ok else f"[red]{sshd}[/]",
        )
    return t


def run(args) -> int:
    from rich.console import Console

    from smolnet.sim import cluster as sim

    con = Console()
    if args.action == "up":
        kw = dict(
            name=args.name,
            scenario=args.scenario,
            hosts=args.hosts,
            subnet=args.subnet,
            inventory=args.inventory,
            rate_mbit=args.rate_mbit,
            mtu=args.mtu,
            cpu_limit=args.cpu_limit,
            seed=args.seed,
        )
        if args.scenario == "random" and args.seed is None:
            from smolnet.sim.draw import fresh_seed

            kw["seed"] = fresh_seed()
        loopback = True if args.loopback else None
        try:
            with con.status(f"building sim {args.name} ({args.scenario})"):
                st = sim.up(loopback=loopback, **kw)
        except sim.SimUnavailable as e:
            raise sim.SimUnavailable(
                f"{e}; for loopback hosts instead (no namespaces, no shaping, no "
                "provisioning) ask for them: smolnet sim up --loopback (or SMOL_SIM_LOOPBACK=1)",
                code=2,
            ) from None
        if st["mode"] == "loopback":
            print(
                "smolnet: LOOPBACK sim as asked: hosts are this machine on 127.x addresses; no namespaces, "
                "no link shaping, no MTU faults, nothing to provision",
                file=sys.stderr,
            )
        con.print(_table(sim.status(args.name) or st))
        con.print(f"inventory written to {st['inventory']}; tear down with: smolnet sim down --name {st['name']}")
        return 0
    if args.action == "down":
        st = sim.down(args.name)
        con.print(f"sim {args.name} removed" if st else f"sim {args.name} is not up (nothing to do)")
        return 0
    if args.action == "status":
        st = sim.status(args.name)
        if st is None:
            con.print(f"sim {args.name} is not up (start it with: smolnet sim up --name {args.name})")
            return 1
        if args.json:
            import json

            print(json.dumps(st, indent=2))
        else:
            con.print(_table(st))
        return 0 if all(h.get("ok", True) for h in st["hosts"]) else 1
    raise UsageError("usage: smolnet sim up|down|status [--name NAME] (see smolnet sim --help)")
