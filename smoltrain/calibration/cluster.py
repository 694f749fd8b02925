"""Calibrate every cluster host on the host itself, over SSH, into `smoltrain.compute/1`.

Hosts on different machines are measured at the same time; hosts that share a machine (one
kernel: the sim, or several ranks on one box) one after another, because each would
otherwise measure the others' load instead of its own speed. A host that fails is reported
with its reason and the rest are still measured.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import socket
from collections.abc import Callable
from datetime import datetime, timezone

from smolnet.inventory import Host
from smolnet.remote import RemoteError, connect

COMPUTE_SCHEMA = "smoltrain.compute/1"
ID_TIMEOUT = 30.0
PROBE_TIMEOUT = 600.0

Progress = Callable[[str, str], None]  # (host name, what is happening)


def _machine_id(h: Host) -> str:
    with connect(h) as r:
        res = r.run("cat /proc/sys/kernel/random/boot_id 2>/dev/null || cat /etc/machine-id", timeout=ID_TIMEOUT)
    mid = res.stdout.strip()
    if res.rc != 0 or not mid:
        raise RemoteError(h.name, "cannot read a machine id (boot_id or /etc/machine-id)")
    return mid


def probe_argv(h: Host, model: str, seconds: float) -> list[str]:
    return [h.python, "-m", "smoltrain.calibration.probe", "--model", model, "--seconds", f"{seconds:g}"]


def probe_host(h: Host, model: str, seconds: float, timeout: float = PROBE_TIMEOUT) -> dict:
    """Run the probe on `h`; its `hosts` entry, or raise RemoteError with the reason."""
    with connect(h) as r:
        res = r.run(probe_argv(h, model, seconds), timeout=timeout)
    if res.rc != 0:
        lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
        raise RemoteError(h.name, lines[-1] if lines else f"probe exited {res.rc}")
    try:
        doc = json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RemoteError(h.name, f"probe printed no JSON: {res.stdout.strip()[-120:]!r}") from None
    return {"name": h.name, "status": "ok", "error": None, **doc}


def _failed(name: str, err: str, machine_id: str | None = None) -> dict:
    return {"name": name, "status": "failed", "error": err, "machine_id": machine_id}


def calibrate_hosts(
    hosts: list[Host],
    model: str = "tiny",
    seconds: float = 0.5,
    progress: Progress | None = None,
    probe: Callable = probe_host,
) -> dict:
    """Measure `hosts`; the compute report (failed hosts carry status `failed` and `error`)."""
    say = progress or (lambda name, what: None)
    results: dict[str, dict] = {}
    ids: dict[str, str] = {}
    with cf.ThreadPoolExecutor(max(1, len(hosts))) as ex:
        futs = {ex.submit(_machine_id, h): h for h in hosts}
        for f in cf.as_completed(futs):
            h = futs[f]
            try:
                ids[h.name] = f.result()
                say(h.name, "waiting for its machine")
            except RemoteError as e:
                results[h.name] = _failed(h.name, e.cause)
                say(h.name, f"failed: {e.cause}")
    groups: dict[str, list[Host]] = {}
    for h in hosts:
        if h.name in ids:
            groups.setdefault(ids[h.name], []).append(h)

    def one_machine(group: list[Host]) -> None:
        for h in group:
            say(h.name, "measuring")
            try:
                doc = probe(h, model, seconds)
                doc["machine_id"] = ids[h.name]
                results[h.name] = doc
                say(h.name, "done: " + summary(doc))
            except RemoteError as e:
                results[h.name] = _failed(h.name, e.cause, ids[h.name])
                say(h.name, f"failed: {e.cause}")

    with cf.ThreadPoolExecutor(max(1, len(groups))) as ex:
        list(ex.map(one_machine, groups.values()))
    return {
        "schema": COMPUTE_SCHEMA,
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "controller": socket.gethostname(),
        "settings": {"model": model, "seconds": seconds, "threads": 1},
        "hosts": [results[h.name] for h in hosts],
    }


def summary(doc: dict) -> str:
    f = doc.get("flops") or {}
    ts = doc.get("train_step") or []
    cap = doc.get("cpu_limit_cores")
    parts = [
        f"fp32 {f.get('fp32', 0) / 1e9:,.1f} GFLOP/s",
        f"bf16 {f.get('bf16', 0) / 1e9:,.1f}",
        f"mem {doc.get('mem_bw_bytes_s', 0) / 1e9:,.1f} GB/s",
    ]
    if ts:
        parts.append(f"{ts[-1]['model']} step {ts[-1]['seconds'] * 1e3:,.0f} ms @ batch {ts[-1]['batch']}")
    parts.append(f"cap {cap:g} cores" if cap else f"{doc.get('cores')} cores")
    return ", ".join(parts)


def local_report(model: str = "tiny", seconds: float = 0.5, name: str | None = None) -> dict:
    """This machine alone (`calibrate --local`), probed in-process."""
    from smoltrain.calibration.probe import probe as run_probe

    doc = run_probe(model, seconds)
    return {
        "schema": COMPUTE_SCHEMA,
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "controller": socket.gethostname(),
        "settings": {"model": model, "seconds": seconds, "threads": 1},
        "hosts": [{"name": name or socket.gethostname(), "status": "ok", "error": None, **doc}],
    }
