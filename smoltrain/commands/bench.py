"""`smoltrain bench allreduce`: time one all-reduce size on the transport, nccl-tests style.

The controller starts one rank per host (or N on loopback with --local N), each rank
runs warm-up plus --iters timed all-reduces of a float32 buffer, the ranks exchange
their per-iteration times, and rank 0 reports the median over iterations of the
slowest rank's time. algbw = bytes / time, busbw = algbw * 2(N-1)/N, in 10^9 bytes/s.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sys
import threading
import time

from smolnet.errors import SmolError, UsageError
from smolnet.files import write_json_atomic
from smoltrain import validate

SCHEMA = "smoltrain.bench/1"
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gib": 1 << 30,
}


def parse_bytes(text: str) -> int:
    """'4096', '4K', '256MB' (binary units, like nccl-tests) -> bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise UsageError(f"--bytes: cannot read {text!r} (examples: 4096, 4K, 1M, 256MB)")
    n = int(m.group(1)) * _UNITS[m.group(2).lower()]
    if n < 4 or n > 4 << 30:
        raise UsageError(f"--bytes: {n} is outside 4 bytes .. 4 GiB")
    return n


def add_arguments(p) -> None:
    p.add_argument("op", choices=["allreduce"], help="the collective to time")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--local", type=validate.count(64), metavar="N", help="N ranks on this machine (loopback)")
    where.add_argument("-i", "--inventory", help="one rank per host of the inventory's cluster group")
    p.add_argument("--bytes", required=True, help="buffer size: 4096, 4K, 1M, 256MB (binary units)")
    p.add_argument("--backend", choices=["socket", "torch"], default="socket")
    p.add_argument("--iters", type=validate.COUNT, default=20, help="timed iterations (default 20)")
    p.add_argument("--warmup", type=validate.count(10**6, lo=0), default=3, help="untimed iterations first (default 3)")
    p.add_argument("--hosts", help="comma-separated subset of inventory hosts, in rank order")
    p.add_argument(
        "--port",
        type=validate.integer(1, 65535, "1..65535"),
        help="base TCP port (default: the coordinator's smol_train_port; a free one for --local)",
    )
    p.add_argument("--timeout", type=validate.SECONDS, default=60.0, help="peer timeout in seconds (default 60)")
    p.add_argument("--secret-file", help="cluster secret (default: the inventory's smol_secret_file)")
    p.add_argument("--json", help="write the smoltrain.bench/1 document here")
    # one rank, started by the controller (secret on stdin): internal
    p.add_argument("--rank", type=validate.integer(0, 255), help=argparse_suppress())
    p.add_argument("--world", type=validate.RANKS, help=argparse_suppress())
    p.add_argument("--coord", help=argparse_suppress())
    p.add_argument("--addrs", help=argparse_suppress())


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


def run(args) -> int:
    nbytes = parse_bytes(args.bytes)
    if args.rank is not None:
        return _worker(args, nbytes)
    if args.local is None and not args.inventory:
        raise UsageError("say where to run: --local N or -i INVENTORY")
    if args.local is not None:
        doc = _run_local(args, nbytes)
    else:
        doc = _run_inventory(args, nbytes)
    _emit(doc, args.json)
    return 0


# ------------------------------------------------------------------------- rank
def _worker(args, nbytes: int) -> int:
    import torch

    from smoltrain.comm import CommError, make_comm

    secret = sys.stdin.buffer.readline().strip()
    if not secret:
        raise SmolError("bench worker: no secret on standard input")
    addrs = args.addrs.split(",") if args.addrs else None
    torch.set_num_threads(1)
    try:
        comm = make_comm(
            args.backend, args.rank, args.world, args.coord, args.port, secret, timeout=args.timeout, addrs=addrs
        )
    except CommError as e:
        raise SmolError(f"rank {args.rank}: {e}") from None
    try:
        numel = (nbytes + 3) // 4
        buf = torch.ones(numel, dtype=torch.float32)
        for _ in range(args.warmup):
            comm.all_reduce(buf)
        comm.barrier()
        comm.counter.reset()
        times = torch.zeros(args.iters, dtype=torch.float64)
        for i in range(args.iters):
            t0 = time.perf_counter()
            comm.all_reduce(buf)
            times[i] = time.perf_counter() - t0
        sent = comm.counter.total_payload()
        framing = sum(comm.counter.framing.values())
        everyone = torch.zeros(args.world * args.iters, dtype=torch.float64)
        comm.all_gather(everyone, times)
        slowest = everyone.view(args.world, args.iters).max(dim=0).values
        if args.rank == 0:
            p50 = float(slowest.median())
            n = args.world
            algbw = numel * 4 / p50 / 1e9 if p50 > 0 else 0.0
            doc = {
                "schema": SCHEMA,
                "op": "allreduce",
                "backend": args.backend,
                "world_size": n,
                "bytes": numel * 4,
                "iters": args.iters,
                "seconds_p50": p50,
                "algbw_gbps": algbw,
                "busbw_gbps": algbw * 2 * (n - 1) / n,
                "seconds_min": float(slowest.min()),
                "seconds_max": float(slowest.max()),
                "payload_bytes_per_iter_rank0": sent // args.iters,
                "framing_bytes_per_iter_rank0": framing // args.iters,
            }
            print("SMOLBENCH " + json.dumps(doc), flush=True)
    except CommError as e:
        raise SmolError(f"rank {args.rank}: {e}") from None
    finally:
        comm.close()
    return 0


def _rank_argv(python: list[str], args, nbytes, rank, world, coord, port, addrs) -> list[str]:
    argv = python + [
        "-m",
        "smoltrain",
        "bench",
        "allreduce",
        "--bytes",
        str(nbytes),
        "--backend",
        args.backend,
        "--iters",
        str(args.iters),
        "--warmup",
        str(args.warmup),
        "--timeout",
        str(args.timeout),
        "--rank",
        str(rank),
        "--world",
        str(world),
        "--coord",
        coord,
        "--port",
        str(port),
    ]
    if addrs:
        argv += ["--addrs", ",".join(addrs)]
    return argv


def _parse_result(outputs: list[tuple[int | None, str]]) -> dict:
    """Rank 0's document, or the clearest failure among the ranks: (exit status, log) per rank."""
    for line in outputs[0][1].splitlines():
        if line.startswith("SMOLBENCH "):
            try:
                return json.loads(line[len("SMOLBENCH ") :])
            except ValueError:
                break
    reasons = []
    for r, (rc, text) in enumerate(outputs):
        lines = [ln for ln in text.strip().splitlines() if ln.strip() and "Warning" not in ln and "warn(" not in ln]
        if rc not in (0, None) or (r == 0 and lines):
            reasons.append(f"rank {r} exited {rc}: {lines[-1] if lines else 'no output'}")
    raise SmolError("bench failed: " + ("; ".join(reasons) if reasons else "rank 0 printed no result"))


def _launch(args, nbytes: int, ranks: list, coord: str, port: int, addrs, secret: bytes) -> dict:
    """Start one rank per (name, host) with the run's launcher (smolnet.launcher.ProcessGroup,
    as `smoltrain run` and `generate` start theirs: a local child, or over SSH), wait for all
    of them to end, and read rank 0's result from its log."""
    import tempfile

    from smolnet.launcher import ProcessGroup, remote_log

    n = len(ranks)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    deadline = time.monotonic() + args.timeout * 2 + 30 + args.iters * 5
    with tempfile.TemporaryDirectory(prefix="smoltrain-bench-") as log_dir:
        group = ProcessGroup(secret, log_dir)
        try:
            for r, (name, host) in enumerate(ranks):
                python = [sys.executable] if host is None or host.local else host.python.split()
                argv = _rank_argv(python, args, nbytes, r, n, coord, port, addrs)
                group.start(name, argv, host=host, log=remote_log(log_dir, name), env=env, fresh=True)
            done = threading.Event()
            running = [name for name, _ in ranks]
            while running and time.monotonic() < deadline:
                running = [m for m in running if group.alive(m)]
                done.wait(0.05 if running else 0)
            outputs = []
            for name, _ in ranks:
                late = name in running
                text = group.log_text(name) or "\n".join(group.log_lines(name, 200))
                outputs.append((124 if late else group.poll(name), text + ("\ntimed out" if late else "")))
        finally:
            group.stop()
    return _parse_result(outputs)


def _run_local(args, nbytes: int) -> dict:
    from smoltrain.comm.group import free_port_base

    n = args.local
    secret = secrets.token_hex(32).encode()  # loopback group: a fresh secret for this run only
    ranks = [(f"rank{r}", None) for r in range(n)]
    return _launch(args, nbytes, ranks, "127.0.0.1", args.port or free_port_base(n), None, secret)


def _run_inventory(args, nbytes: int) -> dict:
    from smolnet.inventory import load_inventory
    from smolnet.secret import ensure_secret
    from smoltrain.comm.group import inventory_group

    inv = load_inventory(args.inventory)
    hosts = inv.select(args.hosts.split(",") if args.hosts else None)
    if not args.hosts and inv.coordinator in hosts:  # rank 0 (the rendezvous) runs on the coordinator
        hosts = [inv.coordinator] + [h for h in hosts if h is not inv.coordinator]
    coord, port, addrs = inventory_group(hosts)
    secret = ensure_secret(args.secret_file or os.path.expanduser(hosts[0].secret_file))
    return _launch(args, nbytes, [(h.name, h) for h in hosts], coord, args.port or port, addrs, secret)


def _emit(doc: dict, path: str | None) -> None:
    print(
        f"allreduce {doc['backend']} N={doc['world_size']} {doc['bytes']} B: p50 {doc['seconds_p50'] * 1e6:.0f} us, "
        f"algbw {doc['algbw_gbps']:.3f} GB/s, busbw {doc['busbw_gbps']:.3f} GB/s"
    )
    if path:
        write_json_atomic(path, doc)
