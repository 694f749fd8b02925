"""Check a running sim against its truth, from inside the namespaces (no agents, no SSH).

iperf3 between host netns for every ordered pair, DF pings for the MTU faults. Used by
the sim's tests and by `python -m smolnet.sim.check` for the numbers in BENCHMARKS.md;
measuring real clusters is `smolnet matrix`'s job, not this module's.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import subprocess
import time
from contextlib import contextmanager

from smolnet.sim.scenarios import HostSpec, path_truth

BENCH_LOCK = "/tmp/smol-bench.lock"

__all__ = ["ns_run", "df_ping_ok", "iperf3", "spec_of", "check"]


def ns_run(ns: str, argv: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", ns] + argv, capture_output=True, text=True, timeout=timeout)


def df_ping_ok(ns: str, dst: str, size: int, count: int = 2) -> bool:
    """True if a DF ping with `size` payload bytes from netns `ns` reaches dst."""
    p = ns_run(
        ns, ["ping", "-n", "-q", "-M", "do", "-s", str(size), "-c", str(count), "-i", "0.2", "-W", "1", dst], timeout=15
    )
    return p.returncode == 0


def _wait_listen(ns: str, port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ns_run(ns, ["ss", "-Hltn", f"sport = :{port}"], timeout=5).stdout.strip():
            return
        time.sleep(0.05)
    raise RuntimeError(f"iperf3 server in {ns} did not listen on port {port} within {timeout:g}s")


@contextmanager
def _bench_lock(wait_s: float):
    """Hold the shared bench lock if it frees up within wait_s; run anyway after that
    (a figure taken under contention beats a test that dies waiting)."""
    with open(BENCH_LOCK, "a") as f:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    held = False
                    break
                time.sleep(0.2)
        try:
            yield held
        finally:
            if held:
                fcntl.flock(f, fcntl.LOCK_UN)


def iperf3(
    src_ns: str, dst_ns: str, dst_addr: str, seconds: float = 3, port: int = 5291, lock_wait_s: float = 30.0
) -> dict:
    """One TCP test src -> dst: receiver goodput (Mbit/s), sender retransmits, iperf3's error,
    and whether it ran holding the bench lock (CPU contention from other work skews rates)."""
    srv = subprocess.Popen(
        ["ip", "netns", "exec", dst_ns, "iperf3", "-s", "-1", "-B", dst_addr, "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_listen(dst_ns, port)
        with _bench_lock(lock_wait_s) as held:
            p = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    src_ns,
                    "iperf3",
                    "-c",
                    dst_addr,
                    "-p",
                    str(port),
                    "-t",
                    f"{seconds:g}",
                    "-O",
                    "1",
                    "--connect-timeout",
                    "3000",
                    "-J",
                ],
                capture_output=True,
                text=True,
                timeout=seconds + 30,
            )
    finally:
        try:
            srv.wait(timeout=5)
        except subprocess.TimeoutExpired:
            srv.kill()
            srv.wait(timeout=5)
    out = p.stdout
    if "{" not in out:
        return {
            "mbit": 0.0,
            "retransmits": None,
            "locked": held,
            "error": (p.stderr.strip() or f"iperf3 exited {p.returncode} without output")[-200:],
        }
    doc = json.loads(out[out.index("{") :])
    end = doc.get("end", {})
    return {
        "mbit": end.get("sum_received", {}).get("bits_per_second", 0.0) / 1e6,
        "retransmits": end.get("sum_sent", {}).get("retransmits"),
        "error": doc.get("error"),
        "locked": held,
    }


def spec_of(h: dict) -> HostSpec:
    """The HostSpec recorded for a host in sim state."""
    return HostSpec(**{k: h[k] for k in HostSpec.__dataclass_fields__})


def check(st: dict, seconds: float = 3) -> list[dict]:
    """Every ordered pair: truth and measured goodput (black holes: measured should be ~0)."""
    rows = []
    for s in st["hosts"]:
        for d in st["hosts"]:
            if s is d:
                continue
            t = path_truth(spec_of(s), spec_of(d))
            got = iperf3(s["netns"], d["netns"], d["address"], seconds=seconds if not t["blackhole"] else 2)
            rows.append(
                {
                    "src": s["name"],
                    "dst": d["name"],
                    **t,
                    "measured_mbit": round(got["mbit"], 1),
                    "retransmits": got["retransmits"],
                    "error": got["error"],
                    "locked": got["locked"],
                }
            )
    return rows


def main(argv=None) -> int:
    from rich.console import Console
    from rich.table import Table

    from smolnet.sim import cluster as sim

    ap = argparse.ArgumentParser(
        prog="python -m smolnet.sim.check", description="measure a running sim's links against its truth"
    )
    ap.add_argument("--name", default="smol")
    ap.add_argument("--seconds", type=float, default=3)
    ap.add_argument("--json", help="also write the rows to this file")
    a = ap.parse_args(argv)
    st = sim.status(a.name)
    if st is None or st["mode"] != "netns":
        print(f"sim {a.name} is not up with namespaces")
        return 1
    rows = check(st, a.seconds)
    t = Table(title=f"sim {a.name} ({st['scenario']}): TCP goodput vs truth, iperf3 -t {a.seconds:g} -O 1")
    for col in ("src -> dst", "mtu", "shaped Mbit/s", "truth Mbit/s", "measured", "ratio", "retr", "bench lock"):
        t.add_column(col)
    for r in rows:
        truth = r["goodput_mbit"]
        t.add_row(
            f"{r['src']} -> {r['dst']}",
            f"{r['mtu_configured']}" + (" (black hole)" if r["blackhole"] else ""),
            f"{r['rate_mbit']:g}" if r["rate_mbit"] else "unshaped",
            f"{truth:.1f}" if truth else "~0" if r["blackhole"] else "-",
            f"{r['measured_mbit']:.1f}",
            f"{r['measured_mbit'] / truth:.3f}" if truth else "-",
            str(r["retransmits"]),
            "held" if r["locked"] else "contended",
        )
    Console().print(t)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
