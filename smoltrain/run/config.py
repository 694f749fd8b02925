"""The run contract: one typed, frozen configuration shared by the controller and every rank.

It crosses the wire as JSON through `to_wire`/`from_wire`, which check every
field's presence and type, so a controller and a worker of different versions
fail on the first message with the field's name instead of deep inside a step.
Runtime things (the secret, callbacks, tensors) are never part of it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import get_type_hints

from smolnet.errors import SmolError
from smoltrain.models.spec import ModelSpec

WIRE_VERSION = 1


class ConfigError(SmolError):
    """A run configuration that is malformed or does not match this version."""


@dataclass(frozen=True)
class RunConfig:
    strategy: str
    backend: str
    model: ModelSpec
    steps: int
    batch: int  # global batch, in sequences
    seq: int
    lr: float
    seed: int
    names: tuple[str, ...]  # host name of each rank
    devices: tuple[str, ...]  # torch device of each rank
    data: str | None = None
    data_cap: int = 2 << 20
    data_bytes: int = 0
    data_digest: str = ""
    microbatches: int = 4
    schedule: str = "1f1b"
    shares: tuple[float, ...] | None = None  # per-rank batch shares (dp family)
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    start_step: int = 0
    resume_sha256: dict | None = None  # part -> sha256 from complete.json: each rank checks its part
    barrier_timeout: float = 30.0  # syncps/edp: drop a worker this late
    timeout: float = 60.0  # a silent peer
    pace: float = 0.0  # make each step last at least this long (demos)
    coord_addr: str = "127.0.0.1"  # rank 0: rendezvous and parameter server
    port: int = 0
    addrs: tuple[str, ...] = ()  # address of each rank for the rank mesh
    control_port: int = 0
    heartbeat_s: float = 1.0  # controller <-> workers; silent for 5 beats = stopped or cut off
    keep_checkpoints: int = 3  # newest complete checkpoints kept
    integrity: str = "header"  # frames after the handshake: MAC over "header" or "full" frame
    placement: dict | None = None  # planner.placement document: who gets which share, layers or heads
    dtype: str = "fp32"  # compute dtype: bf16 runs matmuls in bf16 (autocast), weights and optimizer stay fp32
    threads: tuple[float, ...] = ()  # torch threads per rank (0: the host's usable CPUs); absent: 1
    optimizer: str = "adamw"  # every strategy's optimizer (diloco: the inner one): adamw or sgd
    eval_every: int = 0  # held-out loss every K steps (models.data: a slice no batch draws from); 0: never
    inner_steps: int = 0  # diloco: inner steps per outer step (H); 0 for the other strategies
    outer_lr: float = 0.7  # diloco: outer SGD learning rate on the averaged pseudo-gradient
    outer_momentum: float = 0.9  # diloco: outer Nesterov momentum
    sync_dtype: str = "fp32"  # diloco: the pseudo-gradient's dtype on the wire (fp32, bf16, fp16, int8)
    kernels: str = "auto"  # decode kernels of every rank (models.backends: quantised layers)
    lora: dict | None = None  # finetune.lora.LoraConfig.to_dict(): adapters on a frozen base; None: full
    mesh: str | None = None  # smoltrain.mesh: e.g. "dp=2,tp=2"; `strategy` runs along its axis; None: 1-D
    checkpoint_activations: bool = False  # each block keeps only its input; its forward reruns in backward
    quantize: str | None = None  # LoRA on a frozen base held int8 or q4 (models.qlinear, QLoRA); None: fp32

    @property
    def world_size(self) -> int:
        return len(self.names)

    @property
    def global_tokens(self) -> int:
        return self.batch * self.seq

    def replace(self, **changes) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def to_wire(self) -> dict:
        out = {"version": WIRE_VERSION}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, ModelSpec):
                v = v.to_dict()
            elif isinstance(v, tuple):
                v = list(v)
            out[f.name] = v
        return out

    def report_view(self) -> dict:
        """What the run report records: the wire form less where ranks met."""
        skip = {"version", "coord_addr", "port", "addrs", "control_port"}
        out = {k: v for k, v in self.to_wire().items() if k not in skip}
        out["model"] = self.model.name
        out["model_spec"] = self.model.to_dict()
        return out

    @classmethod
    def from_wire(cls, doc: dict) -> RunConfig:
        if not isinstance(doc, dict):
            raise ConfigError("run config: expected a JSON object")
        if doc.get("version") != WIRE_VERSION:
            raise ConfigError(f"run config version {doc.get('version')!r}, this smoltrain speaks {WIRE_VERSION}")
        hints = get_type_hints(cls)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(doc) - known - {"version"})
        if unknown:
            raise ConfigError(f"run config: unknown field(s) {', '.join(unknown)} (a newer controller?)")
        kw = {}
        for f in fields(cls):
            if f.name not in doc:
                if f.default is dataclasses.MISSING:
                    raise ConfigError(f"run config: missing field {f.name!r}")
                continue
            kw[f.name] = _coerce(f.name, hints[f.name], doc[f.name])
        return cls(**kw)


def _coerce(name: str, hint, value):
    """Check one wire value against its annotation and build the typed value."""
    text = str(hint)
    if hint is ModelSpec:
        if not isinstance(value, dict):
            raise ConfigError(f"run config: {name} must be a model shape object")
        known = {f.name for f in fields(ModelSpec)}
        try:
            return ModelSpec(**{k: v for k, v in value.items() if k in known})
        except TypeError as e:
            raise ConfigError(f"run config: {name}: {e}") from None
    if value is None:
        if "None" in text:
            return None
        raise ConfigError(f"run config: {name} must not be null")
    if text.startswith("dict"):
        if not isinstance(value, dict):
            raise ConfigError(f"run config: {name} must be an object")
        return value
    if text.startswith("tuple"):
        if not isinstance(value, list):
            raise ConfigError(f"run config: {name} must be a list")
        item = float if "float" in text else str
        for v in value:
            if not isinstance(v, (int, float) if item is float else str) or isinstance(v, bool):
                raise ConfigError(f"run config: {name} has a bad entry {v!r}")
        return tuple(item(v) for v in value)
    for typ in (bool, int, float, str):
        if text.startswith(typ.__name__) or hint is typ:
            ok = isinstance(value, typ) and not (typ is not bool and isinstance(value, bool))
            if typ is float and isinstance(value, int) and not isinstance(value, bool):
                ok, value = True, float(value)
            if not ok:
                raise ConfigError(f"run config: {name} must be {typ.__name__}, got {type(value).__name__}")
            return value
    raise ConfigError(f"run config: {name}: unsupported type {text}")
