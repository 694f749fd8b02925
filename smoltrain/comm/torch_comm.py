"""TorchComm: the same interface on torch.distributed (gloo on CPU, nccl on CUDA).

This is the backend to grow into: gloo and nccl are faster and better tested than any
hand-written transport. Two things it cannot do, and SocketComm does:
- gloo/nccl connections are not authenticated (torch's TCPStore and gloo pairs accept
  anyone who can reach the port): use it on a network you trust; `secret` is unused;
- it cannot see its own bytes. `counter` here holds the textbook payload volume of each
  call (the same rules SocketComm follows and the planner uses: ring all-reduce
  2(N-1)/N, reduce-scatter/all-gather (N-1)/N, chain broadcast, direct all-to-all),
  not what gloo actually put on the wire; `counter.framing` stays empty.
A failed or timed-out peer surfaces as CommError; torch does not say which rank, so
`peer` is None unless the message lets us tell.

Successive groups on one port (diloco rebuilds its ring whenever members change) each take a
`namespace`: rank 0 then keeps one TCPStore server for the port for the life of the process and
each group rendezvouses under its own key prefix in it. Without that a member that rebuilds
before rank 0 has torn down the previous group reaches the previous group's store (torch's
tcp:// rendezvous shares a live server per port), reads its stale addresses and times out.
"""

from __future__ import annotations

import datetime
import os
import re

import torch
import torch.distributed as dist

from smoltrain.comm.base import ByteCounter, Comm, CommError
from smoltrain.comm.ring import ring_allreduce_bytes

_MASTERS: dict[int, dist.TCPStore] = {}  # rank 0's store server per port, kept across namespaced groups

# torch 2.13 renamed these (the old names warn); older releases only have the old ones
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TorchComm(Comm):
    backend = "torch"
    _pg = None  # the process group (None: the world); a TorchGroup sets it
    _ranks = None  # world rank of each group rank (None: the world)

    def __init__(
        self,
        rank: int,
        world_size: int,
        coordinator_addr: str,
        port: int,
        secret: bytes = b"",
        timeout: float = 30.0,
        device="cpu",
        addrs: list[str] | None = None,
        namespace: str = "",
    ):
        if not (0 <= rank < world_size):
            raise CommError(f"rank {rank} is outside world size {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device) if device else torch.device("cpu")
        self.peer_timeout = float(timeout)
        self.counter = ByteCounter()
        self._closed = False
        self._where = f"{coordinator_addr}:{port}"
        self._nccl = self.device.type == "cuda"
        _pin_interface(addrs[rank] if addrs else coordinator_addr, self._nccl)
        if dist.is_initialized():
            raise CommError("torch.distributed is already initialized in this process")
        wait = datetime.timedelta(seconds=timeout)
        try:
            where = {"init_method": f"tcp://{coordinator_addr}:{port}"}
            if namespace:
                where = {"store": dist.PrefixStore(f"{namespace}/", _store(coordinator_addr, port, rank, wait))}
            dist.init_process_group(
                "nccl" if self._nccl else "gloo", rank=rank, world_size=world_size, timeout=wait, **where
            )
        except Exception as e:  # torch raises RuntimeError/DistStoreError/TimeoutError variously
            raise CommError(
                f"torch rendezvous at {self._where} failed: {_short(e)}", peer=0 if rank else None
            ) from None

    # ----------------------------------------------------------------- helpers
    def _dev(self, t: torch.Tensor):
        """nccl wants CUDA tensors and gloo CPU ones; stage when the caller's tensor lives elsewhere."""
        want = "cuda" if self._nccl else "cpu"
        t = t.detach()
        if t.device.type == want and t.is_contiguous():
            return t, False
        return t.to(want).contiguous(), True

    def _run(self, what: str, fn):
        if self._closed:
            raise CommError("communicator is closed")
        try:
            return fn()
        except CommError:
            raise
        except Exception as e:
            msg = _short(e)
            raise CommError(f"{what} failed on rank {self.rank}: {msg}", peer=_peer_from(msg)) from None

    def _g(self, r: int) -> int:
        """The world rank of group rank r (torch's calls and the counter take world ranks)."""
        return r if self._ranks is None else self._ranks[r]

    def _ring(self, dst_bytes: int) -> None:
        if dst_bytes and self.world_size > 1:
            self.counter.add(self._g((self.rank + 1) % self.world_size), dst_bytes)

    def new_group(self, ranks) -> TorchComm | None:
        """dist.new_group over `ranks` (every rank calls it); None if this rank is not in it."""
        from smoltrain.comm.subgroup import TorchGroup, check_ranks

        if self._ranks is not None:
            raise CommError("build every group from the world Comm, not from a group")
        ranks = check_ranks(ranks, self.world_size)
        pg = self._run("new_group", lambda: dist.new_group(ranks))
        return TorchGroup(self, ranks, pg) if self.rank in ranks else None

    # -------------------------------------------------------------- interface
    def send(self, tensor, dst: int) -> None:
        t, _ = self._dev(tensor)
        self._run(f"send to rank {dst}", lambda: dist.send(t, self._g(dst), group=self._pg))
        self.counter.add(self._g(dst), t.numel() * t.element_size())

    def recv(self, tensor, src: int) -> None:
        t, staged = self._dev(tensor)
        self._run(f"recv from rank {src}", lambda: dist.recv(t, self._g(src), group=self._pg))
        if staged:
            with torch.no_grad():
                tensor.copy_(t.view_as(tensor))

    def send_recv(self, send, dst: int, recv, src: int) -> None:
        t, _ = self._dev(send)
        r, staged = self._dev(recv)

        def both():
            for req in (dist.isend(t, self._g(dst), group=self._pg), dist.irecv(r, self._g(src), group=self._pg)):
                req.wait()

        self._run(f"send to rank {dst} and recv from rank {src}", both)
        if staged:
            with torch.no_grad():
                recv.copy_(r.view_as(recv))
        self.counter.add(self._g(dst), t.numel() * t.element_size())

    def broadcast(self, tensor, src: int) -> None:
        if self.world_size == 1 or tensor.numel() == 0:
            return
        t, staged = self._dev(tensor)
        self._run("broadcast", lambda: dist.broadcast(t, self._g(src), group=self._pg))
        if staged and self.rank != src:
            with torch.no_grad():
                tensor.copy_(t.view_as(tensor))
        if (self.rank - src) % self.world_size < self.world_size - 1:  # chain: all but the last forward S
            self._ring(t.numel() * t.element_size())

    def all_reduce(self, tensor, op: str = "sum") -> None:
        if op not in ("sum", "avg"):
            raise CommError(f"unsupported reduce op {op!r} (sum or avg)")
        n = self.world_size
        if n == 1 or tensor.numel() == 0:
            return
        t, staged = self._dev(tensor)
        self._run("all_reduce", lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self._pg))
        if op == "avg":
            t = t / n if t.is_floating_point() else torch.div(t, n, rounding_mode="floor")
            staged = True
        if staged:
            with torch.no_grad():
                tensor.copy_(t.view_as(tensor))
        self._ring(ring_allreduce_bytes(t.numel(), t.element_size(), n, self.rank))

    def reduce_scatter(self, out, inp, op: str = "sum") -> None:
        if op not in ("sum", "avg"):
            raise CommError(f"unsupported reduce op {op!r} (sum or avg)")
        n = self.world_size
        if inp.numel() != n * out.numel() or inp.dtype != out.dtype:
            raise CommError(
                f"reduce_scatter: input has {inp.numel()} {inp.dtype} elements, output "
                f"{out.numel()} {out.dtype}; input must be world_size x output"
            )
        i, _ = self._dev(inp.reshape(-1))
        o = torch.empty(out.numel(), dtype=out.dtype, device=i.device)
        if n == 1:
            o.copy_(i)
        elif out.numel():
            self._run("reduce_scatter", lambda: _REDUCE_SCATTER(o, i, op=dist.ReduceOp.SUM, group=self._pg))
        if op == "avg":
            o = o / n if o.is_floating_point() else torch.div(o, n, rounding_mode="floor")
        with torch.no_grad():
            out.copy_(o.view_as(out))
        self._ring((n - 1) * out.numel() * out.element_size())

    def all_gather(self, out, inp) -> None:
        n = self.world_size
        if out.numel() != n * inp.numel() or inp.dtype != out.dtype:
            raise CommError(
                f"all_gather: output has {out.numel()} {out.dtype} elements, input "
                f"{inp.numel()} {inp.dtype}; output must be world_size x input"
            )
        i, _ = self._dev(inp.reshape(-1))
        o, staged = self._dev(out.reshape(-1))
        if n == 1:
            o.copy_(i)
        elif inp.numel():
            self._run("all_gather", lambda: _ALL_GATHER(o, i, group=self._pg))
        if staged or n == 1:
            with torch.no_grad():
                out.copy_(o.view_as(out))
        self._ring((n - 1) * inp.numel() * inp.element_size())

    def all_to_all(self, outs: list, inps: list) -> None:
        n, r = self.world_size, self.rank
        if len(outs) != n or len(inps) != n:
            raise CommError(f"all_to_all needs {n} inputs and {n} outputs, got {len(inps)} and {len(outs)}")
        ins = [self._dev(t)[0].reshape(-1) for t in inps]
        if len({t.dtype for t in list(inps) + list(outs)}) != 1:
            raise CommError("all_to_all on the torch backend needs one dtype for all tensors")
        if n == 1:
            with torch.no_grad():
                outs[0].copy_(inps[0])
        else:
            # gloo's list all_to_all wants equal sizes; the split form takes any (zeros too)
            dev = ins[0].device
            flat_out = torch.empty(sum(o.numel() for o in outs), dtype=outs[0].dtype, device=dev)
            self._run(
                "all_to_all",
                lambda: dist.all_to_all_single(
                    flat_out,
                    torch.cat(ins),
                    output_split_sizes=[o.numel() for o in outs],
                    input_split_sizes=[t.numel() for t in ins],
                    group=self._pg,
                ),
            )
            with torch.no_grad():
                for o, part in zip(outs, torch.split(flat_out, [o.numel() for o in outs])):
                    o.copy_(part.view_as(o))
        for j in range(n):
            if j != r and ins[j].numel():
                self.counter.add(self._g(j), ins[j].numel() * ins[j].element_size())

    def barrier(self) -> None:
        if self.world_size > 1:
            self._run("barrier", lambda: dist.barrier(group=self._pg))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                dist.destroy_process_group()
            except Exception:  # ok: tearing down after a failed peer must not raise
                pass


def _store(addr: str, port: int, rank: int, wait: datetime.timedelta) -> dist.TCPStore:
    """Rank 0: the port's one server, made on first use and kept; others: a fresh client."""
    if rank:
        return dist.TCPStore(addr, port, is_master=False, timeout=wait)
    if port not in _MASTERS:
        _MASTERS[port] = dist.TCPStore(addr, port, is_master=True, wait_for_workers=False, timeout=wait)
    return _MASTERS[port]


def _pin_interface(addr: str, nccl: bool) -> None:
    """Make gloo/nccl use the interface that holds this rank's cluster address.

    Left alone they pick whatever the hostname resolves to, which may not be the cluster
    link at all. An explicit GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME wins.
    """
    var = "NCCL_SOCKET_IFNAME" if nccl else "GLOO_SOCKET_IFNAME"
    if os.environ.get(var):
        return
    try:
        import psutil

        for iface, entries in psutil.net_if_addrs().items():
            if any(e.address == addr for e in entries):
                os.environ[var] = iface
                return
    except (ImportError, OSError):
        pass


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return (msg[0] if msg else type(e).__name__)[:300]


def _peer_from(msg: str) -> int | None:
    m = re.search(r"\brank (\d+)\b", msg)
    return int(m.group(1)) if m else None
