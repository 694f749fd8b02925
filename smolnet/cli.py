"""`smolnet`: the network layer's command line."""

from __future__ import annotations

from smolnet.cli_dispatch import dispatch

COMMANDS = {
    "matrix": ("smolnet.commands.matrix", "measure every ordered pair of cluster hosts and write the link report"),
    "probe": ("smolnet.commands.probe", "measure one direction between two hosts"),
    "facts": ("smolnet.commands.facts", "CPUs, memory and interfaces of every host"),
    "agent": ("smolnet.commands.agent", "run the measurement agent on this host"),
    "sim": ("smolnet.commands.sim", "the single-machine cluster of namespaced hosts (up, down, status)"),
    "secret": ("smolnet.commands.secret", "create or show the cluster secret file"),
    "inventory": ("smolnet.commands.inventory", "show the hosts of an inventory with every variable resolved"),
}


def main(argv=None) -> int:
    return dispatch("smolnet", "Measure the links of a small cluster.", COMMANDS, argv)
