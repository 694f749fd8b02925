"""The collective-communication interface every strategy is written against.

Two implementations: `SocketComm` (hand-written, authenticated, counts every byte)
and `TorchComm` (torch.distributed: gloo on CPU, nccl on CUDA). A strategy never
knows which one it runs on.

Conventions (the planner counts the same way):
- all collectives are in place or write into caller-provided tensors; shapes agree
  on every rank;
- reduce_scatter: `inp` holds world_size equal chunks (numel divisible by world
  size); rank r receives the reduced chunk r into `out`;
- all_gather: rank r contributes `inp` as chunk r of `out` (out.numel() ==
  world_size * inp.numel());
- byte counters hold tensor payload bytes per destination rank, kept apart from
  framing/protocol overhead.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from smolnet.errors import SmolError


class CommError(SmolError):
    """A collective failed; `peer` names the rank (and host) at fault when known."""

    def __init__(self, message: str, peer: int | None = None):
        super().__init__(message)
        self.peer = peer


@dataclass
class ByteCounter:
    """Bytes this rank sent to each destination rank."""

    payload: dict[int, int] = field(default_factory=dict)
    framing: dict[int, int] = field(default_factory=dict)

    def add(self, dst: int, payload: int, framing: int = 0) -> None:
        self.payload[dst] = self.payload.get(dst, 0) + payload
        if framing:
            self.framing[dst] = self.framing.get(dst, 0) + framing

    def total_payload(self) -> int:
        return sum(self.payload.values())

    def reset(self) -> None:
        self.payload.clear()
        self.framing.clear()


class Comm(ABC):
    rank: int
    world_size: int
    backend: str
    counter: ByteCounter

    @abstractmethod
    def send(self, tensor, dst: int) -> None: ...

    @abstractmethod
    def recv(self, tensor, src: int) -> None:
        """Receive into `tensor` (its shape and dtype must match what was sent)."""

    def send_recv(self, send, dst: int, recv, src: int) -> None:
        """Send `send` to dst and receive `recv` from src (pp's 1f1b swap with a neighbour).
        The transports do both at once, so neither end waits for the other's turn; this
        default orders the two by rank so that a pair never blocks on two sends."""
        if self.rank < dst:
            self.send(send, dst)
            self.recv(recv, src)
        else:
            self.recv(recv, src)
            self.send(send, dst)

    @abstractmethod
    def broadcast(self, tensor, src: int) -> None: ...

    @abstractmethod
    def all_reduce(self, tensor, op: str = "sum") -> None:
        """In place; op is 'sum' or 'avg'."""

    @abstractmethod
    def reduce_scatter(self, out, inp, op: str = "sum") -> None: ...

    @abstractmethod
    def all_gather(self, out, inp) -> None: ...

    @abstractmethod
    def all_to_all(self, outs: list, inps: list) -> None:
        """inps[j] goes to rank j; outs[j] receives from rank j."""

    @abstractmethod
    def barrier(self) -> None: ...

    def new_group(self, ranks: list[int]) -> Comm | None:
        """A Comm over `ranks` (increasing world ranks; group rank = position), None for a
        non-member. Every rank calls it with the same lists in the same order (smoltrain.comm.subgroup)."""
        raise CommError(f"the {self.backend} backend has no groups")

    @abstractmethod
    def close(self) -> None: ...

    def bytes_sent(self) -> dict[int, int]:
        return dict(self.counter.payload)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
