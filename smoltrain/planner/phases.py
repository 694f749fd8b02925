"""A phase the plan builder amortises: work that runs once every `every` steps, not every step.

A plan's step is its inner phases (planner.traffic: what crosses each link every step) plus,
for a strategy with outer steps, one amortised phase (planner.diloco.outer_phase: the ring
all-reduce of the pseudo-gradient and the outer update, every H inner steps). The builder
(planner.plan) charges each amortised phase 1/every of its bytes, messages and seconds per
step, and each rank the state it keeps between runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from smoltrain.planner.timing import CommCost
from smoltrain.planner.traffic import Traffic


@dataclass
class Amortised:
    what: str  # what runs (the doc's notes name it)
    tr: Traffic  # what crosses the links in one run (phases of rounds, on the ring's links)
    every: int  # inner steps per run (diloco's H)
    cc: CommCost  # one run's communication time
    update_s: float  # one run's compute beyond its traffic (the outer optimizer)
    state_bytes: float  # per rank, kept between runs (an anchor and a momentum)
    dtype: str  # the dtype on the wire
    every_source: str  # why `every`: "given", or the target it keeps ("target_comm 0.1")
    target_comm: float  # the share of the step communication may take
    note: str = ""

    @property
    def sync_s(self) -> float:
        """One run: its communication and its update."""
        return self.cc.total_s + self.update_s

    @property
    def rank_bytes(self) -> list[float]:
        """Bytes each rank sends in one run."""
        return self.tr.rank_bytes()

    @property
    def busiest(self) -> float:
        return max(self.rank_bytes) if self.tr.world else 0.0
