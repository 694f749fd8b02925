"""Measure every ordered pair: agents up, idle probes, throughput in rounds, agents down.

Scheduling follows perfSONAR's rule that a host is in at most one throughput test at a
time, as source or destination. Host-disjoint pairs run together: the circle method
splits N hosts into N-1 rounds of N/2 pairs, each run once per direction, so the matrix
takes about 2(N-1) test slots instead of N(N-1). Round trips and MTU probes run before
any throughput test, on idle links.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, field
from itertools import chain

from smolnet import agent_client as control
from smolnet.inventory import Host
from smolnet.launcher import ProcessGroup
from smolnet.probes.request import Endpoint, probe_pmtu, probe_rtt, probe_throughput
from smolnet.remote import LOG_HOME, RemoteError

AGENT_START_TIMEOUT = 20.0
AGENT_LEASE_S = 30.0  # an agent started for a matrix exits when the controller stops renewing


def pair_rounds(names: list[str]) -> list[list[tuple[str, str]]]:
    """Unordered host-disjoint pairs, N-1 rounds (circle method; a bye when N is odd)."""
    ring = list(names) + ([None] if len(names) % 2 else [])
    n = len(ring)
    rounds = []
    for _ in range(n - 1):
        pairs = [(ring[i], ring[n - 1 - i]) for i in range(n // 2)]
        rounds.append([(a, b) for a, b in pairs if a is not None and b is not None])
        ring = [ring[0], ring[-1]] + ring[1:-1]
    return [r for r in rounds if r]


def directed_rounds(names: list[str], sequential: bool = False) -> list[list[tuple[str, str]]]:
    """Every ordered pair exactly once; within a round no host appears twice."""
    if sequential:
        return [[(a, b)] for a in names for b in names if a != b]
    out = []
    for r in pair_rounds(names):
        out.append(list(r))
        out.append([(b, a) for a, b in r])
    return out


def run_parallel(jobs: list, timeout: float) -> None:
    """Run callables in daemon threads; join in short slices so Ctrl-C gets through."""
    threads = [threading.Thread(target=j, daemon=True) for j in jobs]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        while t.is_alive() and time.monotonic() < deadline:
            t.join(0.2)


@dataclass
class AgentPool:
    """Agents for a run: reuse one that answers with our secret, else start one and stop it later."""

    secret: bytes
    group: ProcessGroup | None = None  # the agents this run started (never one it merely reused)
    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    renewer: threading.Thread | None = None
    stopped: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        if self.group is None:
            self.group = ProcessGroup(self.secret)  # no log dir: every agent starts through smolnet.remote

    def _ping(self, host: Host, connect_timeout: float = 3.0) -> dict:
        return control.call(
            host.cluster_ip, host.agent_port, self.secret, "ping", timeout=5.0, connect_timeout=connect_timeout
        )

    def _argv(self, host: Host) -> list[str]:
        python = sys.executable if host.local and host.python == "python3" else host.python
        argv = [
            python,
            "-m",
            "smolnet",
            "agent",
            "--bind",
            host.cluster_ip,
            "--port",
            str(host.agent_port),
            "--secret-stdin",
            "--lease",
            str(AGENT_LEASE_S),
        ]
        if host.cluster_iface:
            argv += ["--iface", host.cluster_iface]
        return argv

    def ensure(self, host: Host) -> None:
        """Make host's agent answer, or record why it cannot."""
        try:
            info = self._ping(host)
        except control.AgentError as e:
            if "secret" in str(e):
                self._fail(host, f"an agent on {host.cluster_ip}:{host.agent_port} rejects the cluster secret")
                return
            try:
                info = self._start(host)
            except (RemoteError, control.AgentError) as e2:
                self._fail(host, str(e2).removeprefix(f"{host.name}: "))
                return
        try:
            facts = control.call(
                host.cluster_ip, host.agent_port, self.secret, "facts", timeout=10.0, iface=host.cluster_iface
            )
        except control.AgentError as e:
            self._fail(host, f"facts: {e}")
            return
        with self.lock:
            self.endpoints[host.name] = Endpoint(
                host, host.cluster_ip, host.agent_port, bool(info.get("iperf3")), facts
            )

    def _fail(self, host: Host, why: str) -> None:
        with self.lock:
            self.errors[host.name] = why

    def _start(self, host: Host) -> dict:
        # named per host: sim hosts (and loopback ones) share one home; fresh: old errors are not read as new
        log = f"{LOG_HOME}/smolnet-agent-{host.name}-{host.agent_port}.log"
        self.group.start(host.name, self._argv(host), host=host, log=log, fresh=True)
        with self.lock:
            if self.renewer is None:
                self.renewer = threading.Thread(target=self._renew, daemon=True)
                self.renewer.start()
        deadline = time.monotonic() + AGENT_START_TIMEOUT
        last = None
        checked = time.monotonic()
        while time.monotonic() < deadline:
            try:
                return self._ping(host, connect_timeout=1.0)
            except control.AgentError as e:
                last = e
            if time.monotonic() - checked >= 1.0:  # did it die? (a zombie still passes kill -0)
                checked = time.monotonic()
                failed = self._start_failure(host.name)
                if failed:
                    raise control.AgentError(f"agent exited at start: {failed}")
            time.sleep(0.2)
        raise control.AgentError(f"agent did not answer within {AGENT_START_TIMEOUT:g}s: {last}")

    def _start_failure(self, name: str) -> str | None:
        """The agent's last error line if it gave up, else None."""
        try:
            tail = self.group.log_lines(name, 5)
            alive = self.group.alive(name)
        except RemoteError:
            return None
        lines = [ln for ln in tail if "error" in ln.lower()]
        if lines:
            return lines[-1].split("error: ", 1)[-1]
        return None if alive else "process exited"

    def _renew(self) -> None:
        """Renew the lease of every agent this run started, until stop_all."""
        while not self.stopped.wait(AGENT_LEASE_S / 4):
            for name in self.group.names():
                ep = self.endpoints.get(name)
                if ep is None:
                    continue
                try:
                    control.call(ep.ip, ep.port, self.secret, "lease", timeout=5.0, connect_timeout=3.0)
                except control.AgentError:
                    pass  # a dropped host: its agent's lease lapses and it exits by itself

    def ensure_all(self, hosts: list[Host]) -> None:
        run_parallel([lambda h=h: self.ensure(h) for h in hosts], AGENT_START_TIMEOUT + 30)
        for h in hosts:
            if h.name not in self.endpoints and h.name not in self.errors:
                self.errors[h.name] = "agent start timed out"

    def alive(self, name: str) -> bool:
        ep = self.endpoints.get(name)
        if ep is None:
            return False
        try:
            self._ping(ep.host)
            return True
        except control.AgentError:
            return False

    def stop_all(self) -> None:
        """Stop every agent this run started (never one it merely reused)."""
        self.stopped.set()
        self.group.stop()


def host_entries(hosts: list[Host], pool: AgentPool) -> list[dict]:
    out = []
    for h in hosts:
        ep = pool.endpoints.get(h.name)
        f = ep.facts if ep else {}
        rate = h.link_rate_mbit if h.link_rate_mbit is not None else f.get("iface_speed_mbit")
        out.append(
            {
                "name": h.name,
                "address": h.cluster_ip,
                "iface": f.get("iface") or h.cluster_iface,
                "mtu_configured": min(f.get("iface_mtu") or h.mtu, 65535),
                "link_rate_mbit": rate,
                "device": h.device,
                "status": "ok" if ep else "down",
                "error": pool.errors.get(h.name),
                "cpus": f.get("cpus_logical"),
                "memory_bytes": f.get("memory_bytes"),
                "iperf3": ep.iperf3 if ep else None,
            }
        )
    return out


class Measurement:
    """The raw results of one run, filled in as probes finish."""

    def __init__(self, names: list[str], pool: AgentPool, pairs: list[tuple[str, str]] | None = None):
        pairs = pairs or [(a, b) for a in names for b in names if a != b]
        self.raw = {(a, b): {"src": a, "dst": b} for a, b in pairs}
        self.pool = pool
        self.dead: dict[str, str] = dict(pool.errors)
        self.lock = threading.Lock()

    def skip_reason(self, a: str, b: str) -> str | None:
        for h in (a, b):
            if h in self.dead:
                return f"host {h}: {self.dead[h]}"
        return None

    def mark_dead_if_gone(self, *names: str) -> None:
        for n in names:
            if n not in self.dead and not self.pool.alive(n):
                with self.lock:
                    self.dead[n] = "stopped answering during the run"


def measure(
    m: Measurement,
    hosts: list[Host],
    duration: float,
    backend: str,
    sequential: bool = False,
    progress=None,
    streams: int = 4,
    pairs: list[tuple[str, str]] | None = None,
) -> Measurement:
    """Idle probes (RTT, MTU) then throughput, round by round. progress(desc) is called per step."""
    pool = m.pool
    secret = pool.secret
    live = [h.name for h in hosts if h.name in pool.endpoints]
    if pairs:
        rounds = [[p] for p in pairs if p[0] in live and p[1] in live]
    else:
        rounds = directed_rounds(live, sequential)  # hosts already down take no slot
    scheduled = set(chain.from_iterable(rounds))

    def step(desc: str) -> None:
        if progress:
            progress(desc)

    def idle(a: str, b: str) -> None:
        r = m.raw[(a, b)]
        why = m.skip_reason(a, b)
        if why:
            r["error"] = why
            return step(f"{a} → {b} skipped")
        src, dst = pool.endpoints[a], pool.endpoints[b]
        try:
            r["rtt"] = probe_rtt(src, dst, secret)
        except control.AgentError as e:
            r["rtt_error"] = str(e)
        try:
            r["pmtu"] = probe_pmtu(src, dst, secret)
        except control.AgentError as e:
            r["pmtu_error"] = str(e)
        if "rtt_error" in r and "pmtu_error" in r:
            m.mark_dead_if_gone(a, b)
        step(f"rtt+mtu {a} → {b}")

    def tput(a: str, b: str) -> None:
        r = m.raw[(a, b)]
        why = m.skip_reason(a, b)
        if why:
            r.setdefault("error", why)
            return step(f"{a} → {b} skipped")
        try:
            r["tput"] = probe_throughput(
                pool.endpoints[a], pool.endpoints[b], secret, duration, backend, streams=streams
            )
        except control.AgentError as e:
            r["tput_error"] = str(e)
            m.mark_dead_if_gone(a, b)
            why = m.skip_reason(a, b)
            if why:
                r["error"] = why
        step(f"throughput {a} → {b}")

    for a, b in m.raw:
        if (a, b) not in scheduled:
            m.raw[(a, b)]["error"] = m.skip_reason(a, b) or "not scheduled"
            step(f"{a} → {b} skipped")
            step(f"{a} → {b} skipped")
    for rnd in rounds:
        run_parallel([lambda a=a, b=b: idle(a, b) for a, b in rnd], 120.0)
    for rnd in rounds:
        run_parallel([lambda a=a, b=b: tput(a, b) for a, b in rnd], duration + 60.0)
    return m


def run_cli(hosts: list[Host], args, pairs: list[tuple[str, str]] | None = None) -> int:
    """The matrix and probe commands: measure, report, always stop the agents we started."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from smolnet import report
    from smolnet.secret import ensure_secret

    secret = ensure_secret(args.secret_file or default_secret_path(hosts))
    pool = AgentPool(secret)
    names = [h.name for h in hosts]
    err = Console(stderr=True)
    out = Console()
    total = 2 * (len(pairs) if pairs else len(names) * (len(names) - 1))
    m = None
    incomplete = False
    t0 = time.monotonic()
    try:
        with Progress(
            TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err
        ) as prog:
            task = prog.add_task(f"starting agents on {len(hosts)} hosts", total=total)
            pool.ensure_all(hosts)
            m = Measurement(names, pool, pairs)
            measure(
                m,
                hosts,
                args.duration,
                args.backend,
                getattr(args, "sequential", False),
                progress=lambda d: prog.update(task, advance=1, description=d),
                streams=args.streams,
                pairs=pairs,
            )
    except KeyboardInterrupt:
        incomplete = True
        err.print("[yellow]interrupted: stopping agents and writing a partial report[/]")
    finally:
        pool.stop_all()
    wall = time.monotonic() - t0
    if m is None:
        m = Measurement(names, pool, pairs)
    for r in m.raw.values():
        if incomplete and not any(k in r for k in ("tput", "tput_error", "error")):
            r["error"] = "not measured: the run was interrupted"
    hosts_doc = host_entries(hosts, pool)
    links = report.assess_links(hosts_doc, list(m.raw.values()))
    settings = {
        "duration_s": args.duration,
        "backend": args.backend,
        "streams": args.streams,
        "sequential": bool(getattr(args, "sequential", False)),
        "scope": "probe" if pairs else "matrix",
    }
    doc = report.build_report(hosts_doc, links, settings, incomplete, {"wall_s": round(wall, 2)})
    written = report.write_report(doc, getattr(args, "out", None), args.json)
    out.print(report.rich_table(doc))
    for f in report.findings(doc):
        out.print(f"• {f}")
    if written:
        out.print("wrote " + ", ".join(written))
    if incomplete:
        return 130
    return 0 if all(l["status"] == "ok" for l in links) and links else 4


def default_secret_path(hosts: list[Host]) -> str:
    """The controller's own secret: the inventory's smol_secret_file when it is a local path."""
    return os.path.expanduser(hosts[0].secret_file) if hosts else "~/.config/smolcluster/secret"
