"""Checks before a run starts, and the report written whatever way it ends.

Why: an option that is out of range, a links file that is not one, or an output path that
cannot be written used to surface as a traceback, as silent NaN training, or only after the
whole run; and a run that failed or was interrupted left no report at all.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from smolnet.errors import SmolError, UsageError
from smolnet.files import write_json_atomic


def check_args(args) -> None:
    """One-line usage errors (exit 2) for options argparse lets through."""
    if not 0 <= args.control_port <= 65535:
        raise UsageError(f"--control-port {args.control_port}: must be 0 (any free) or 1..65535")
    if args.microbatches < 1:
        raise UsageError(f"--microbatches {args.microbatches}: must be at least 1")
    for name in ("timeout", "barrier_timeout", "heartbeat"):
        v = getattr(args, name, None)
        if v is not None and not (math.isfinite(v) and v > 0):
            raise UsageError(f"--{name.replace('_', '-')} {v}: must be a positive number of seconds")
    if args.checkpoint_every < 0:
        raise UsageError(f"--checkpoint-every {args.checkpoint_every}: must be 0 (only at the end) or more")
    if getattr(args, "keep_checkpoints", 1) < 1:
        raise UsageError(f"--keep-checkpoints {args.keep_checkpoints}: must be at least 1")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise UsageError(f"--lr {args.lr}: must be a positive finite number")
    if not (math.isfinite(args.pace) and args.pace >= 0):
        raise UsageError(f"--pace {args.pace}: must be 0 or more seconds")
    if not (math.isfinite(args.data_cap_mb) and args.data_cap_mb > 0):
        raise UsageError(f"--data-cap-mb {args.data_cap_mb}: must be positive")


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
