"""Starting a group of ranks: ports for loopback runs, and the address table from an inventory.

A group needs world_size + 2 consecutive TCP ports from its base port: the rendezvous
(base; torch uses it for its store) and one listening port per rank (base + 1 + r).
"""

from __future__ import annotations

import os
import random
import socket

from smoltrain.comm.base import CommError


def ports_needed(world_size: int) -> int:
    return world_size + 2


def _ephemeral_low(default: int = 32768) -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def free_port_base(world_size: int, host: str = "127.0.0.1", tries: int = 200) -> int:
    """A base port with world_size + 2 free ports after it on host (for --local runs and tests).

    Chosen below the kernel's ephemeral range where there is room: a port the kernel hands to
    an outgoing connection between this check and the ranks' bind would otherwise take it."""
    rng = random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "little"))
    need = ports_needed(world_size)
    low = _ephemeral_low()
    top = low if low - need > 21000 else 60000
    for _ in range(tries):
        base = rng.randrange(20000, top - need)
        held = []
        try:
            for p in range(base, base + need):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                held.append(s)
                s.bind((host, p))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise CommError(f"no {need} consecutive free ports on {host}")


def inventory_group(hosts) -> tuple[str, int, list[str]]:
    """(coordinator address, base port, per-rank addresses) for ranks placed on inventory hosts.

    Rank r runs on hosts[r]; rank 0 (hosts[0], the coordinator) hosts the rendezvous on its
    smol_train_port. Several ranks on one address get distinct ports by construction.
    """
    if not hosts:
        raise CommError("no hosts to run on")
    return hosts[0].cluster_ip, hosts[0].train_port, [h.cluster_ip for h in hosts]
