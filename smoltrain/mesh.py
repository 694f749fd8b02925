"""The device mesh: the world's ranks laid out on named axes, one strategy along each.

`--mesh dp=2,tp=2` lays 4 ranks on a 2 x 2 grid, outermost axis first, innermost last:
rank = sum(coordinate * stride), the last axis varying fastest, so the innermost axis (the
one that moves the most bytes per step, tp) joins consecutive ranks, which the placement puts
on the fastest links. Each rank talks along an axis through one Comm: the group of ranks that
differ from it only along that axis (comm.new_group). `--strategy S` alone is the 1-D mesh S=world.

What runs today (smoltrain.strategies.Context): one strategy runs along its axis's comm (pp,
tp, or fsdp with tp); a tp axis beside pp or fsdp splits the blocks of every stage or unit
over its tp group; a dp axis replicates the whole, each replica on its slice of the batch,
their gradients summed over the dp comm before the step; a diloco axis (outermost) does the
same with an outer step every H inner steps instead (strategies.outer). Anything else (two
data axes, diloco inside another axis) is refused in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from smolnet.errors import UsageError
from smoltrain.planner.placement import even_counts, ranges

AXES = ("dp", "fsdp", "diloco", "pp", "tp")
MODEL_AXES = ("pp", "tp")  # split the model; the data axes replicate it
RUNS_WITH = {"dp", "diloco"}  # data axes that compose with a model axis today


class MeshError(UsageError):
    """A mesh the world or the model cannot take (exit 2, one line)."""


@dataclass(frozen=True)
class Axis:
    """This rank's place along one axis: its coordinate, the axis size, and the axis comm."""

    name: str
    index: int
    size: int
    comm: object = None


@dataclass(frozen=True)
class Mesh:
    axes: tuple[tuple[str, int], ...]  # (name, size), outermost first
    layers: tuple[int, ...] | None = None  # layers per pp stage (None: even), a placement's cut
    rows: tuple[int, ...] | None = None  # sequences per data-axis replica (None: even)

    names = property(lambda self: [a for a, _ in self.axes])
    world = property(lambda self: prod(n for _, n in self.axes))

    def size(self, axis: str) -> int:
        return dict(self.axes).get(axis, 1)

    def text(self) -> str:
        return ",".join(f"{a}={n}" for a, n in self.axes)

    def coords(self, rank: int) -> tuple[int, ...]:
        """Rank's coordinate along each axis, outermost first (the last one varies fastest)."""
        out = []
        for _, n in reversed(self.axes):
            rank, c = divmod(rank, n)
            out.append(c)
        return tuple(reversed(out))

    def rank_of(self, coords) -> int:
        r = 0
        for (_, n), c in zip(self.axes, coords):
            r = r * n + c
        return r

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along `axis` (ranks that differ only there), each increasing, by first rank."""
        i = self.names.index(axis)
        seen, out = set(), []
        for r in range(self.world):
            c = list(self.coords(r))
            g = [self.rank_of(c[:i] + [k] + c[i + 1 :]) for k in range(self.axes[i][1])]
            if g[0] not in seen:
                seen.add(g[0])
                out.append(g)
        return out

    def stage_layers(self, total: int) -> list[int]:
        return list(self.layers) if self.layers else even_counts(total, self.size("pp"))

    def replica_rows(self, batch: int) -> list[int]:
        return list(self.rows) if self.rows else even_counts(batch, self.size(self.roles()[1] or "dp"))

    def report(self) -> dict:
        """The run and plan reports' `mesh` field: the axes, each rank's coordinates, and any
        uneven cut: `layers` per pp stage, `rows` (sequences) per replica, each [first, last+1)."""
        out = {
            "axes": [{"name": a, "size": n} for a, n in self.axes],
            "hosts": [list(self.coords(r)) for r in range(self.world)],
        }
        return out | {k: ranges(v) for k, v in (("layers", self.layers), ("rows", self.rows)) if v}

    def roles(self) -> tuple[str, str | None, str | None]:
        """(the strategy run along its axis, the data axis replicating it, tp inside pp's stages),
        None where absent, over the axes wider than one; what does not compose yet is refused."""
        wide = [a for a, n in self.axes if n > 1] or [self.axes[-1][0]]
        if "diloco" in wide[1:]:  # its replicas are whole meshes of the inner axes, on the slow links
            raise MeshError(f"--mesh {self.text()}: diloco must be the outermost axis (docs/mesh.md)")
        if len(wide) == 1:
            return wide[0], None, None
        model = [a for a in MODEL_AXES if a in wide]
        data = [a for a in wide if a not in MODEL_AXES]
        if data == ["fsdp"] and model == ["tp"]:  # fsdp shards the tp slices, and splits the batch
            return "fsdp", None, "tp"
        if model and len(data) <= 1 and set(data) <= RUNS_WITH:
            return model[0], (data or [None])[0], (model[1] if len(model) == 2 else None)
        raise MeshError(
            f"--mesh {self.text()}: {' x '.join(wide)} does not run yet (today: pp, tp or pp x tp, "
            f"each alone or with dp or diloco, and fsdp x tp; docs/mesh.md)"
        )

    def along(self, axis: str, rank: int, comm=None) -> Axis:
        return Axis(axis, self.coords(rank)[self.names.index(axis)], self.size(axis), comm)


def with_cuts(mesh: Mesh, placement: dict | None) -> Mesh:
    """The mesh under a mesh placement's uneven cuts (its `layers` and `rows`, as Mesh.report's)."""
    cut = {k: tuple(hi - lo for lo, hi in (placement or {}).get(k) or []) or None for k in ("layers", "rows")}
    return Mesh(mesh.axes, **cut)


def parse(text: str, world: int | None, spec=None) -> Mesh:
    """`dp=2,tp=2` against the world size (None: not known yet) and the model's layers and heads."""
    axes, seen = [], set()
    for part in (text or "").split(","):
        name, eq, size = part.strip().partition("=")
        if not eq or not size.strip().isdigit() or int(size) < 1:
            raise MeshError(f"--mesh {text}: {part.strip()!r} is not AXIS=N with N a positive whole number")
        if name not in AXES:
            raise MeshError(f"--mesh {text}: unknown axis {name!r} (axes: {', '.join(AXES)})")
        if name in seen:
            raise MeshError(f"--mesh {text}: axis {name} is given twice")
        seen.add(name)
        axes.append((name, int(size)))
    mesh = Mesh(tuple(axes))
    if world is not None and mesh.world != world:
        raise MeshError(f"--mesh {text}: its axes multiply to {mesh.world} ranks, the world has {world}")
    if spec is not None:
        check_model(mesh, spec)
    return mesh


def check_model(mesh: Mesh, spec) -> None:
    """An axis wider than what it splits: tp over the KV head groups, pp over the layers."""
    tp, pp = mesh.size("tp"), mesh.size("pp")
    if tp > spec.kv_heads or tp > spec.ffn:
        raise MeshError(f"--mesh {mesh.text()}: tp={tp} is wider than {spec.name}'s {spec.kv_heads} KV head groups")
    if pp > spec.layers:
        raise MeshError(f"--mesh {mesh.text()}: pp={pp} is deeper than {spec.name}'s {spec.layers} layers")


def axis_comms(mesh: Mesh, comm) -> dict:
    """One comm per axis wider than one for this rank: the world comm where the axis is the world,
    else its group. Every rank builds every group in the same order (torch needs all ranks there)."""
    out = {}
    for axis, n in mesh.axes:
        if n == 1:
            continue
        if n == mesh.world:
            out[axis] = comm
            continue
        for g in mesh.groups(axis):
            made = comm.new_group(g)
            if made is not None:
                out[axis] = made
    return out


def strategy_axes(text: str, rank: int, comm) -> dict:
    """A worker's Context fields in a mesh run: rank, world and comm along the strategy's axis,
    `replica` (the data axis, an Axis with its comm) and `tp` (inside pp's stages), None if absent."""
    mesh = parse(text, comm.world_size)
    model, data, inner = mesh.roles()
    comms = axis_comms(mesh, comm)
    own = mesh.along(model, rank, comms.get(model))
    other = {k: mesh.along(a, rank, comms.get(a)) if a else None for k, a in (("replica", data), ("tp", inner))}
    return dict(rank=own.index, world=own.size, comm=own.comm, **other)


def mesh_of(cfg) -> Mesh:
    """The mesh a run config describes: its --mesh, or the 1-D mesh of its --strategy."""
    return (
        with_cuts(parse(cfg.mesh, cfg.world_size), cfg.placement)
        if cfg.mesh
        else Mesh(((cfg.strategy, cfg.world_size),))
    )


def loss_shares(cfg) -> int:
    """How many ranks report a share of a mesh run's loss: one per place on the data axes."""
    return prod(n for a, n in mesh_of(cfg).axes if a not in MODEL_AXES)
