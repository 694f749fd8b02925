"""Collective communication for strategies: one interface, two backends.

from smoltrain.comm import make_comm
comm = make_comm("socket", rank, world_size, "10.0.0.1", 7700, secret)
"""

from __future__ import annotations

from smoltrain.comm.base import ByteCounter, Comm, CommError

BACKENDS = ("socket", "torch")
# dtypes a pseudo-gradient can cross the wire in (diloco --sync-dtype), per backend: int8 needs
# a scale per chunk and re-quantising at every hop (smoltrain.comm.quantized on SocketComm.exchange);
# torch.distributed sums int8 as plain integers, which overflows
SYNC_DTYPES = {"socket": ("fp32", "bf16", "fp16", "int8"), "torch": ("fp32", "bf16", "fp16")}


def make_comm(
    backend: str,
    rank: int,
    world_size: int,
    coordinator_addr: str,
    port: int,
    secret: bytes,
    timeout: float = 30.0,
    device="cpu",
    addrs: list[str] | None = None,
    integrity: str = "header",
    namespace: str = "",
) -> Comm:
    """Join the group. socket: authenticated, counts real bytes; torch: gloo/nccl, trusted network.
    `namespace`: one of successive groups on the same port (torch keys its rendezvous by it; the
    socket backend's rank 0 listens only while a group forms, so it needs none)."""
    common = dict(timeout=timeout, device=device, addrs=addrs)
    if backend == "socket":
        from smoltrain.comm.socket_comm import SocketComm

        return SocketComm(rank, world_size, coordinator_addr, port, secret, integrity=integrity, **common)
    if backend == "torch":
        from smoltrain.comm.torch_comm import TorchComm

        return TorchComm(rank, world_size, coordinator_addr, port, secret, namespace=namespace, **common)
    raise CommError(f"unknown comm backend {backend!r} (choose from {', '.join(BACKENDS)})")


__all__ = ["BACKENDS", "SYNC_DTYPES", "ByteCounter", "Comm", "CommError", "make_comm"]
