"""Checks before a run starts, and the report written whatever way it ends.

Why: a links file that is not one, or an output path that cannot be written used to surface
as a traceback or only after the whole run; and a run that failed or was interrupted (even
before any worker started: a refused resume, no intact checkpoint) left no report at all.
Option ranges are checked by argparse itself (smoltrain.validate); what the strategy or the
model cannot take, by check_usage.
"""

from __future__ import annotations

import os
from pathlib import Path

from smolnet.errors import SmolError, UsageError
from smolnet.files import write_json_atomic


def load_links(path: str) -> dict:
    """A links report given with --links: present, whole JSON, with a list of link objects."""
    import json

    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise UsageError(f"--links {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--links {path}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise UsageError(f"--links {path}: not valid JSON (truncated?): {e}") from None
    if not isinstance(doc, dict):
        raise UsageError(f"--links {path}: expected a JSON object with a 'links' list")
    links = doc.get("links")
    if not isinstance(links, list) or not all(isinstance(x, dict) for x in links):
        raise UsageError(f"--links {path}: 'links' must be a list of link objects, got {type(links).__name__}")
    return doc


def _writable_dir(d: Path, what: str) -> None:
    probe = d
    while not probe.exists():  # the nearest folder that exists must let us create the rest
        probe = probe.parent
    if not probe.is_dir():
        raise UsageError(f"{what}: {probe} is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"{what}: {probe} is not writable")


def check_outputs(args) -> None:
    """--json, --checkpoint-dir and --out must be writable before any worker starts."""
    if args.json:
        p = Path(args.json)
        if p.is_dir():
            raise UsageError(f"--json {p}: is a folder")
        if p.exists() and not os.access(p, os.W_OK):
            raise UsageError(f"--json {p}: not writable")
        _writable_dir(p.parent if str(p.parent) else Path("."), f"--json {p}")
    if args.checkpoint_dir:
        p = Path(args.checkpoint_dir)
        if p.exists() and not p.is_dir():
            raise UsageError(f"--checkpoint-dir {p}: is not a folder")
        _writable_dir(p, f"--checkpoint-dir {p}")
    _writable_dir(Path(args.out), f"--out {args.out}")


def status_of(exc: BaseException | None) -> tuple[str, str | None]:
    if exc is None:
        return "complete", None
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", "interrupted (Ctrl-C or SIGINT)"
    return "failed", str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def write_report(
    path: str | None, ctl, exc: BaseException | None, plan=None, doc: dict | None = None, plan_error: str | None = None
) -> dict:
    """The run report with `status` and `error`; for a failed run, every step that finished;
    `plan_error` when the planner failed (the run went on without a prediction)."""
    status, error = status_of(exc)
    if doc is None:
        try:
            doc = ctl.report(partial=True)
        except Exception as e:  # never lose the failure to a reporting problem
            doc = {"schema": "smoltrain.run/1", "strategy": ctl.strategy, "report_error": str(e)}
    doc["status"], doc["error"] = status, error
    if exc is not None:
        doc["blamed"] = getattr(ctl, "blamed", None)
    if plan is not None:
        doc["plan"] = plan
    if plan_error:
        doc["plan_error"] = plan_error
    if path:
        try:
            write_json_atomic(path, doc, indent=1)
        except OSError as e:
            if exc is None:
                raise SmolError(f"--json {path}: cannot write the report: {e.strerror or e}") from None
    return doc


class EarlyReport:
    """The report of a run that ends before its controller takes over (a refused resume, no
    intact checkpoint, a bad placement, Ctrl-C while loading the corpus): `status`, `error`,
    no steps. Usage errors that come before the world size is known (argparse, an unknown
    strategy, an inventory that cannot be read) write none; the one-line error says it all.

        with EarlyReport(args) as early:
            early.world = ...; early.cfg = ...   # as they become known
            early.handover()                     # the controller writes the report from here
    """

    def __init__(self, args):
        self.args = args
        self.world: int | None = None
        self.names: list[str] | None = None
        self.cfg = None
        self.events: list[dict] = []
        self.handed_over = False

    def handover(self) -> None:
        self.handed_over = True

    def __enter__(self) -> EarlyReport:
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is not None and not self.handed_over and isinstance(exc, (SmolError, KeyboardInterrupt)):
            self.write(exc)
        return False  # the error goes on to the command line as before

    def doc(self, exc: BaseException) -> dict:
        status, error = status_of(exc)
        a = self.args
        config = (
            self.cfg.report_view()
            if self.cfg is not None
            else {k: getattr(a, k, None) for k in ("model", "steps", "batch", "seq", "lr", "seed", "microbatches")}
        )
        doc = {
            "schema": "smoltrain.run/1",
            "strategy": a.strategy,
            "backend": a.backend,
            "world_size": self.world,
            "config": config,
            "steps": [],
            "bytes": [],
            "events": list(self.events),
            "final_loss": None,
            "tokens_per_s": None,
            "status": status,
            "error": error,
        }
        if self.names:
            doc["hosts"] = list(self.names)
        return doc

    def write(self, exc: BaseException) -> None:
        path = getattr(self.args, "json", None)
        if not path or not self.world:
            return
        try:
            write_json_atomic(path, self.doc(exc), indent=1)
        except OSError:
            pass  # an unwritable --json is itself the error being reported


def check_usage(cfg) -> None:
    """Refuse what the strategy or the model cannot take (a RunConfig), before any process starts."""
    from smoltrain import registry
    from smoltrain.strategies import check_world

    world, spec, info = cfg.world_size, cfg.model, registry.get(cfg.strategy, trainable=True)
    if cfg.mesh:  # the strategy splits along its own axis; the data axis splits the batch first
        world = check_mesh(cfg)
    check_world(cfg.strategy, spec, world)
    if cfg.seq > spec.ctx or cfg.seq < 1:
        raise UsageError(f"--seq {cfg.seq} must be between 1 and the model's context {spec.ctx}")
    if cfg.steps < 1 or cfg.batch < 1:
        raise UsageError("--steps and --batch must be positive")
    if info.splits == "batch" and cfg.batch < world:
        raise UsageError(f"--batch {cfg.batch} is smaller than the {world} ranks sharing it")
    if cfg.strategy == "pp" and cfg.microbatches > cfg.batch:
        raise UsageError(f"--microbatches {cfg.microbatches} exceeds --batch {cfg.batch}")
    if cfg.shares and len(cfg.shares) != world:
        raise UsageError(f"--shares has {len(cfg.shares)} entries for {world} ranks")
    if cfg.placement and not cfg.mesh:  # a mesh's cuts: check_mesh
        from smoltrain.planner.placement import validate

        validate(cfg.placement, cfg.strategy, spec, cfg.batch, world)


def check_mesh(cfg) -> int:
    """A mesh run's config (the mesh against its world and model, a pair that composes, a batch
    the data axis can split); returns the strategy axis's size, what the strategy splits over."""
    from smoltrain.mesh import MeshError, parse, with_cuts

    mesh = parse(cfg.mesh, cfg.world_size, cfg.model)
    model, data, _ = mesh.roles()
    if model != cfg.strategy:
        raise MeshError(f"--mesh {cfg.mesh} runs {model} along its axis, not {cfg.strategy}")
    if cfg.shares or (cfg.placement and cfg.placement.get("mesh") != mesh.text()):
        raise MeshError(f"--mesh {cfg.mesh}: --shares and placement files do not apply to a mesh (--placement auto)")
    mesh = with_cuts(mesh, cfg.placement)
    if data:
        n = mesh.size(data)
        if cfg.batch < n:
            raise MeshError(f"--mesh {cfg.mesh}: --batch {cfg.batch} is smaller than the {n} {data} replicas")
        if model == "pp" and cfg.microbatches > min(mesh.replica_rows(cfg.batch)):
            raise MeshError(
                f"--mesh {cfg.mesh}: --microbatches {cfg.microbatches} exceeds a replica's "
                f"{min(mesh.replica_rows(cfg.batch))} sequences (--batch {cfg.batch} over {data}={n})"
            )
    for what, cut, n, total in (
        ("layers", mesh.stage_layers(cfg.model.layers), mesh.size("pp"), cfg.model.layers),
        ("rows", mesh.replica_rows(cfg.batch), mesh.size(data or "dp"), cfg.batch),
    ):
        if len(cut) != n or sum(cut) != total or min(cut) < 1:
            raise MeshError(f"--mesh {cfg.mesh}: the placement's {what} {cut} do not cover {total} over {n}")
    return mesh.size(model)
