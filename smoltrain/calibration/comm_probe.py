"""What smoltrain's own communication costs a host's CPU: a ring of SocketComm ranks on its
loopback, timed in CPU seconds per message and per byte (comm_cpu). ring_rounds is also what
wire_probe runs over the cluster's own links. Run by probe.probe.
"""

from __future__ import annotations

import os
import time

BIG_FLOATS = 1 << 19
COMM_WINDOW = 1.0  # seconds per measurement: ten CFS periods, so a cap shows


def ring_rounds(c, t, rank: int, window: float, work=None, clock=time.thread_time) -> tuple[float, int]:
    """(CPU seconds by `clock`, rounds) of `work` (if any) then an all-reduce of `t`, until rank
    0 has spent `window`; element 0 carries rank 0's "go on"."""
    n, t0, c0 = 0, time.perf_counter(), clock()
    while True:
        if work is not None:
            work()
        t.zero_()
        if rank == 0:
            t[0] = 1.0 if (time.perf_counter() - t0 < window or n < 3) else 0.0
        c.all_reduce(t)
        n += 1
        if t[0] == 0:
            return clock() - c0, n


def _loop(c, t, rank: int, window: float) -> float:
    """This thread's CPU seconds per all-reduce of `t`, back to back."""
    cpu, n = ring_rounds(c, t, rank, window)
    return cpu / n


RING = 3  # probe ranks: a ring of three, so each rank has a distinct next and previous peer


def comm_cpu(torch, window: float = COMM_WINDOW, pace: float = 1.0) -> dict | None:
    """What smoltrain's own communication costs this host's CPU: a ring of RING ranks of
    SocketComm all-reduce a small and a large tensor over a window, on ports checked free
    (a clash would lose the measurement), and rank 0 counts its own CPU seconds. Three
    ranks, not two: in every ring of three or more hosts a rank sends to one peer and
    waits on another (two sockets, a wake-up for each), about 1.7x the CPU per step of a
    pair that trades on one socket (103 against 60 us on loopback).

    The ranks share one CPU and take turns, so a rank's CPU time is its own work: spread
    over two vCPUs that are hyperthreads of one core, each ran at half speed while charged
    in full, and on the 0.15-core sim host the same probe read 98-196 us of CPU a message
    from run to run (wall time, which the quota's periods chop, 0.7-1.9 ms); on one CPU,
    95-102 us. CPU seconds times the host's `pace` (a capped host's CPU second is 1/cap
    seconds of wall time): per-message seconds and per-end bytes/s, or None."""
    import secrets

    from smoltrain.comm import make_comm
    from smoltrain.comm.group import free_port_base

    secret = secrets.token_bytes(32)
    port = free_port_base(RING)
    # a warm-up (first messages, buffers, caches), then a small and a large all-reduce; rank 0
    # decides when each ends, the others follow
    loops = ((64, window / 4), (64, window), (BIG_FLOATS, window))
    pinned = hasattr(os, "sched_setaffinity")
    if pinned:  # the calling thread's CPUs; the forked ranks inherit them
        allowed = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {min(allowed)})
    pids = []
    try:
        for rank in range(1, RING):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    # a forked child must not enter the OpenMP pool its parent started (it is
                    # not there: a crash); one thread runs every operation inline
                    torch.set_num_threads(1)
                    c = make_comm("socket", rank, RING, "127.0.0.1", port, secret, timeout=60.0)
                    for n, w in loops:
                        _loop(c, torch.zeros(n), rank, w)
                    c.close()
                    code = 0
                finally:
                    os._exit(code)
            pids.append(pid)
        try:
            c = make_comm("socket", 0, RING, "127.0.0.1", port, secret, timeout=60.0)
            _, cpu_small, cpu_big = (_loop(c, torch.zeros(n), 0, w) for n, w in loops)
            c.close()
        except Exception:
            for pid in pids:
                os.kill(pid, 9)
            return None
        finally:
            for pid in pids:
                os.waitpid(pid, 0)
    finally:
        if pinned:
            os.sched_setaffinity(0, allowed)
    return per_message(cpu_small, cpu_big, BIG_FLOATS * 4, pace=pace)


def per_message(cpu_small: float, cpu_big: float, big_bytes: int, ranks: int = RING, pace: float = 1.0) -> dict:
    """One rank's cost per message and bytes/s per end, from one rank's CPU seconds per
    all-reduce of a small and of a `big_bytes` buffer among `ranks` ranks: a ring all-reduce
    is 2(N-1) steps, each one message of 1/N of the buffer per rank. Wall time on this
    host: CPU seconds times `pace`."""
    steps = 2 * (ranks - 1)
    msg = cpu_small / steps
    chunk = big_bytes / ranks
    per_byte = max(1e-12, (cpu_big / steps - msg) / chunk)
    return {"message_s": msg * pace, "bytes_s": 1 / (per_byte * pace)}
