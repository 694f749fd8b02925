"""Probe accuracy on the sim: goodput vs shaped truth (both backends), built-in vs iperf3
on an unshaped pair, and effective-MTU exactness on the mtu-lab switch.

    flock /tmp/smol-bench.lock .venv/bin/python bench/bench_probe.py [--duration 3] [--json FILE]

Needs root (the sim). Uses sim name "m1" (10.213.11.0/24) and tears it down.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

from common import exit_code, write_result

from smolnet import inventory, secret
from smolnet.files import write_text_atomic
from smolnet.matrix import AgentPool, default_secret_path
from smolnet.probes.request import probe_pmtu, probe_throughput
from smolnet.sim import cluster as sim
from smolnet.sim.scenarios import HostSpec

NAME, SUBNET, INV = "m1", "10.213.11.0/24", "/tmp/bench-m1.yml"


def spec(h: dict) -> HostSpec:
    return HostSpec(**{f.name: h[f.name] for f in dataclasses.fields(HostSpec)})


def with_sim(scenario: str, fn, **kw):
    st = sim.up(name=NAME, scenario=scenario, subnet=SUBNET, inventory=INV, **kw)
    try:
        hosts = inventory.load_inventory(INV).hosts
        pool = AgentPool(secret.ensure_secret(default_secret_path(hosts)))
        try:
            pool.ensure_all(hosts)
            if pool.errors:
                raise SystemExit(f"agents failed: {pool.errors}")
            return fn(st, pool)
        finally:
            pool.stop_all()
    finally:
        sim.down(name=NAME)


def shaped(duration: float):
    def run(st, pool):
        specs = {h["name"]: spec(h) for h in st["hosts"]}
        rows = []
        for a in specs:
            for b in specs:
                if a == b:
                    continue
                truth = sim.path_truth(specs[a], specs[b])
                if truth["blackhole"]:
                    continue
                row = {
                    "src": a,
                    "dst": b,
                    "truth_mbit": round(truth["goodput_mbit"], 1),
                    "sender_paced": specs[a].up_mbit <= specs[b].down_mbit,
                }
                for backend in ("iperf3", "builtin"):
                    r = probe_throughput(pool.endpoints[a], pool.endpoints[b], pool.secret, duration, backend)
                    row[backend] = round(r["throughput_mbit"], 1)
                    row[f"{backend}_ratio"] = round(r["throughput_mbit"] / truth["goodput_mbit"], 3)
                    row[f"{backend}_cpu_limited"] = r["cpu_limited"]
                rows.append(row)
                print(row, file=sys.stderr)
        return rows

    return run


def side_by_side(duration: float, reps: int = 3):
    def run(st, pool):
        a, b = (pool.endpoints[h["name"]] for h in st["hosts"][:2])
        res = {"iperf3": [], "builtin": [], "builtin_cpu_limited": []}
        for _ in range(reps):  # alternate so load changes hit both alike
            for backend in ("iperf3", "builtin"):
                r = probe_throughput(a, b, pool.secret, duration, backend)
                res[backend].append(round(r["throughput_mbit"], 1))
                if backend == "builtin":
                    res["builtin_cpu_limited"].append(r["cpu_limited"])
        res["ratio_median"] = round(statistics.median(res["builtin"]) / statistics.median(res["iperf3"]), 3)
        print(res, file=sys.stderr)
        return res

    return run


def mtu_exact(st, pool):
    specs = {h["name"]: spec(h) for h in st["hosts"]}
    rows = []
    for a, b, case in (
        ("j1", "j2", "matching jumbo"),
        ("j2", "j1", "matching jumbo"),
        ("j1", "jm", "jumbo behind a 1500 switch port"),
        ("jm", "j1", "jumbo behind a 1500 switch port"),
        ("j1", "s1", "one end at 1500"),
        ("s1", "j1", "one end at 1500"),
    ):
        t0 = time.monotonic()
        got = probe_pmtu(pool.endpoints[a], pool.endpoints[b], pool.secret)
        want = sim.path_truth(specs[a], specs[b])["mtu_effective"]
        rows.append(
            {
                "case": case,
                "src": a,
                "dst": b,
                "truth": want,
                "measured": got["mtu_effective"],
                "error_bytes": got["mtu_effective"] - want,
                "probes": got["probes"],
                "seconds": round(time.monotonic() - t0, 2),
            }
        )
        print(rows[-1], file=sys.stderr)
    return rows


BAR = "sim goodput within 5% of shaped truth; built-in probe >= 0.9 of iperf3; effective MTU within 8 bytes"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = {
        "duration_s": args.duration,
        "shaped_home": with_sim("home", shaped(args.duration)),
        "unshaped_pair": with_sim("uniform", side_by_side(args.duration), hosts=2, rate_mbit=0),
        "mtu_lab": with_sim("mtu-lab", mtu_exact),
    }
    paced = [r for r in out["shaped_home"] if r["sender_paced"]]
    out["summary"] = {
        "within_5pct_sender_paced": {
            b: sum(abs(r[f"{b}_ratio"] - 1) <= 0.05 for r in paced) for b in ("iperf3", "builtin")
        },
        "sender_paced_links": len(paced),
        "within_5pct_all": {
            b: sum(abs(r[f"{b}_ratio"] - 1) <= 0.05 for r in out["shaped_home"]) for b in ("iperf3", "builtin")
        },
        "all_links": len(out["shaped_home"]),
        "builtin_vs_iperf3": out["unshaped_pair"]["ratio_median"],
        "mtu_max_error_bytes": max(abs(r["error_bytes"]) for r in out["mtu_lab"]),
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        write_text_atomic(args.json, text + "\n")
    sm = out["summary"]
    paced_ok = sm["within_5pct_sender_paced"]["builtin"]
    met = paced_ok == len(paced) and sm["builtin_vs_iperf3"] >= 0.9 and sm["mtu_max_error_bytes"] <= 8
    headline = (
        f"built-in {paced_ok} of {len(paced)} sender-paced links within 5% "
        f"({sm['within_5pct_all']['builtin']} of {sm['all_links']} in all); "
        f"{sm['builtin_vs_iperf3']:.2f} of iperf3; MTU off by at most {sm['mtu_max_error_bytes']} bytes"
    )
    kept = write_result("probe", BAR, met, headline, out)
    print(f"{headline}: {'met' if met else 'MISSED'} ({kept})")
    return exit_code(met)


if __name__ == "__main__":
    sys.exit(main())
