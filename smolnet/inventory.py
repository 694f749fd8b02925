"""The inventory: an Ansible inventory, read with Ansible's own loader.

It is the single source of truth for provisioning, measurement and training. This
module resolves every contract variable to a value (or an explicit "unknown") so the
rest of smolcluster never has to know Ansible's precedence rules.
"""

from __future__ import annotations

import ipaddress
import os
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from smolnet.errors import SmolError

DEVICE_PROFILES = ("pi4", "pi5", "jetson-orin-nano", "mac-mini-m4", "rtx4050-laptop", "generic")
TORCH_DEVICES = ("auto", "cpu", "cuda", "mps")
NFS_IMPLS = ("kernel", "ganesha")
MIN_MTU, MAX_MTU = 576, 65535
EXAMPLE = "inventory/hosts.example.yml"


class InventoryError(SmolError):
    """A one-line, user-facing reason the inventory cannot be used."""

    code = 2


@dataclass
class Host:
    name: str
    address: str  # where SSH reaches it (ansible_host)
    cluster_ip: str  # where measurement and training traffic goes
    port: int = 22
    user: str | None = None
    key_file: str | None = None
    local: bool = False  # ansible_connection: local
    cluster_iface: str | None = None
    mtu: int = 1500
    link_rate_mbit: float | None = None
    device: str = "generic"
    python: str = "python3"
    agent_port: int = 7650
    train_port: int = 7700
    secret_file: str = "~/.config/smolcluster/secret"
    torch_device: str = "auto"
    threads: int | None = None  # smol_threads: torch threads per rank (None: the CPUs the host may use)
    known_hosts_file: str | None = None
    host_key_checking: bool = True
    groups: list[str] = field(default_factory=list)
    vars: dict = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("vars")
        return d


@dataclass
class Inventory:
    path: str
    hosts: list[Host]  # the `cluster` group, in inventory order
    coordinator: Host
    nfs_server: Host | None
    nfs_export_dir: str = "/srv/models"
    nfs_mount_dir: str = "/mnt/models"

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise InventoryError(f"{self.path}: no host named {name!r} in group 'cluster'")

    def select(self, names: list[str] | None) -> list[Host]:
        return self.hosts if not names else [self.host(n) for n in names]


def _int(value, what: str, host: str, lo: int | None = None, hi: int | None = None) -> int:
    try:
        if isinstance(value, bool):
            raise ValueError
        n = int(str(value).strip())
    except (TypeError, ValueError):
        raise InventoryError(f"host {host}: {what} must be an integer, got {value!r}") from None
    if (lo is not None and n < lo) or (hi is not None and n > hi):
        raise InventoryError(f"host {host}: {what} {n} is outside {lo}..{hi}")
    return n


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(str(text))
    except ValueError:
        return False
    return True


def _bool(value) -> bool:
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in ("1", "yes", "true", "on")


_PATCHED = (("sys", "intern"), ("socket", "getaddrinfo"), ("dataclasses", "_is_type"))


def _load_ansible(path: Path):
    """Ansible's loader, with its monkey-patches confined to the call.

    Importing ansible-core replaces sys.intern, socket.getaddrinfo and a dataclasses
    helper process-wide; torch's compiler then refuses the patched sys.intern (any
    torch.optim optimizer fails). So put the originals back once the inventory is read,
    and let ansible re-apply its patches for the next read.
    """
    import importlib

    saved = [(importlib.import_module(m), a, getattr(importlib.import_module(m), a, None)) for m, a in _PATCHED]
    try:
        try:
            from ansible.module_utils._internal._patches import (
                _dataclass_annotation_patch,
                _socket_patch,
                _sys_intern_patch,
            )

            for patch in (
                _sys_intern_patch.SysInternPatch,
                _socket_patch.GetAddrInfoPatch,
                _dataclass_annotation_patch.DataclassesIsTypePatch,
            ):
                patch.patch()
        except (ImportError, AttributeError):
            pass  # another ansible-core layout: its patches, if any, apply at import
        return _read_with_ansible(path)
    finally:
        for module, attr, value in saved:
            if value is not None:
                setattr(module, attr, value)


def _read_with_ansible(path: Path):
    """Return (groups -> host names, host name -> merged vars) via Ansible's loader."""
    os.environ.setdefault("ANSIBLE_LOCALHOST_WARNING", "False")
    os.environ.setdefault("ANSIBLE_INVENTORY_UNPARSED_WARNING", "False")
    try:
        from ansible.inventory.manager import InventoryManager
        from ansible.parsing.dataloader import DataLoader
        from ansible.vars.manager import VariableManager
    except ImportError:
        raise InventoryError("ansible is not installed here (run 'make setup')") from None
    loader = DataLoader()
    with _AnsibleWarnings() as said:
        try:
            inv = InventoryManager(loader=loader, sources=[str(path)])
        except Exception as e:  # ansible raises many types; all are one-line errors to us
            raise InventoryError(f"{path}: cannot parse inventory: {_one_line(e)}") from None
        if not inv._inventory.processed_sources:
            # every plugin failed: Ansible would print ~20 lines of warnings and go on with no hosts
            raise InventoryError(f"{path}: cannot parse inventory: {said.failure()}")
    said.replay()  # warnings about an inventory that did parse are worth seeing
    if not inv.get_hosts() and not inv.groups.get("cluster"):
        raise InventoryError(f"{path}: no hosts found (is it a valid Ansible inventory?)")
    vm = VariableManager(loader=loader, inventory=inv)
    groups = {name: [h.name for h in g.get_hosts()] for name, g in inv.groups.items()}
    hostvars = {}
    for h in inv.get_hosts():
        v = vm.get_vars(host=h, include_hostvars=False)
        hostvars[h.name] = {k: v[k] for k in v if not k.startswith("ansible_facts")}
        hostvars[h.name]["group_names"] = sorted(g.name for g in h.get_groups() if g.name != "all")
    return groups, hostvars


def _one_line(e: BaseException) -> str:
    """Ansible's message, with the YAML position when there is one, on one line."""
    text = " ".join(str(e).split())
    cause = e.__cause__ or e.__context__
    mark = getattr(cause, "problem_mark", None)
    if mark is not None:
        text += f" (line {mark.line + 1}, column {mark.column + 1})"
    return text


class _AnsibleWarnings:
    """Holds Ansible's warnings while an inventory is read: a file no plugin can parse becomes
    one line (the YAML plugin's reason, where it is), not a screen of per-plugin warnings."""

    def __enter__(self) -> _AnsibleWarnings:
        from ansible.utils.display import Display

        self.display, self.held, self.failures = Display(), [], []
        self.saved = {m: self.display.__dict__.get(m) for m in ("warning", "error_as_warning")}
        self.display.warning = lambda msg, *a, **k: self.held.append((msg, a, k))
        self.display.error_as_warning = lambda msg=None, exception=None, *a, **k: self.failures.append((msg, exception))
        return self

    def __exit__(self, *exc) -> None:
        for m, v in self.saved.items():
            if v is None:
                self.display.__dict__.pop(m, None)
            else:
                setattr(self.display, m, v)

    def failure(self) -> str:
        if not self.failures:
            return "no inventory plugin could read it"

        def rank(f) -> int:  # a YAML syntax error with its position, then the YAML plugin's reason
            cause = f[1] is not None and (f[1].__cause__ or f[1].__context__)
            return 0 if getattr(cause, "problem_mark", None) else 1 if "'yaml'" in str(f[0]) else 2

        best = min(self.failures, key=rank)
        return _one_line(best[1]) if best[1] is not None else str(best[0])

    def replay(self) -> None:
        for msg, a, k in self.held:
            if "No inventory was parsed" not in str(msg):
                self.display.warning(msg, *a, **k)


def _host(name: str, v: dict) -> Host:
    local = str(v.get("ansible_connection", "")).strip() == "local"
    address = v.get("ansible_host") or v.get("cluster_ip")
    if not address and _is_ip(name):
        address = name  # Ansible connects to the inventory name itself
    if not address and local:
        address = "127.0.0.1"
    if not address:
        raise InventoryError(f"host {name}: no address (set ansible_host or cluster_ip)")
    address = str(address).strip()
    cluster_ip = str(v.get("cluster_ip") or address).strip()
    try:
        ipaddress.ip_address(cluster_ip)
    except ValueError:
        if v.get("cluster_ip"):
            raise InventoryError(f"host {name}: cluster_ip {cluster_ip!r} is not an IP address") from None
        raise InventoryError(
            f"host {name}: ansible_host {cluster_ip!r} is not an IP address; set cluster_ip "
            "to the address measurement and training traffic should use"
        ) from None
    mtu = _int(v.get("mtu", 1500), "mtu", name, MIN_MTU, MAX_MTU)
    rate = v.get("link_rate_mbit")
    if rate is not None and str(rate).strip() != "":
        try:
            rate = float(rate)
        except (TypeError, ValueError):
            raise InventoryError(f"host {name}: link_rate_mbit must be a number, got {rate!r}") from None
        if rate <= 0:
            raise InventoryError(f"host {name}: link_rate_mbit must be positive, got {rate}")
    else:
        rate = None
    device = str(v.get("device", "generic")).strip()
    if device not in DEVICE_PROFILES:
        raise InventoryError(f"host {name}: unknown device profile {device!r} (one of {', '.join(DEVICE_PROFILES)})")
    torch_device = str(v.get("smol_device", "auto")).strip()
    if torch_device not in TORCH_DEVICES:
        raise InventoryError(
            f"host {name}: smol_device must be one of {', '.join(TORCH_DEVICES)}, got {torch_device!r}"
        )
    threads = v.get("smol_threads")
    threads = None if threads is None or str(threads).strip() == "" else _int(threads, "smol_threads", name, 1, 4096)
    hkc = v.get("smol_host_key_checking", v.get("ansible_host_key_checking", True))
    ssh_args = str(v.get("ansible_ssh_common_args", "")) + " " + str(v.get("ansible_ssh_extra_args", ""))
    if re.search(r"StrictHostKeyChecking[=\s]+[\"']?(no|off)\b", ssh_args, re.IGNORECASE):
        hkc = False
    known_hosts = v.get("smol_known_hosts_file")
    m = re.search(r"UserKnownHostsFile[=\s]+[\"']?([^\s\"']+)", ssh_args, re.IGNORECASE)
    if not known_hosts and m:
        known_hosts = m.group(1)
    iface = v.get("cluster_iface")
    return Host(
        name=name,
        address=address,
        cluster_ip=cluster_ip,
        port=_int(v.get("ansible_port", 22), "ansible_port", name, 1, 65535),
        user=str(v["ansible_user"]) if v.get("ansible_user") else None,
        key_file=os.path.expanduser(str(v["ansible_ssh_private_key_file"]))
        if v.get("ansible_ssh_private_key_file")
        else None,
        local=local,
        cluster_iface=str(iface) if iface else None,
        mtu=mtu,
        link_rate_mbit=rate,
        device=device,
        python=str(v.get("smol_python") or (sys.executable if local else "python3")),
        agent_port=_int(v.get("smol_agent_port", 7650), "smol_agent_port", name, 1, 65535),
        train_port=_int(v.get("smol_train_port", 7700), "smol_train_port", name, 1, 65535),
        secret_file=str(v.get("smol_secret_file", "~/.config/smolcluster/secret")),
        torch_device=torch_device,
        threads=threads,
        known_hosts_file=os.path.expanduser(str(known_hosts)) if known_hosts else None,
        host_key_checking=_bool(hkc),
        groups=list(v.get("group_names", [])),
        vars=v,
    )


def load_inventory(path: str | os.PathLike) -> Inventory:
    p = Path(path)
    if not p.exists():
        raise InventoryError(f"{p}: no such inventory (copy {EXAMPLE} to {p} and edit it)")
    groups, hostvars = _load_ansible(p)
    names = groups.get("cluster") or []
    if not names:
        raise InventoryError(f"{p}: group 'cluster' is empty or missing")
    hosts = [_host(n, hostvars[n]) for n in names]
    seen: dict[str, str] = {}
    for h in hosts:
        if h.cluster_ip in seen:
            raise InventoryError(f"{p}: hosts {seen[h.cluster_ip]} and {h.name} share cluster_ip {h.cluster_ip}")
        seen[h.cluster_ip] = h.name
    coord_names = groups.get("coordinator") or []
    if len(coord_names) > 1:
        raise InventoryError(f"{p}: group 'coordinator' has {len(coord_names)} hosts, at most 1 allowed")
    by_name = {h.name: h for h in hosts}
    if coord_names:
        if coord_names[0] not in by_name:
            raise InventoryError(f"{p}: coordinator {coord_names[0]} is not in group 'cluster'")
        coordinator = by_name[coord_names[0]]
    else:
        coordinator = hosts[0]
    nfs_names = groups.get("nfs_server") or []
    if len(nfs_names) > 1:
        raise InventoryError(f"{p}: group 'nfs_server' has {len(nfs_names)} hosts, at most 1 allowed")
    nfs = None
    if nfs_names:
        nfs = by_name.get(nfs_names[0]) or _host(nfs_names[0], hostvars[nfs_names[0]])
    ref = hostvars[nfs.name] if nfs else hostvars[names[0]]
    for h in hosts:
        impl = str(h.vars.get("nfs_server_impl", "kernel"))
        if impl not in NFS_IMPLS:
            raise InventoryError(f"host {h.name}: nfs_server_impl must be kernel or ganesha, got {impl!r}")
    return Inventory(
        path=str(p),
        hosts=hosts,
        coordinator=coordinator,
        nfs_server=nfs,
        nfs_export_dir=str(ref.get("nfs_export_dir", "/srv/models")),
        nfs_mount_dir=str(ref.get("nfs_mount_dir", "/mnt/models")),
    )
