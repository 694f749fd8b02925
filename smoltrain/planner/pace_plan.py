"""The plan of a paced outer step: diloco under `--placement auto` trains, over an outer step's
H batches, the sequences planner.pacing gives each host from its pace, not the placement's
whole sequences of every batch, so the plan predicts that split.

Each rank's compute is the mean over the outer step's inner steps of its compute for the
sequences it trains in each (floor(n/H) or one more, as the run slices them), its memory the
most it trains in one inner step. H is picked at the shares the split tends to (a host's
pace over the sum of paces, of the batch), then the split is made at that H. The paces are
the run's own where the placement carries them (`compute_s`: a run's report, for `plan
--compare`), else the plan's compute for the placement's whole sequences (what `run` hands
its ranks: planning.plan_run).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from smoltrain.planner import pacing, rank_time


@dataclass
class Paced:
    names: list[str]
    ranks: list
    works: list  # capacity.RankWork per rank, at the placement's whole sequences
    sh: rank_time.Shape
    placed_s: list[float]  # the compute for the placed whole sequences the paces are from (run's, else plan's)
    pace: dict[str, float]  # sequences per second (pacing.placed_paces)

    @classmethod
    def of(cls, placement: dict | None, names, ranks, works, sh, placed_s: list[float]) -> Paced | None:
        """The paced split of this plan, or None where the run keeps the placement's split
        (not auto, no batch shares, an even or hand-given split)."""
        p = placement or {}
        if p.get("mode") != "auto" or not p.get("shares"):
            return None
        own = p.get("compute_s") if len(p.get("compute_s") or []) == len(names) else None
        secs = [float(x) for x in own or placed_s]
        pace = pacing.placed_paces(dict(p, compute_s=secs), sh.batch)
        if set(pace) != set(names):
            return None
        return cls(list(names), list(ranks), list(works), sh, secs, pace)

    def piece(self, r: int, n: float):
        return replace(self.works[r], tokens=n * self.sh.seq)

    def tending_s(self) -> list[float]:
        """Each rank's compute at the share the split tends to as H grows: picks H."""
        total = sum(self.pace[n] for n in self.names)
        return [
            rank_time.seconds(rk, self.piece(r, self.sh.batch * self.pace[n] / total), self.sh).compute_s
            for r, (n, rk) in enumerate(zip(self.names, self.ranks))
        ]

    def split(self, steps: int) -> dict:
        """pacing.paced_counts over `steps` batches ({steps, counts}), as the run makes it."""
        got = pacing.paced_counts(self.pace, self.names, steps, self.sh.batch)
        if got is None:  # placed_paces gave every name a pace, so only a batch below the world
            raise ValueError(f"no paced split of {steps} batches of {self.sh.batch} over {self.names}")
        return got

    def rows(self, steps: int) -> list[tuple[dict, rank_time.RankTime]]:
        """Each rank's plan row and times at the split over `steps` inner steps."""
        got = self.split(steps)
        per = pacing.per_step(got, self.names, self.sh.batch)
        return [
            self._row(r, rk, per[r], got["counts"][n] / steps) for r, (n, rk) in enumerate(zip(self.names, self.ranks))
        ]

    def _row(self, r: int, rk, ns: list[int], mean_n: float) -> tuple[dict, rank_time.RankTime]:
        at = {n: rank_time.row(r, rk, self.piece(r, n), self.sh) for n in set(ns)}
        row, most = at[max(ns)]  # memory: the most it trains in one inner step

        def mean(f) -> float:
            return sum(f(*at[n]) for n in ns) / len(ns)

        t = rank_time.RankTime(
            mean(lambda _, t: t.compute_s), mean(lambda _, t: t.flops_s), mean(lambda _, t: t.memory_s), most.update_s
        )
        row = dict(row, compute_s=t.compute_s, bound=t.bound)
        row.update(flops_per_step=mean(lambda p, _: p["flops_per_step"]))
        row.update(memory_traffic_bytes=mean(lambda p, _: p["memory_traffic_bytes"]))
        row.update(sequences_per_step=mean_n, sequences_most=max(ns))
        return row, t

    def section(self, steps: int) -> dict:
        """The plan's `paced`: the split over one outer step and where it came from."""
        got = self.split(steps)
        return {
            "inner_steps": steps,
            "sequences": [got["counts"][n] for n in self.names],
            "sequences_per_s": [self.pace[n] for n in self.names],
            "placed_sequences": [int(round(w.tokens / self.sh.seq)) for w in self.works],
            "placed_compute_s": list(self.placed_s),
        }
