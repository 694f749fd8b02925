"""What each parallelism strategy is, declared once.

Every other part (the run command, the controller, the worker, the planner,
the demo) asks this registry instead of keeping its own tuple of names. It is
torch-free, so the planner can read it without pulling in the strategies.
"""

from __future__ import annotations

from dataclasses import dataclass

from smolnet.errors import UsageError


@dataclass(frozen=True)
class StrategyInfo:
    name: str
    summary: str
    trains: bool = True  # `smoltrain run` can train it (ep and sp are plan-only)
    synchronous: bool = True  # reproduces the `--local 1` loss curve
    parameter_server: bool = False  # rank 0 serves parameters; other workers may leave (elastic)
    joiners: bool = False  # admits newcomers mid-run
    loss_from: str = "one"  # "all": every rank reports a share of the loss; "one": one rank (or the server)
    splits: str = "batch"  # what the world divides: batch, layers, heads, experts, sequence
    replicated_infer: bool = False  # batch-1 decode runs on one replica, nothing crosses the links
    module: str = ""  # smoltrain.strategies.<module> holds the algorithm
    topology: str = "ring"  # how its transfers run over rank numbers: ring, chain, star (placement order)
    traffic: str = "ring_allreduce"  # the planner's traffic model (smoltrain.planner.traffic.MODELS)
    microbatched: bool = False  # cuts the batch into microbatches that flow through the stages (pipelining)
    shards_params: bool = False  # parameters, gradients and optimizer state are sharded over the ranks (ZeRO-3)
    even_split: bool = False  # the demo runs it only where its split (layers, heads) divides evenly over the world
    outer_steps: bool = False  # replicas train H inner steps between syncs (DiLoCo): planner.diloco plans H
    serves: bool = False  # `generate` and `serve` split a model this way (a group of hosts per replica)
    adapters: bool = False  # trains LoRA adapters alone (the others move every parameter, frozen or not)

    @property
    def elastic(self) -> bool:
        """Workers other than rank 0 may leave mid-run (and, with `joiners`, arrive); such a
        strategy forms its own connections, so the worker builds no rank mesh for it."""
        return self.parameter_server or self.joiners

    def checkpoint_parts(self, world: int) -> list[str]:
        """Files a complete checkpoint of this strategy holds."""
        return ["server"] if self.parameter_server else [f"rank{r}" for r in range(world)]

    def loss_reports(self, world: int) -> int:
        """How many loss shares the controller waits for before a step is complete (members of
        an elastic strategy come and go: the first share shows the step, weighted by its part)."""
        return world if self.loss_from == "all" and not self.elastic else 1


_ALL = (
    StrategyInfo(
        "dp",
        "data parallel: replicas, ring all-reduce of gradients",
        loss_from="all",
        replicated_infer=True,
        module="dp",
        adapters=True,
    ),
    StrategyInfo(
        "fsdp",
        "fully sharded data parallel (ZeRO-3): gather parameters per unit, reduce-scatter gradients",
        loss_from="all",
        module="fsdp",
        traffic="sharded_gather",
        shards_params=True,
    ),
    StrategyInfo(
        "syncps",
        "synchronous parameter server: workers send gradients, rank 0 updates",
        parameter_server=True,
        replicated_infer=True,
        module="syncps",
        topology="star",
        traffic="parameter_server",
    ),
    StrategyInfo(
        "edp",
        "elastic data parallel: a parameter server that survives leaves and admits joiners",
        synchronous=False,
        parameter_server=True,
        joiners=True,
        replicated_infer=True,
        module="edp",
        topology="star",
        traffic="parameter_server",
    ),
    StrategyInfo(
        "diloco",
        "low-communication data parallel (DiLoCo): H local steps, then all-reduce the pseudo-gradient",
        synchronous=False,
        joiners=True,
        loss_from="all",
        replicated_infer=True,
        module="diloco",
        traffic="outer_allreduce",
        outer_steps=True,
        adapters=True,
    ),
    StrategyInfo(
        "mp",
        "model parallel: consecutive layer blocks, one microbatch at a time",
        splits="layers",
        module="mp",
        topology="chain",
        traffic="layer_chain",
        adapters=True,
    ),
    StrategyInfo(
        "pp",
        "pipeline parallel: layer stages with microbatches (GPipe or 1F1B)",
        splits="layers",
        module="pp",
        topology="chain",
        traffic="layer_chain",
        microbatched=True,
        even_split=True,
        serves=True,
        adapters=True,
    ),
    StrategyInfo(
        "tp",
        "tensor parallel (Megatron): heads and MLP columns split, 2 all-reduces per layer",
        splits="heads",
        module="tp",
        traffic="tensor_allreduce",
        even_split=True,
        serves=True,
        adapters=True,
    ),
    StrategyInfo(
        "ep",
        "expert parallel: MoE experts spread over ranks, all-to-all per MoE layer",
        trains=False,
        splits="experts",
        traffic="expert_all_to_all",
    ),
    StrategyInfo(
        "sp",
        "sequence (ring) parallel: the sequence split, K/V passed around a ring",
        trains=False,
        splits="sequence",
        traffic="ring_attention",
    ),
)
REGISTRY: dict[str, StrategyInfo] = {s.name: s for s in _ALL}


def names(trainable: bool = False) -> tuple[str, ...]:
    """Strategy names in the canonical order (only the trainable ones when asked)."""
    return tuple(s.name for s in _ALL if s.trains or not trainable)


def with_trait(trait: str) -> tuple[str, ...]:
    """Strategy names whose StrategyInfo has `trait` set, in the canonical order."""
    return tuple(s.name for s in _ALL if getattr(s, trait))


def get(name: str, trainable: bool = False) -> StrategyInfo:
    info = REGISTRY.get(name)
    if info is None or (trainable and not info.trains):
        choices = names(trainable)
        raise UsageError(f"unknown strategy {name!r} (choose from {', '.join(choices)})")
    return info
