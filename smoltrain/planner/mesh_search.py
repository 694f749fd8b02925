"""`plan --mesh auto|AXIS=N,...` and `run --mesh auto`: the layouts a world allows, each laid
onto the hosts, timed (planner.mesh_plan) and ranked.

The search:
- layouts: every way to write the world as sizes of two or three of dp, pp and tp (each
  wider than one), in every axis order, and given --inner-steps H each with diloco in dp's
  place (outermost, as it runs); refused (listed under `skipped`, with why): tp wider
  than the KV head groups, pp deeper than the layers, a batch smaller than the replicas, more
  microbatches than a replica's sequences;
- hosts (`--placement auto`, the default): the innermost axis's groups are formed greedily
  from the fastest measured pairs (a 1 MB message's time each way, Link.seconds), the groups
  then tried in every order (up to 4 groups; the outer axes' hops differ), beside inventory
  order; the layout keeps the assignment with the shortest predicted step. `--placement even`
  keeps inventory order;
- cuts (`--placement auto` on measured compute): each assignment is also timed under uneven
  cuts (cut_by_speed), kept where its predicted step is shorter;
- dropped: a layout that does not fit memory on some rank, or that no assignment keeps off
  a down link;
- ranked by tokens per second (the same batch for all), ties to the earlier layout.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from itertools import permutations, product

from smolnet.errors import UsageError
from smoltrain.mesh import AXES, MODEL_AXES, Mesh, MeshError, parse
from smoltrain.planner import mesh_plan, rank_time
from smoltrain.planner.compute import cpu_links
from smoltrain.planner.mesh_traffic import axis_traffic, mesh_link_bytes
from smoltrain.planner.placement import greedy_counts

SCHEMA = "smoltrain.meshplan/1"
SEARCHED = (AXES[0], *MODEL_AXES)  # the axes the planner times today: dp, then pp and tp; diloco given H
NOT_SEARCHED = "fsdp x tp is not planned yet; diloco only with --inner-steps H (docs/mesh.md)"
GROUP_ORDERS = 4  # try every order of the innermost groups up to this many groups
CANDIDATES = 48  # host orders timed per layout at most (each a few ms)


def check(mesh: Mesh, spec, batch: int, microbatches: int, inner_steps: int | None = None) -> None:
    """What the runtime would refuse (run.preflight.check_mesh's checks), before any timing."""
    from smoltrain.mesh import check_model

    check_model(mesh, spec)
    model, data, _ = mesh.roles()
    if model == "fsdp":
        raise MeshError(f"--mesh {mesh.text()}: fsdp x tp runs, but the plan does not time it yet (docs/mesh.md)")
    if model not in MODEL_AXES:
        raise MeshError(
            f"--mesh {mesh.text()}: {model} alone is `plan --strategy {model}` (a mesh splits the model too)"
        )
    if data == "diloco" and not inner_steps:
        raise MeshError(
            f"--mesh {mesh.text()}: a diloco axis is planned with --inner-steps H (no H is picked for a mesh)"
        )
    n = mesh.size(data) if data else 1
    if batch < n:
        raise MeshError(f"--mesh {mesh.text()}: --batch {batch} is smaller than the {n} {data} replicas")
    if mesh.size("pp") > 1 and microbatches > batch // n:
        raise MeshError(
            f"--mesh {mesh.text()}: --microbatches {microbatches} exceeds a replica's {batch // n} sequences"
        )


def layouts(world: int, diloco: bool = False) -> list[Mesh]:
    """Every mesh of two or three axes from SEARCHED, each wider than one, multiplying to `world`;
    with `diloco`, also those whose data axis is diloco (outermost, as it runs)."""
    out = []
    for d in _divisors(world):
        for p in _divisors(world // d):
            sizes = {"dp": d, "pp": p, "tp": world // d // p}
            wide = [(a, n) for a, n in sizes.items() if n > 1]
            if len(wide) < 2:
                continue
            out += [Mesh(tuple(o)) for o in permutations(wide)]
            if diloco and d > 1:
                out += [Mesh((("diloco", d), *o)) for o in permutations(wide[1:])]
    return out


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def pair_cost(lm, a: str, b: str) -> float:
    """How far apart two hosts are: a 1 MB message's time, the slower way (inf: a link down)."""
    return max(lm.get(a, b).seconds(1e6), lm.get(b, a).seconds(1e6))


def inner_groups(names: list[str], size: int, lm) -> list[list[int]]:
    """The hosts (indices) in groups of `size`, greedily: the closest remaining pair first, then
    the host closest to all of the group's, until it is full; ties to inventory order."""
    left = list(range(len(names)))
    out = []
    while left:
        if size == 1:
            out.append([left.pop(0)])
            continue
        pairs = [
            (pair_cost(lm, names[a], names[b]), i, j) for i, a in enumerate(left) for j, b in enumerate(left) if i < j
        ]
        _, i, j = min(pairs)
        g = [left[i], left[j]]
        while len(g) < size:
            g.append(
                min((h for h in left if h not in g), key=lambda h: max(pair_cost(lm, names[h], names[x]) for x in g))
            )
        out.append(sorted(g))
        left = [h for h in left if h not in g]
    return out


def assignments(mesh: Mesh, names: list[str], lm, how: str) -> list[list[int]]:
    """Candidate host orders (rank r on host order[r]). `even`: inventory order. `auto`: the
    innermost axis's groups on the closest hosts, the groups in every order and each later group
    turned every way (which hosts meet along the outer axes), then, on up to 4 ranks, every other
    order, and inventory order last; at most CANDIDATES."""
    ident = list(range(mesh.world))
    if how == "even":
        return [ident]
    size = mesh.axes[-1][1]
    groups = inner_groups(names[: mesh.world], size, lm)
    orders = permutations(groups) if len(groups) <= GROUP_ORDERS else [groups]
    out: list[list[int]] = []

    def add(cand):
        if cand not in out and len(out) < CANDIDATES:
            out.append(cand)

    for o in orders:
        for turns in product(range(size), repeat=len(o) - 1):
            add(o[0] + [h for g, k in zip(o[1:], turns) for h in g[k:] + g[:k]])
    if mesh.world <= 4:
        for cand in permutations(ident):
            add(list(cand))
    return out + ([] if ident in out else [ident])  # on a tie the innermost axis keeps the closest hosts


def lay_out(mesh: Mesh, sh: mesh_plan.Shape, ranks: list, lm, how: str, measured: bool = False) -> dict:
    """The best assignment of one mesh onto these ranks (the first of equals), as an entry; with
    `how` auto on `measured` compute, each assignment also under uneven cuts (kept where faster)."""

    def timed(m: Mesh, hosts: list) -> dict:
        groups = axis_traffic(m, sh.model, sh.batch, sh.seq, sh.microbatches, sh.dtype, **sh.outer)
        link_bytes = mesh_link_bytes(m, sh.model, sh.batch, sh.seq, sh.microbatches, sh.dtype, **sh.outer)
        return mesh_plan.entry(m, sh, hosts, cpu_links(lm, hosts), lm, groups, link_bytes, how)

    best = None
    for order in assignments(mesh, [r.name for r in ranks], lm, how):
        hosts = [ranks[i] for i in order]
        cut = cut_by_speed(mesh, sh, hosts) if how == "auto" and measured else mesh
        for e in [timed(mesh, hosts)] + ([timed(cut, hosts)] if cut != mesh else []):
            if best is None or _key(e) < _key(best):
                best = e
    return best


def cut_by_speed(mesh: Mesh, sh: mesh_plan.Shape, hosts: list) -> Mesh:
    """The mesh with uneven cuts from each rank's compute on hosts[r] (rank_time, as the plan
    times it), by the 1-D placement's greedy split (placement.greedy_counts, least slowest part):
    layers per pp stage, a stage as slow as its slowest rank (its tp members, in every replica),
    then, under those cuts, sequences per dp replica, a replica as slow as its slowest rank
    (at least --microbatches each under pp). Memory is left to the plan's check (`fits`)."""
    model, data, _ = mesh.roles()
    idx = {a: i for i, a in enumerate(mesh.names)}

    def slowest(m: Mesh, members: list[int]) -> float:
        return max(
            rank_time.seconds(hosts[r], mesh_plan.rank_work(m, sh, r), mesh_plan.rank_shape(m, sh, r)).compute_s
            for r in members
        )

    def split(axis: str, total: int, least: int, field: str, base: Mesh) -> Mesh:
        n = base.size(axis)
        members = [[r for r in range(base.world) if base.coords(r)[idx[axis]] == i] for i in range(n)]

        @cache
        def cost(i: int, c: int) -> float:
            return slowest(replace(base, **{field: tuple(c if j == i else least for j in range(n))}), members[i])

        counts = greedy_counts(total, cost, [least] * n, [total] * n)
        return replace(base, **{field: tuple(counts)}) if counts and len(set(counts)) > 1 else base

    if mesh.size("pp") > 1:
        mesh = split("pp", sh.model.layers, 1, "layers", mesh)
    if data == "dp" and mesh.size("dp") > 1:
        mesh = split("dp", sh.batch, sh.microbatches if mesh.size("pp") > 1 else 1, "rows", mesh)
    return mesh


def _key(e: dict) -> tuple:
    """Runnable and fitting first, then the shortest step (to the microsecond: equal steps keep the first)."""
    return (not e["fits"], e["step_s"] is None, round(e["step_s"] or 0.0, 6))


def shape_of(req, model) -> mesh_plan.Shape:
    o = req.outer or {}
    return mesh_plan.Shape(
        model,
        req.batch,
        req.seq,
        req.microbatches,
        req.dtype,
        req.compute_dtype,
        o.get("inner_steps"),
        o.get("sync_dtype") or "fp32",
        req.tuning,
    )


def mesh_request(req):
    """The request its ranks resolve under: every rank busy (a mesh keeps them all computing)."""
    if req.mode != "train":
        raise UsageError("plan --mesh: a training step (--mode train)")
    t = req.tuning
    if t is not None and (t.quantize or t.checkpoint_activations):  # LoRA is planned (mesh_traffic)
        raise UsageError("plan --mesh: a quantised base and checkpointing are not planned for a mesh yet")
    return replace(req, strategy="tp", placement="even")


def world_of(o: dict) -> int | None:
    """plan's world for a mesh: --world or --local, else (no hosts named) the explicit mesh's own."""
    if o.get("world") or o.get("local") or o.get("inventory") or o.get("links") or o["mesh"] == "auto":
        return o.get("world")
    return parse(o["mesh"], None).world


def beside_strategies(doc: dict, req) -> None:
    """`plan --strategy all`: the ranked layouts under doc["meshes"] and the best under
    doc["best_mesh"], where the world allows a mesh and the planner times one (else nothing)."""
    from smoltrain.planner.request import resolve

    try:
        r = mesh_request(req)
        setting = resolve(r)
        if len(setting.ranks) < 4:
            return
        found = search(r, setting, "even" if req.placement == "even" else "auto")
    except UsageError:
        return
    doc["meshes"], doc["best_mesh"] = found["meshes"], found["best"]


def explicit(req, setting, text: str, how: str) -> dict:
    """`plan --mesh AXIS=N,...`: one layout's document; a mesh the world, the model or the
    links cannot take is refused in one line."""
    mesh = parse(text, len(setting.ranks), setting.model)
    sh = shape_of(req, setting.model)
    check(mesh, setting.model, req.batch, req.microbatches, sh.inner_steps)
    e = lay_out(mesh, sh, setting.ranks, setting.lm, how, setting.compute_source == "measured")
    if e["step_s"] is None and e["bottleneck"] == "link":
        raise MeshError(f"--mesh {text}: {e['bottleneck_where']}")
    return _doc(req, setting, [e], [])


def search(req, setting, how: str) -> dict:
    """`plan --mesh auto`: every layout the world allows that fits and avoids down links, ranked."""
    world = len(setting.ranks)
    sh = shape_of(req, setting.model)
    found, skipped = [], []
    for mesh in layouts(world, diloco=sh.inner_steps is not None):
        try:
            check(mesh, setting.model, req.batch, req.microbatches, sh.inner_steps)
            e = lay_out(mesh, sh, setting.ranks, setting.lm, how, setting.compute_source == "measured")
        except UsageError as err:  # MeshError is one
            skipped.append({"layout": mesh.text(), "reason": str(err)})
            continue
        if not e["fits"] or e["step_s"] is None:
            skipped.append({"layout": mesh.text(), "reason": e["bottleneck_where"]})
            continue
        found.append(e)
    if not found:
        why = skipped[0]["reason"] if skipped else f"a world of {world} has no layout of two axes or more"
        raise MeshError(f"--mesh auto: no layout of {world} ranks fits and runs here ({why})")
    found.sort(key=lambda e: -e["tokens_per_s"])
    return _doc(req, setting, found, skipped)


def _doc(req, setting, meshes: list[dict], skipped: list[dict]) -> dict:
    return {
        "schema": SCHEMA,
        "model": setting.model.name,
        "world_size": len(setting.ranks),
        "dtype": req.dtype,
        "batch": req.batch,
        "seq": req.seq,
        "microbatches": req.microbatches,
        "compute_source": setting.compute_source,
        "link_source": setting.lm.source,
        "best": meshes[0]["layout"],
        "meshes": meshes,
        "skipped": skipped,
        "not_searched": NOT_SEARCHED,
    }


def _run_setting(args):
    """(request, resolved setting, inventory hosts or None) of a mesh run's arguments: what `plan
    --mesh` resolves for the same ranks, links and compute."""
    from smoltrain.planner.links import read_report
    from smoltrain.planner.request import PlanRequest, model_of, resolve
    from smoltrain.planner.selection import hosts as inventory_hosts

    only_modes(args)
    hosts = inventory_hosts(args.inventory, None) if args.inventory else None
    req = PlanRequest(
        "tp",
        model_of(args.model),
        world=args.local or len(hosts),
        dtype="fp32",
        batch=args.batch,
        seq=args.seq,
        microbatches=args.microbatches,
        placement="even",
        hosts=hosts,
        links=read_report(args.links) if args.links else None,
        compute=getattr(args, "compute", None),
        local=hosts is None,
        compute_dtype=getattr(args, "dtype", None),
        outer={"inner_steps": args.inner_steps, "sync_dtype": args.sync_dtype},  # H given: diloco layouts too
        tuning=getattr(args, "tuning", None),  # a LoRA run's, made by commands.run (the planner reads no model)
    )
    req = mesh_request(req)  # LoRA is planned; a quantised base and checkpointing are refused
    return req, resolve(req), hosts


def only_modes(args) -> None:
    if args.shares or (args.placement and args.placement not in ("even", "auto")):
        raise MeshError(f"--mesh {args.mesh}: --shares and placement files do not apply to a mesh (--placement auto)")


def run_how(args, hosts) -> str:
    """A mesh run's placement: auto where asked, or on an inventory unless --placement even."""
    return "auto" if args.placement == "auto" or (hosts is not None and args.placement != "even") else "even"


def for_run(args) -> tuple[str, list[str] | None, str]:
    """`run --mesh auto`: the plan's pick for this run's ranks, links and compute (what `plan
    --mesh auto` says for the same arguments), as (mesh text, host names in rank order, None on
    this machine, and a line saying what was chosen)."""
    req, setting, hosts = _run_setting(args)
    how = run_how(args, hosts)
    best = search(req, setting, how)["meshes"][0]
    line = (
        f"mesh auto: {best['layout']} on {', '.join(best['order'])}, {best['step_s'] * 1e3:.1f} ms/step predicted, "
        f"bottleneck {best['bottleneck']} ({best['bottleneck_where']})"
    )
    return best["layout"], (best["order"] if hosts is not None else None), line


def run_placement(args, text: str) -> tuple[dict | None, dict | None]:
    """A mesh run's placement and its plan entry: what `plan --mesh TEXT` picks for the same
    arguments (its host order and uneven cuts), or (None, None) where that is the even split
    in the given order (--placement even, nominal compute, or no faster cut)."""
    only_modes(args)
    if run_how(args, args.inventory) != "auto":  # before resolving: a run it would not place
        return None, None
    try:
        req, setting, _ = _run_setting(args)
        if setting.compute_source != "measured":
            return None, None
        e = explicit(req, setting, text, "auto")["meshes"][0]
    except UsageError:
        if args.placement == "auto":  # asked for: say why not; else the mesh runs even, as unplanned
            raise
        return None, None
    if "layers" not in e["mesh"] and "rows" not in e["mesh"]:
        return None, None
    mesh, cuts = parse(text, None), {k: v for k, v in e["mesh"].items() if k in ("layers", "rows")}
    return {"mode": "auto", "strategy": mesh.roles()[0], "mesh": mesh.text(), "order": e["order"]} | cuts, e
