"""Calibrate every cluster host on the host itself, over SSH, into `smoltrain.compute/1`.

Hosts on different machines are measured at the same time. Hosts that share a machine (one
kernel: the sim, or several ranks on one box) are measured as many at a time as their readable
CPU caps leave the machine room for (together.py: all, some or one); beyond that one after
another, because each would measure the others' load instead of its own speed. The report's
`machines` says how many were measured at once and why. A host that fails is reported with its
reason and the rest are still measured.

With `repeats` > 1 every host is probed that many times and each figure is the median. Hosts
measured one after another go round by round (a, b, c, a, b, c, ...), so a slow spell of the
machine lands on one probe of several hosts rather than on every probe of one host; where two
or more run at once, each takes the next host of the round that is free (_Queue). Each host's
probe process stays open from its first round to its last (session.py): it starts once.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import os
import socket
import statistics
import threading
from collections.abc import Callable
from datetime import datetime, timezone

from smolnet import warm
from smolnet.inventory import Host
from smolnet.remote import RemoteError, connect
from smoltrain.calibration import together
from smoltrain.calibration.session import ProbeSession
from smoltrain.run import WORKER_IMPORTS

COMPUTE_SCHEMA = "smoltrain.compute/1"
ID_TIMEOUT = 30.0
PROBE_TIMEOUT = 600.0

Progress = Callable[[str, str], None]  # (host name, what is happening)


def _host_facts(h: Host) -> tuple[str, dict]:
    """(machine id, {cpus, cpu_limit_cores}) in one round trip (together.read_command)."""
    with connect(h) as r:
        res = r.run(together.read_command(h.python), timeout=ID_TIMEOUT)
    mid, facts = together.parse(res.stdout)
    if not mid:
        raise RemoteError(h.name, "cannot read a machine id (boot_id or /etc/machine-id)")
    return mid, facts


def probe_argv(h: Host, model: str, seconds: float, quick: bool = False) -> list[str]:
    """The probe at the host's smol_threads (else the CPUs it may use, read there) on its smol_device,
    one probe per line it reads. Started through the host's warm server of training workers
    (smolnet.warm, the workers' preload list): the probe pays torch's import there once, and the
    runs after it find the server warm instead of paying it again (a 0.15-core host: ~9 s)."""
    argv = warm.command(
        h.python,
        WORKER_IMPORTS,
        "smoltrain.calibration.probe",
        "--serve",
        "--model",
        model,
        "--seconds",
        f"{seconds:g}",
    )
    if quick:  # every window at its shortest (probe.QUICK)
        argv.append("--quick")
    if h.threads:
        argv += ["--threads", str(h.threads)]
    if os.environ.get("SMOL_KERNELS", "auto") != "auto":  # calibrate --kernels (models.backends)
        argv += ["--kernels", os.environ["SMOL_KERNELS"]]
    return argv + ["--device", h.torch_device]


def probe_host(h: Host, model: str, seconds: float, timeout: float = PROBE_TIMEOUT, quick: bool = False) -> dict:
    """Run the probe on `h` once; its `hosts` entry, or raise RemoteError with the reason."""
    with ProbeSession(h, probe_argv(h, model, seconds, quick), timeout) as s:
        return _entry(h, s.probe())


def _entry(h: Host, doc: dict) -> dict:
    return {"name": h.name, "status": "ok", "error": None, **doc}


class _Sessions:
    """The default probe of calibrate_hosts: each host's session opened at its first round and
    kept until close()."""

    def __init__(self, quick: bool = False):
        self.open: dict[str, ProbeSession] = {}
        self.quick = quick

    def __call__(self, h: Host, model: str, seconds: float) -> dict:
        if h.name not in self.open:
            self.open[h.name] = ProbeSession(h, probe_argv(h, model, seconds, self.quick), PROBE_TIMEOUT)
        try:
            return _entry(h, self.open[h.name].probe())
        except RemoteError:
            self.open.pop(h.name).close()
            raise

    def close(self) -> None:
        for s in self.open.values():
            s.close()
        self.open.clear()


def _failed(name: str, err: str, machine_id: str | None = None) -> dict:
    return {"name": name, "status": "failed", "error": err, "machine_id": machine_id}


def median_probe(docs: list[dict]) -> dict:
    """One host's probes merged: the median of every timed figure, the least usable memory,
    and each fp32 rate kept (`fp32_flops_each`) so a reader sees the spread."""
    out = copy.deepcopy(docs[0])
    med = statistics.median
    for k in out.get("flops") or {}:
        got = [d["flops"][k] for d in docs if d["flops"].get(k) is not None]
        out["flops"][k] = med(got) if got else None
    out["mem_bw_bytes_s"] = med([d["mem_bw_bytes_s"] for d in docs])
    out["usable_memory_bytes"] = min(d["usable_memory_bytes"] for d in docs)
    for key in ("decode_bw_bytes_s", "decode_layer_s"):
        for dt, by_rows in (out.get(key) or {}).items():
            for rows in by_rows:
                each = [(d.get(key) or {}).get(dt, {}).get(rows) for d in docs]
                by_rows[rows] = med([x for x in each if x is not None])
    for key in ("decode_engine_s", "burst_wake_s"):
        if all(d.get(key) is not None for d in docs):
            out[key] = med([d[key] for d in docs])
    if all(d.get("comm_cpu") for d in docs):
        for k in out["comm_cpu"]:
            out["comm_cpu"][k] = med([d["comm_cpu"][k] for d in docs])
    for i, st in enumerate(out.get("train_step") or []):
        for k in ("seconds", "optimizer_seconds"):
            if k in st:
                st[k] = med([d["train_step"][i][k] for d in docs])
    for i, st in enumerate(out.get("decode_step") or []):
        st["seconds"] = med([d["decode_step"][i]["seconds"] for d in docs if len(d.get("decode_step") or []) > i])
    out["repeats"] = len(docs)
    out["fp32_flops_each"] = [d["flops"]["fp32"] for d in docs]
    return out


def calibrate_hosts(
    hosts: list[Host],
    model: str = "tiny",
    seconds: float = 0.5,
    progress: Progress | None = None,
    probe: Callable | None = None,
    repeats: int = 1,
    sequential: bool = False,
    quick: bool = False,
) -> dict:
    """Measure `hosts`; the compute report (failed hosts carry status `failed` and `error`).
    `probe(h, model, seconds)` probes once (default: each host's own session, kept open).
    `sequential`: hosts that share a machine one after another even where their caps fit.
    `quick`: every window of the probe at its shortest (probe.QUICK); the wire ring keeps its own."""
    sessions = _Sessions(quick) if probe is None else None
    try:
        doc = _calibrate(hosts, model, seconds, progress, probe or sessions, repeats, sequential)
    finally:
        if sessions:
            sessions.close()
    doc["settings"]["quick"] = quick
    if sessions is not None:  # real hosts: what a message costs each over the cluster's own links
        from smoltrain.calibration.wire_probe import apply

        apply(hosts, doc, progress)
    return doc


def _machines(hosts: list[Host], facts: dict[str, tuple[str, dict]], sequential: bool) -> list[dict]:
    """The report's `machines`: each machine id's hosts, in inventory order, whether they are
    measured together and why."""
    by_id: dict[str, list[str]] = {}
    by_name = {h.name: h for h in hosts}
    for h in hosts:
        if h.name in facts:
            by_id.setdefault(facts[h.name][0], []).append(h.name)
    out = []
    for mid, names in by_id.items():
        cpus = min(int(facts[n][1].get("cpus") or 1) for n in names)
        # each host's reading overlaps the others' own start: the least is nearest other work alone
        busy = [facts[n][1]["busy_cpus"] for n in names if facts[n][1].get("busy_cpus") is not None]
        probes = {n: {**facts[n][1], "threads": by_name[n].threads} for n in names}  # smol_threads, if set
        k, why = together.lanes(probes, cpus, min(busy) if busy else None)
        if k > 1 and sequential:
            k, why = 1, "one after another: --sequential"
        out.append({"machine_id": mid, "hosts": names, "together": 1 < k == len(names), "lanes": k, "why": why})
    return out


class _Queue:
    """One machine's probes, round by round (a, b, c, a, b, c, ...), for `lanes` threads at once:
    each takes the first probe whose host is not being probed, so a host's rounds stay in order
    and no host is probed twice at once. Within a round the tightest caps go first: their probes
    take longest, and the others fill the other lanes meanwhile."""

    def __init__(self, hosts: list[Host], caps: dict[str, float | None], repeats: int):
        order = sorted(hosts, key=lambda h: caps.get(h.name) or float("inf"))
        self.todo = [(n, h) for n in range(repeats) for h in order]
        self.busy: set[str] = set()
        self.cv = threading.Condition()

    def take(self, skip: Callable[[str], bool]) -> tuple[int, Host] | None:
        with self.cv:
            while True:
                self.todo = [(n, h) for n, h in self.todo if not skip(h.name)]
                if not self.todo:
                    return None
                for i, (_, h) in enumerate(self.todo):
                    if h.name not in self.busy:
                        self.busy.add(h.name)
                        return self.todo.pop(i)
                self.cv.wait()

    def done(self, h: Host) -> None:
        with self.cv:
            self.busy.discard(h.name)
            self.cv.notify_all()


def _calibrate(hosts, model, seconds, progress, probe, repeats, sequential=False) -> dict:
    say = progress or (lambda name, what: None)
    results: dict[str, dict] = {}
    facts: dict[str, tuple[str, dict]] = {}
    with cf.ThreadPoolExecutor(max(1, len(hosts))) as ex:
        futs = {ex.submit(_host_facts, h): h for h in hosts}
        for f in cf.as_completed(futs):
            h = futs[f]
            try:
                facts[h.name] = f.result()
                say(h.name, "waiting for its machine")
            except RemoteError as e:
                results[h.name] = _failed(h.name, e.cause)
                say(h.name, f"failed: {e.cause}")
    machines = _machines(hosts, facts, sequential)
    by_name = {h.name: h for h in hosts}
    probes: dict[str, list[dict]] = {h.name: [] for h in hosts}
    caps = {n: f.get("cpu_limit_cores") for n, (_, f) in facts.items()}
    queues = [(_Queue([by_name[n] for n in m["hosts"]], caps, repeats), m) for m in machines]

    def one_lane(q: _Queue) -> None:
        while (got := q.take(lambda name: name in results)) is not None:  # failed in an earlier round
            n, h = got
            say(h.name, "measuring" + (f" ({n + 1} of {repeats})" if repeats > 1 else ""))
            try:
                probes[h.name].append(probe(h, model, seconds))
            except RemoteError as e:
                results[h.name] = _failed(h.name, e.cause, facts[h.name][0])
                say(h.name, f"failed: {e.cause}")
                continue
            finally:
                q.done(h)
            if n == repeats - 1:
                doc = median_probe(probes[h.name])
                doc["machine_id"] = facts[h.name][0]
                results[h.name] = doc
                say(h.name, "done: " + summary(doc))

    lanes = [q for q, m in queues for _ in range(m["lanes"])]
    with cf.ThreadPoolExecutor(max(1, len(lanes))) as ex:
        list(ex.map(one_lane, lanes))
    return {
        "schema": COMPUTE_SCHEMA,
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "controller": socket.gethostname(),
        "settings": {"model": model, "seconds": seconds, "threads": "per host", "repeats": repeats},
        "machines": machines,
        "hosts": [results[h.name] for h in hosts],
    }


def summary(doc: dict) -> str:
    f = doc.get("flops") or {}
    ts = doc.get("train_step") or []
    cap = doc.get("cpu_limit_cores")
    parts = [
        f"fp32 {(f.get('fp32') or 0) / 1e9:,.1f} GFLOP/s",
        f"bf16 {(f.get('bf16') or 0) / 1e9:,.1f}",
        f"fp16 {(f.get('fp16') or 0) / 1e9:,.1f}",
        f"mem {doc.get('mem_bw_bytes_s', 0) / 1e9:,.1f} GB/s",
    ]
    dec = (doc.get("decode_bw_bytes_s") or {}).get("fp32") or {}
    if dec.get("1"):
        parts.append(f"fp32 decode {dec['1'] / 1e9:,.1f} GB/s")
    if ts:
        parts.append(f"{ts[-1]['model']} step {ts[-1]['seconds'] * 1e3:,.0f} ms @ batch {ts[-1]['batch']}")
    parts.append(f"cap {cap:.2f} cores" if cap else f"{doc.get('cores')} cores")
    parts.append(f"{doc.get('threads', 1)} thread(s)")
    return ", ".join(parts)


def local_report(
    model: str = "tiny",
    seconds: float = 0.5,
    name: str | None = None,
    repeats: int = 1,
    threads: int | None = None,
    device: str = "cpu",
    quick: bool = False,
) -> dict:
    """This machine alone (`calibrate --local`), probed in-process at `threads` (default: its CPUs)."""
    from smoltrain.calibration.probe import FULL, QUICK
    from smoltrain.calibration.probe import probe as run_probe

    windows = QUICK if quick else FULL
    doc = median_probe([run_probe(model, seconds, threads, None, device, windows) for _ in range(repeats)])
    return {
        "schema": COMPUTE_SCHEMA,
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "controller": socket.gethostname(),
        "settings": {
            "model": model,
            "seconds": seconds,
            "threads": doc.get("threads", 1),
            "repeats": repeats,
            "quick": quick,
        },
        "hosts": [{"name": name or socket.gethostname(), "status": "ok", "error": None, **doc}],
    }
