"""What a host is made of (CPUs, memory, interfaces), read with psutil on the host itself.

The link report needs each end's real interface MTU and rated speed: the inventory
says what a link *should* be, the facts say what the host is actually set to.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
from pathlib import Path


def machine_id() -> str:
    """Ranks on one kernel share its cores: the boot id names the kernel (a VM has its own,
    a namespace or container does not), the machine id where there is no boot id."""
    for p in ("/proc/sys/kernel/random/boot_id", "/etc/machine-id"):
        try:
            v = Path(p).read_text().strip()
            if v:
                return v
        except OSError:
            continue
    import socket

    return socket.gethostname()


def _iface_for(addr: str | None, addrs: dict) -> str | None:
    """The interface that holds addr, or None."""
    if not addr:
        return None
    for name, entries in addrs.items():
        for a in entries:
            if a.family in (socket.AF_INET, socket.AF_INET6) and a.address.split("%")[0] == addr:
                return name
    # a loopback alias (127.0.0.x) is served by lo even when not listed
    try:
        if ipaddress.ip_address(addr).is_loopback:
            for name, entries in addrs.items():
                if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in entries):
                    return name
    except ValueError:
        pass
    return None


def collect_facts(cluster_ip: str | None = None, cluster_iface: str | None = None) -> dict:
    """Facts of this host; `iface` is cluster_iface if given, else the one holding cluster_ip."""
    import psutil

    addrs = psutil.net_if_addrs()
    stats = psutil.net_if_stats()
    interfaces = []
    for name in sorted(addrs):
        st = stats.get(name)
        interfaces.append(
            {
                "name": name,
                "addresses": [a.address for a in addrs[name] if a.family in (socket.AF_INET, socket.AF_INET6)],
                "mtu": st.mtu if st else None,
                "speed_mbit": (st.speed or None) if st else None,
                "up": bool(st.isup) if st else False,
            }
        )
    iface = cluster_iface if cluster_iface in addrs else _iface_for(cluster_ip, addrs)
    chosen = next((i for i in interfaces if i["name"] == iface), None)
    mem = psutil.virtual_memory()
    return {
        "hostname": socket.gethostname(),
        "cpus_logical": psutil.cpu_count(logical=True),
        "cpus_physical": psutil.cpu_count(logical=False),
        "memory_bytes": mem.total,
        "memory_available_bytes": mem.available,
        "load_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "cluster_ip": cluster_ip,
        "iface": iface,
        "iface_mtu": chosen["mtu"] if chosen else None,
        "iface_speed_mbit": chosen["speed_mbit"] if chosen else None,
        "interfaces": interfaces,
        "iperf3": shutil.which("iperf3") is not None,
    }
