"""All-reduce sweep: the socket backend and gloo side by side, in the same processes.

Each rank holds both communicators; for every size the two backends take turns
(alternating which goes first, round after round), so machine noise hits both alike.
Per iteration the slowest rank's time counts; a backend's figure is the median over
all its iterations. Sizes from 4 KB to 256 MB, fewer iterations for big ones. Beside
wall time it records CPU seconds per all-reduce summed over the ranks (every thread,
gloo's included): on a shared, oversubscribed machine that is the steadier measure of
what each backend costs.

    flock /tmp/smol-bench.lock .venv/bin/python bench/bench_allreduce.py --worlds 2,4 --rounds 3 --json bench/out/transport_loopback.json
    flock /tmp/smol-bench.lock .venv/bin/python bench/bench_allreduce.py --sim --worlds 2 --rounds 2 --json bench/out/transport_sim.json
    .venv/bin/python bench/bench_allreduce.py --full-integrity --worlds 2 --sizes 1M,4M,16M --rounds 3

--full-integrity times a third communicator, the socket backend with `--integrity full` (every
payload MACed, not only every header), in turn with the other two: what full integrity costs.

--sim builds a two-host `uniform` sim (tc-shaped 1000 Mbit links) and runs each rank in
its host's network namespace; the result is compared with the link's TCP goodput.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time

from common import exit_code, write_result

SIZES = ["4K", "16K", "64K", "256K", "1M", "4M", "16M", "64M", "256M"]


def iters_for(nbytes: int, budget: int) -> int:
    return max(3, min(30, budget // max(nbytes, 1)))


# ------------------------------------------------------------------------- rank
def worker(a) -> None:
    import torch

    from smoltrain.comm import make_comm

    torch.set_num_threads(1)
    secret = sys.stdin.buffer.readline().strip()
    addrs = a.addrs.split(",")
    sock = make_comm("socket", a.rank, a.world, a.coord, a.port, secret, timeout=120, addrs=addrs)
    gloo = make_comm("torch", a.rank, a.world, a.coord, a.port + a.world + 2, secret, timeout=120, addrs=addrs)
    comms = {"socket": sock, "torch": gloo}
    if a.full_integrity:
        port = a.port + 2 * a.world + 4
        comms["socket-full"] = make_comm(
            "socket", a.rank, a.world, a.coord, port, secret, timeout=120, addrs=addrs, integrity="full"
        )
    from smoltrain.commands.bench import parse_bytes

    for size in a.sizes.split(","):
        nbytes = parse_bytes(size)
        k = iters_for(nbytes, a.budget)
        buf = torch.ones(nbytes // 4)
        times = {name: [] for name in comms}
        cpu = {name: [] for name in comms}
        for rnd in range(a.rounds):
            names = list(comms)  # each goes first in turn
            order = names[rnd % len(names) :] + names[: rnd % len(names)]
            for name in order:
                c = comms[name]
                c.all_reduce(buf)  # warm-up
                sock.barrier()
                t = torch.zeros(k + 1, dtype=torch.float64)
                c0 = time.process_time()
                for i in range(k):
                    t0 = time.perf_counter()
                    c.all_reduce(buf)
                    t[i] = time.perf_counter() - t0
                t[k] = (time.process_time() - c0) / k  # CPU per all-reduce, all threads of this rank
                everyone = torch.zeros(a.world * (k + 1), dtype=torch.float64).view(a.world, k + 1)
                sock.all_gather(everyone.view(-1), t)
                times[name] += everyone[:, :k].max(dim=0).values.tolist()
                cpu[name].append(float(everyone[:, k].sum()))
        if a.rank == 0:
            print(
                json.dumps(
                    {
                        "world_size": a.world,
                        "bytes": nbytes,
                        "iters": k * a.rounds,
                        "seconds": times,
                        "cpu_seconds": cpu,
                    }
                ),
                flush=True,
            )
        del buf
    for c in comms.values():
        c.close()


# ------------------------------------------------------------------- controller
def launch(world: int, addrs: list[str], netns: list[str | None], ifaces: list[str], a) -> list[dict]:
    from smoltrain.comm.group import free_port_base

    port = free_port_base(3 * world + 6, addrs[0]) if not any(netns) else 47000
    secret = secrets.token_hex(16).encode()
    procs = []
    logs = [tempfile.TemporaryFile() for _ in range(world)]  # noqa: SIM115 (children write them); a full stderr pipe would stall a rank
    for r in range(world):
        argv = [
            sys.executable,
            os.path.abspath(__file__),
            "--rank",
            str(r),
            "--world",
            str(world),
            "--coord",
            addrs[0],
            "--port",
            str(port),
            "--addrs",
            ",".join(addrs),
            "--sizes",
            a.sizes,
            "--rounds",
            str(a.rounds),
            "--budget",
            str(a.budget),
        ] + (["--full-integrity"] if a.full_integrity else [])
        if netns[r]:
            argv = ["ip", "netns", "exec", netns[r]] + argv
        env = dict(os.environ, PYTHONWARNINGS="ignore", GLOO_SOCKET_IFNAME=ifaces[r], OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logs[r], env=env))
    for p in procs[1:]:
        p.stdin.write(secret + b"\n")
        p.stdin.close()
    try:
        out, _ = procs[0].communicate(secret + b"\n", timeout=a.timeout)
        logs[0].seek(0)
        err = logs[0].read()
        for p in procs[1:]:
            p.wait(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if procs[0].returncode:
        raise SystemExit(f"rank 0 failed: {err.decode(errors='replace')[-2000:]}")
    return [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for row in rows:
        n, b = row["world_size"], row["bytes"]
        entry = {"world_size": n, "bytes": b, "iters": row["iters"], "seconds": row["seconds"]}
        for name, ts in row["seconds"].items():
            p50 = statistics.median(ts)
            alg = b / p50 / 1e9
            entry[name] = {
                "seconds_p50": p50,
                "algbw_gbps": alg,
                "busbw_gbps": alg * 2 * (n - 1) / n,
                "cpu_seconds_p50": statistics.median(row["cpu_seconds"][name]),
            }
        entry["busbw_ratio"] = entry["socket"]["busbw_gbps"] / entry["torch"]["busbw_gbps"]
        entry["cpu_ratio"] = entry["torch"]["cpu_seconds_p50"] / entry["socket"]["cpu_seconds_p50"]
        if "socket-full" in entry:  # what MACing every payload costs over MACing every header
            entry["full_time_ratio"] = entry["socket-full"]["seconds_p50"] / entry["socket"]["seconds_p50"]
            entry["full_cpu_ratio"] = entry["socket-full"]["cpu_seconds_p50"] / entry["socket"]["cpu_seconds_p50"]
        out.append(entry)
    return out


def sim_hosts():
    from smolnet.sim import cluster as sim

    st = sim.up(
        name="x1",
        scenario="uniform",
        hosts=2,
        subnet="10.213.31.0/24",
        rate_mbit=1000,
        inventory="/tmp/smol-bench-x1.yml",
    )
    hosts = st["hosts"]
    ifaces = []
    for h in hosts:
        p = subprocess.run(
            ["ip", "netns", "exec", h["netns"], "ip", "-o", "-4", "addr", "show"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        iface = next(ln.split()[1] for ln in p.stdout.splitlines() if f" {h['address']}/" in ln)
        ifaces.append(iface)
    return [h["address"] for h in hosts], [h["netns"] for h in hosts], ifaces


def iperf_goodput(addrs, netns) -> float:
    """Measured TCP goodput of the sim link, Mbit/s (iperf3, 3 s, host 1 -> host 0)."""
    srv = subprocess.Popen(
        ["ip", "netns", "exec", netns[0], "iperf3", "-s", "-1", "-B", addrs[0], "-p", "5299"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.5)
        p = subprocess.run(
            ["ip", "netns", "exec", netns[1], "iperf3", "-c", addrs[0], "-p", "5299", "-t", "3", "-J"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return json.loads(p.stdout)["end"]["sum_received"]["bits_per_second"] / 1e6
    finally:
        srv.kill()
        srv.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget", type=int, default=64 << 20, help="bytes per size per round (sets iterations)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--sim", action="store_true", help="run on a two-host sim with 1 Gbit links")
    ap.add_argument("--json")
    ap.add_argument("--full-integrity", action="store_true", help="also time the socket backend with --integrity full")
    ap.add_argument("--rank", type=int)
    ap.add_argument("--world", type=int)
    ap.add_argument("--coord")
    ap.add_argument("--port", type=int)
    ap.add_argument("--addrs")
    a = ap.parse_args()
    if a.rank is not None:
        worker(a)
        return 0
    doc = {"command": " ".join(sys.argv), "runs": []}
    goodput = None
    try:
        if a.sim:
            from smolnet.sim.scenarios import tcp_goodput_mbit

            addrs, netns, ifaces = sim_hosts()
            goodput = {"tbf_model_mbit": tcp_goodput_mbit(1000, 1500), "iperf3_mbit": iperf_goodput(addrs, netns)}
            doc["link"] = goodput
        t0 = time.monotonic()
        for w in [int(x) for x in a.worlds.split(",")]:
            if a.sim:
                if w != 2:
                    continue
                rows = launch(w, addrs, netns, ifaces, a)
            else:
                rows = launch(w, ["127.0.0.1"] * w, [None] * w, ["lo"] * w, a)
            doc["runs"] += summarize(rows)
        doc["wall_s"] = time.monotonic() - t0
    finally:
        if a.sim:
            from smolnet.sim import cluster as sim

            sim.down(name="x1")
    print(
        f"{'N':>2} {'bytes':>10} {'socket us':>10} {'gloo us':>10} {'socket GB/s':>11} {'gloo GB/s':>10} {'ratio':>6}"
        f" {'cpu ratio':>9}"
    )
    for e in doc["runs"]:
        s, g = e["socket"], e["torch"]
        extra = ""
        if goodput:
            link = goodput["iperf3_mbit"] / 8e3
            extra = f"  socket/link {s['busbw_gbps'] / link:.2f}  gloo/link {g['busbw_gbps'] / link:.2f}"
        print(
            f"{e['world_size']:>2} {e['bytes']:>10} {s['seconds_p50'] * 1e6:>10.0f} {g['seconds_p50'] * 1e6:>10.0f} "
            f"{s['busbw_gbps']:>11.3f} {g['busbw_gbps']:>10.3f} {e['busbw_ratio']:>6.2f} {e['cpu_ratio']:>9.2f}{extra}"
        )
    for e in doc["runs"]:
        if "full_time_ratio" in e:
            f = e["socket-full"]
            print(
                f"{e['world_size']:>2} {e['bytes']:>10} --integrity full: {f['seconds_p50'] * 1e6:.0f} us, "
                f"{f['busbw_gbps']:.3f} GB/s, {e['full_time_ratio']:.2f}x header's time, "
                f"{e['full_cpu_ratio']:.2f}x its CPU"
            )
    if goodput:
        print(f"link goodput: iperf3 {goodput['iperf3_mbit']:.0f} Mbit/s, tbf model {goodput['tbf_model_mbit']:.0f}")
    if a.json:
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, a.json)
    met, headline = integrity_verdict(doc["runs"]) if a.full_integrity else verdict(doc["runs"], goodput)
    name = "allreduce-sim" if goodput else "allreduce-loopback"
    name += "-integrity" if a.full_integrity else ""
    raw = dict(doc, runs=[{k: v for k, v in e.items() if k != "seconds"} for e in doc["runs"]])  # medians only
    print(f"{headline}: {'met' if met else 'MISSED'} ({write_result(name, BARS[name], met, headline, raw)})")
    return exit_code(met)


BARS = {
    "allreduce-loopback": "2 ranks on loopback: socket all-reduce busbw >= 1.0x gloo from 1 MB, 4 KB latency <= gloo's",
    "allreduce-sim": "socket all-reduce busbw >= 0.9 of a 1 Gbit sim link's goodput (iperf3), from 1 MB",
    "allreduce-loopback-integrity": "--integrity full all-reduce within 1.25x --integrity header's time from 1 MB",
    "allreduce-sim-integrity": "--integrity full all-reduce within 1.25x --integrity header's time from 1 MB",
}


def integrity_verdict(runs: list[dict]) -> tuple[bool, str]:
    """Whether full integrity is cheap enough to be the default (header is, today)."""
    big = [e for e in runs if e["bytes"] >= 1 << 20]
    if not big:
        return False, "no size of 1 MB or more was run"
    r = [e["full_time_ratio"] for e in big]
    c = [e["full_cpu_ratio"] for e in big]
    return max(r) <= 1.25, f"full/header time {min(r):.2f}-{max(r):.2f}x, CPU {min(c):.2f}-{max(c):.2f}x from 1 MB"


def verdict(runs: list[dict], goodput: dict | None) -> tuple[bool, str]:
    """The bar of this run (loopback: against gloo at 2 ranks; sim: against the link)."""
    big = [e for e in runs if e["bytes"] >= 1 << 20 and (goodput or e["world_size"] == 2)]
    if not big:
        return False, "no size of 1 MB or more was run"
    if goodput:
        link = goodput["iperf3_mbit"] / 8e3
        r = [e["socket"]["busbw_gbps"] / link for e in big]
        return min(r) >= 0.9, f"socket busbw / link goodput {min(r):.2f}-{max(r):.2f} from 1 MB"
    r = [e["busbw_ratio"] for e in big]
    small = [e for e in runs if e["world_size"] == 2 and e["bytes"] <= 4096]
    lat = [e["torch"]["seconds_p50"] / e["socket"]["seconds_p50"] for e in small]
    met = min(r) >= 1.0 and (not lat or min(lat) >= 1.0)
    words = f"busbw socket/gloo {min(r):.2f}-{max(r):.2f} from 1 MB"
    return met, words + (f"; 4 KB latency gloo/socket {min(lat):.2f}x" if lat else "")


if __name__ == "__main__":
    sys.exit(main())
