"""What every inference rank needs to know, sent by the controller over the control channel as JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from smolnet.errors import SmolError

STRATEGIES = ("local", "pp", "tp")


@dataclass(frozen=True)
class InferConfig:
    strategy: str
    backend: str
    model_dir: str
    dtype: str | None
    names: tuple[str, ...]
    layers: tuple[tuple[int, int], ...]  # pp: [first, last) per rank; tp: all layers on every rank
    coord_addr: str = "127.0.0.1"
    port: int = 0
    addrs: tuple[str, ...] = ()
    timeout: float = 60.0
    max_batch: int = 8  # requests decoded together (KV cache slots on every rank)
    quantize: str | None = None  # int8 | q4: weights of every rank's layers (models.quant)
    wire_dtype: str | None = None  # hidden states on the wire (infer.activations); None: the compute dtype
    threads: tuple[int, ...] = ()  # torch threads per rank; 0 or absent: the host's usable CPUs
    devices: tuple[str, ...] = ()  # torch device per rank (smol_device); absent: cpu
    adapter_dir: str | None = None  # a PEFT LoRA adapter folded into the weights as they load (finetune.adapter)
    kernels: str = "auto"  # decode kernels of every rank (models.backends)
    mesh: str | None = None  # pp x tp (infer.meshed): `pp=P,tp=T`; layers: each rank's stage

    @property
    def world_size(self) -> int:
        return len(self.names)

    def rank_threads(self, rank: int) -> int:
        return self.threads[rank] if rank < len(self.threads) else 0

    def rank_device(self, rank: int) -> str:
        return self.devices[rank] if rank < len(self.devices) else "cpu"

    def to_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_wire(cls, d) -> InferConfig:
        if not isinstance(d, dict) or set(d) != {f.name for f in fields(cls)}:
            raise SmolError("the controller sent an inference config of another version")
        d = dict(
            d,
            names=tuple(d["names"]),
            addrs=tuple(d["addrs"]),
            threads=tuple(int(x) for x in d["threads"]),
            devices=tuple(d["devices"]),
            layers=tuple(tuple(int(x) for x in p) for p in d["layers"]),
        )
        if d["strategy"] not in STRATEGIES or len(d["layers"]) != len(d["names"]):
            raise SmolError("the controller sent a malformed inference config")
        return cls(**d)
