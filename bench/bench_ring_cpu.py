"""CPU seconds per ring step of a small all-reduce, by ring size: what the calibration's comm
probe must stand for.

World ranks of smoltrain's SocketComm are forked on loopback; each all-reduces a small
tensor `--n` times after a warm-up and reports its CPU time (getrusage) and wall time per
ring step (2(N-1) steps per all-reduce). A pair trades on one socket; in a ring of three or
more each rank sends to one peer and waits on another, which is why `calibrate`'s probe
(smoltrain/calibration/comm_probe.py) runs a ring of three. Results: BENCHMARKS.md, "tp decode
and the comm probe's ring of three".

    .venv/bin/python bench/bench_ring_cpu.py [--worlds 2,3,4] [--floats 24] [--n 400]
"""

from __future__ import annotations

import argparse
import os
import resource
import secrets
import sys
import time


def rank_main(rank: int, world: int, port: int, secret: bytes, n: int, floats: int, fd: int) -> None:
    import torch

    from smoltrain.comm import make_comm

    torch.set_num_threads(1)
    c = make_comm("socket", rank, world, "127.0.0.1", port, secret, timeout=60.0)
    t = torch.zeros(floats)
    for _ in range(50):
        c.all_reduce(t)
    r0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(n):
        c.all_reduce(t)
    r1, w1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    steps = 2 * (world - 1) * n
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    os.write(fd, f"{world} {rank} {cpu / steps * 1e6:.1f} {(w1 - w0) / steps * 1e6:.1f}\n".encode())
    c.close()


def one(world: int, floats: int, n: int) -> list[tuple[float, float]]:
    from smoltrain.comm.group import free_port_base

    port, secret = free_port_base(world), secrets.token_bytes(32)
    r, w = os.pipe()
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            os.close(r)
            code = 1
            try:
                rank_main(rank, world, port, secret, n, floats, w)
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    os.close(w)
    for pid in pids:
        os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        rows = [line.split() for line in f.read().splitlines()]
    return [(float(cpu), float(wall)) for _, _, cpu, wall in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,3,4")
    ap.add_argument("--floats", type=int, default=24, help="elements all-reduced (tp decode of tiny8 over 4: 24)")
    ap.add_argument("--n", type=int, default=400, help="all-reduces timed per rank")
    a = ap.parse_args()
    print(f"| ranks | CPU us per ring step (each rank) | wall us per ring step | machine CPUs {os.cpu_count()} |")
    print("|---|---|---|---|")
    for world in (int(x) for x in a.worlds.split(",")):
        got = one(world, a.floats, a.n)
        cpu = ", ".join(f"{c:.0f}" for c, _ in got)
        wall = max(w for _, w in got)
        print(f"| {world} | {cpu} | {wall:.0f} | |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
