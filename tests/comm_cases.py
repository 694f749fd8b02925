"""What each rank does in the comm tests; returns plain data the test process checks.

Inputs are small integers, so sums are exact in every dtype (bfloat16 included) whatever
the reduction order, and every rank can compute the reference result by itself.
"""

from __future__ import annotations

import os
import socket
import time

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int64": torch.int64}


def value(seed: int, numel: int, dtype) -> torch.Tensor:
    return ((torch.arange(numel, dtype=torch.int64) * 7 + seed * 3) % 9 - 4).to(dtype)


def sizes(n: int) -> list[int]:
    """Zero, tiny, not divisible by n, and one large enough for the threaded, multi-chunk path."""
    return [0, 1, n + 1, 1001, 300_007]


def _payload(comm) -> dict:
    return {str(k): v for k, v in comm.counter.payload.items() if v}


def _framing(comm) -> int:
    return sum(comm.counter.framing.values())


def collectives(comm, params) -> dict:
    """Every collective against a locally computed reference; records bytes per call."""
    n, r = comm.world_size, comm.rank
    calls, bad = [], []

    def record(name, ok, **info):
        calls.append(dict(info, name=name, payload=_payload(comm), framing=_framing(comm)))
        if not ok:
            bad.append(f"{name} {info}")
        comm.counter.reset()

    comm.counter.reset()
    dtypes = params.get("dtypes", list(DTYPES))
    for dname in dtypes:
        dt = DTYPES[dname]
        for numel in sizes(n):
            if dname != "float32" and numel > 2000:
                continue  # the big size once is enough
            t = value(r, numel, dt)
            comm.all_reduce(t)
            ref = sum(value(q, numel, torch.int64) for q in range(n)).to(dt)
            record("all_reduce", torch.equal(t, ref), dtype=dname, numel=numel, es=t.element_size())
    # avg
    t = value(r, 1001, torch.float32)
    comm.all_reduce(t, op="avg")
    ref = sum(value(q, 1001, torch.float64) for q in range(n)) / n
    record("all_reduce_avg", torch.allclose(t.double(), ref, atol=1e-6), dtype="float32", numel=1001, es=4)
    # a non-contiguous tensor (staged through a contiguous copy and written back)
    base = value(r, 6 * 5, torch.float32).view(6, 5)
    tv = base.t()
    comm.all_reduce(tv)
    ref = sum(value(q, 30, torch.float32) for q in range(n)).view(6, 5)
    record("all_reduce_noncontig", torch.equal(base, ref), dtype="float32", numel=30, es=4)
    # reduce_scatter and all_gather, odd and zero per-rank sizes
    for dname in dtypes:
        dt = DTYPES[dname]
        for m in [0, 1, 3, 70_001 if dname == "float32" else 333]:
            inp = value(r + 10, n * m, dt)
            keep = inp.clone()
            out = torch.empty(m, dtype=dt)
            comm.reduce_scatter(out, inp)
            ref = sum(value(q + 10, n * m, torch.int64) for q in range(n))[r * m : (r + 1) * m].to(dt)
            record(
                "reduce_scatter",
                torch.equal(out, ref) and torch.equal(inp, keep),
                dtype=dname,
                numel=m,
                es=out.element_size(),
            )
            inp = value(r + 20, m, dt)
            out = torch.empty(n * m, dtype=dt)
            comm.all_gather(out, inp)
            ref = torch.cat([value(q + 20, m, dt) for q in range(n)])
            record("all_gather", torch.equal(out, ref), dtype=dname, numel=m, es=out.element_size())
    # broadcast from every rank
    for src in range(n):
        for numel in (0, 5, 300_007 if src == 0 else 17):
            t = value(r + 30, numel, torch.float32)
            comm.broadcast(t, src)
            record("broadcast", torch.equal(t, value(src + 30, numel, torch.float32)), src=src, numel=numel, es=4)

    # all_to_all with uneven sizes, zeros included: m(i -> j) elements
    def m(i, j):
        return (i + 2 * j) % 3 * 5

    inps = [value(100 * r + j, m(r, j), torch.int64) for j in range(n)]
    outs = [torch.empty(m(j, r), dtype=torch.int64) for j in range(n)]
    comm.all_to_all(outs, inps)
    ok = all(torch.equal(outs[j], value(100 * j + r, m(j, r), torch.int64)) for j in range(n))
    record("all_to_all", ok, sizes=[m(r, j) * 8 for j in range(n)])
    # point to point around the ring: rank 0 starts, everyone else receives, then forwards
    if n > 1:
        for numel, dname in ((1001, "float32"), (0, "float32"), (77, "bfloat16"), (200_000, "float32")):
            dt = DTYPES[dname]
            got = torch.empty(numel, dtype=dt)
            if r == 0:
                comm.send(value(0, numel, dt), 1)
                comm.recv(got, n - 1)
            else:
                comm.recv(got, r - 1)
                comm.send(got, (r + 1) % n)
            record("p2p", torch.equal(got, value(0, numel, dt)), numel=numel, es=got.element_size())
        # send_recv: every rank sends to the next and receives from the one before, all at once
        # (two ranks: a swap with the one peer, pp's 1f1b); the sizes differ each way
        for numel in (1001, 300_007):
            mine, theirs = numel + 37 * r, numel + 37 * ((r - 1) % n)
            got = torch.empty(theirs, dtype=torch.float32)
            comm.send_recv(value(50 + r, mine, torch.float32), (r + 1) % n, got, (r - 1) % n)
            ok = torch.equal(got, value(50 + (r - 1) % n, theirs, torch.float32))
            record("send_recv", ok, numel=mine, es=4)
    comm.barrier()
    record("barrier", True)
    return {"calls": calls, "bad": bad}


def killed(comm, params) -> dict:
    """All-reduce a few MB in a loop until a peer is killed; the victim never returns."""
    buf = torch.ones(params.get("numel", 1 << 20))
    i = 0
    while True:
        comm.all_reduce(buf)
        i += 1
        if i == 3:
            with open(os.path.join(params["dir"], f"running{comm.rank}"), "w") as f:
                f.write("1")
        if i > 100_000:
            return {"iterations": i}
        if params.get("sleep"):
            time.sleep(params["sleep"])


def sync_dtypes(comm, params) -> dict:
    """diloco's pseudo-gradient all-reduce in every sync dtype the backend carries: a digest of
    the result (equal on every rank), the payload bytes it sent, its error against fp32."""
    import hashlib

    from smoltrain.comm import SYNC_DTYPES
    from smoltrain.comm.quantized import all_reduce_as

    n, numel = comm.world_size, params["numel"]

    def delta(r: int) -> torch.Tensor:  # a pseudo-gradient: small, of mixed sign and scale
        return torch.randn(numel, generator=torch.Generator().manual_seed(100 + r)) * 1e-3

    exact = sum(delta(r) for r in range(n))
    out = {}
    for dtype in SYNC_DTYPES[comm.backend]:
        flat = delta(comm.rank)
        before = comm.counter.total_payload()
        all_reduce_as(comm, flat, dtype)
        out[dtype] = {
            "digest": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
            "bytes": comm.counter.total_payload() - before,
            "error": float((flat - exact).abs().max() / exact.abs().max()),
        }
    return out


def groups(comm, params) -> dict:
    """Two 2-D meshes' axis groups on 4 ranks: rows {0,1},{2,3} and columns {0,2},{1,3}.
    Each rank runs every collective in its row group, then in its column group (the two rows,
    and the two columns, run at the same time on disjoint links); returns each result as a list
    (compared across backends) and the per-link payload bytes of each call."""
    rows = [comm.new_group(g) for g in ([0, 1], [2, 3])]
    cols = [comm.new_group(g) for g in ([0, 2], [1, 3])]
    out = {"calls": []}
    for axis, made in (("row", rows), ("col", cols)):
        members = [g for g in made if g is not None]
        assert len(members) == 1, "a rank is in exactly one group per axis"
        g = members[0]
        same = (lambda a, b: a // 2 == b // 2) if axis == "row" else (lambda a, b: a % 2 == b % 2)
        peers = [r for r in range(comm.world_size) if same(r, comm.rank)]
        assert g.world_size == 2 and peers[g.rank] == comm.rank

        def record(name, t, ref, axis=axis):
            out["calls"].append(
                {
                    "name": f"{axis}.{name}",
                    "value": t.tolist(),
                    "ok": torch.equal(t, ref),
                    "payload": {str(k): v for k, v in comm.counter.payload.items() if v},
                }
            )
            comm.counter.reset()

        comm.counter.reset()
        for numel in (7, 300_007):  # the one-swap path and the ring
            t = value(comm.rank, numel, torch.float32)
            g.all_reduce(t)
            record(f"all_reduce{numel}", t[:16], sum(value(q, numel, torch.float32) for q in peers)[:16])
        t = value(comm.rank, 10, torch.float32)
        g.broadcast(t, 1)
        record("broadcast", t, value(peers[1], 10, torch.float32))
        got = torch.empty(2 * 6)
        g.all_gather(got, value(comm.rank, 6, torch.float32))
        record("all_gather", got, torch.cat([value(q, 6, torch.float32) for q in peers]))
        mine = torch.empty(5)
        g.reduce_scatter(mine, value(comm.rank, 10, torch.float32))
        record("reduce_scatter", mine, sum(value(q, 10, torch.float32) for q in peers)[5 * g.rank : 5 * g.rank + 5])
        t = value(comm.rank, 9, torch.float32)
        if g.rank == 0:
            g.send(t, 1)
            record("send", t, t)
        else:
            g.recv(t, 0)
            record("recv", t, value(peers[0], 9, torch.float32))
    return out


def group_mismatch(comm, params) -> dict:
    """Rank 0 all-reduces in the group {0,1}, rank 1 in the world: the frames name their group,
    so both fail at once instead of adding each other's bytes."""
    g = comm.new_group([0, 1])
    (g if comm.rank == 0 else comm).all_reduce(torch.ones(4))
    return {}


def idle_wait(comm, params) -> dict:
    """CPU seconds a rank spends blocked on a late peer, in a receive and in an all-reduce: a
    capped or busy host that spun while it waited would compute slower the more it syncs."""
    buf = torch.zeros(1 << 16)
    out = {}
    for op in ("recv", "all_reduce"):
        comm.barrier()
        if comm.rank == 1:
            time.sleep(params["late_s"])
        cpu, wall = time.process_time(), time.monotonic()
        if op == "all_reduce":
            comm.all_reduce(buf)
        elif comm.rank == 0:
            comm.recv(buf, 1)
        else:
            comm.send(buf, 0)
        out[op] = {"cpu_s": time.process_time() - cpu, "wall_s": time.monotonic() - wall}
    if comm.backend == "socket":  # the waits raised each socket's low-water mark; none may keep it
        out["rcvlowat"] = [s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) for s in comm._socks.values()]
    return out


def successive_groups(comm, params) -> dict:
    """diloco's ring rebuild: a group of n on a fresh port, the last rank leaves, and the rest
    build the next group of n-1 on the same port, rank 0 the last to get there (`late_s`)."""
    from commtools import SECRET

    from smoltrain.comm import make_comm

    comm.close()
    rank, n, port = comm.rank, comm.world_size, params["port"]
    backend = comm.backend

    def build(world: int, name: str):
        # a group that met stale addresses never forms, however long it waits; a good one forms
        # late on a saturated 2-core machine (gloo's full mesh once took over 8 s in CI, and a
        # suite at 98% CPU once left rank 0 waiting out 20 s for the others' keys): 45 s
        return make_comm(backend, rank, world, "127.0.0.1", port, SECRET, timeout=45.0, namespace=name)

    first = build(n, "ring-1")
    t = torch.ones(3)
    first.all_reduce(t)
    if rank == n - 1:
        first.close()
        return {"left": True}
    if rank == 0:
        time.sleep(params["late_s"])
    first.close()
    second = build(n - 1, "ring-2")
    u = torch.full((3,), float(rank + 1))
    second.all_reduce(u)
    second.close()
    return {"first": t.tolist(), "second": u.tolist()}
