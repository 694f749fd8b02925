"""Where a `--mesh pp=P,tp=T` decode puts each rank, and the bytes its plan counts.

The controller's side of infer.meshed, torch-free (a controller that only lays ranks out
does not pay torch's start-up).
"""

from __future__ import annotations

from smolnet.errors import UsageError

INFER_AXES = ("pp", "tp")


def layout(text: str, world: int, mc) -> tuple[str, str | None, list[tuple[int, int]]]:
    """(strategy, mesh text or None, [first, last) per world rank) for `--mesh` over `world` ranks;
    a mesh with one axis wider than 1 is that strategy alone. One-line errors (exit 2) for a mesh
    that is not the world, an axis inference does not split along, tp wider than the KV heads."""
    from smoltrain.mesh import parse
    from smoltrain.models.split import check_tp, even_layers

    other = [a for a in text.replace(" ", "").split(",") if a.partition("=")[0] not in INFER_AXES]
    if other:
        raise UsageError(f"--mesh {text}: inference splits along pp and tp only, not {other[0].partition('=')[0]}")
    mesh = parse(text, world, mc.spec())
    pp, tp = mesh.size("pp"), mesh.size("tp")
    if tp > 1:
        check_tp(mc, tp)
    stages = even_layers(mc.layers, pp)
    layers = [stages[place(mesh.text(), r)[0]] for r in range(world)]
    if pp == 1 or tp == 1:
        return ("pp" if pp > 1 else "tp" if tp > 1 else "local"), None, layers
    return "pp", mesh.text(), layers


def decode_plan(text: str, mc, names, dtype: str, wire: str | None) -> dict:
    """The report's `plan` of a pp x tp decode: bytes per link and the busiest rank's per generated
    token (planner.mesh_traffic); the infer planner gives no time, memory or placement for a mesh."""
    from smoltrain.mesh import parse
    from smoltrain.planner.mesh_traffic import mesh_decode_bytes

    links = mesh_decode_bytes(parse(text, len(names)), mc.spec(), dtype, wire)
    sent = [sum(b for (src, _), b in links.items() if src == r) for r in range(len(names))]
    return {
        "mode": "infer",
        "mesh": text,
        "bytes_per_token": max(sent),
        "links": [{"src": names[a], "dst": names[b], "bytes": n} for (a, b), n in sorted(links.items())],
        "tokens_per_s": None,
        "note": "a pp x tp mesh is planned for its bytes only (no time, memory or placement yet)",
    }


def place(text: str, rank: int) -> tuple[int, int, int, int]:
    """(stage, stages, tp rank, tp width) of a world rank on the mesh."""
    from smoltrain.mesh import parse

    mesh = parse(text, None)
    c = dict(zip(mesh.names, mesh.coords(rank)))
    return c.get("pp", 0), mesh.size("pp"), c.get("tp", 0), mesh.size("tp")
