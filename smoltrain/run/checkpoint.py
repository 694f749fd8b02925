"""Checkpoints: state dicts only, in safetensors files, written atomically and durably.

Layout: `DIR/step-000005/` holds one `<part>.safetensors` per rank that owns
state (`rank0`, `rank1`, ... or `server` for the parameter-server strategies)
and, once every part is on disk, `complete.json` written by the controller: the run's
identity (`run`, a digest of everything that determines the trajectory: model shape, data,
seed, lr, strategy, batch, seq, world, schedule, shares) and its readable fields. `--resume`
takes the newest complete checkpoint, refuses one made by another run (a folder reused with
another lr must not silently continue the older run), and falls back past a damaged one to
the previous complete step. Parts, marker and folder are fsynced before the marker counts;
temp files of a crash are removed; only the newest `keep` complete steps are kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from smolnet.errors import SmolError

MATCH_KEYS = ("strategy", "world_size", "model", "seed", "batch", "seq")
RUN_KEYS = ("strategy", "world_size", "model", "seed", "batch", "seq", "lr", "data")


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _durable_replace(tmp: Path, path: Path) -> None:
    """fsync the file, rename it into place, fsync the folder: on disk even after a power cut."""
    try:
        _fsync_path(tmp)
        os.replace(tmp, path)
        _fsync_path(path.parent, directory=True)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_part(root: str | os.PathLike, step: int, part: str, tensors: dict) -> Path:
    from safetensors.torch import save_file

    d = step_dir(root, step)
    new = not d.exists()
    d.mkdir(parents=True, exist_ok=True)
    if new:
        _fsync_path(d.parent, directory=True)
    path = d / f"{part}.safetensors"
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        save_file({k: v.detach().contiguous().cpu().clone() for k, v in tensors.items()}, str(tmp))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _durable_replace(tmp, path)
    return path


def load_part(root: str | os.PathLike, step: int, part: str) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = step_dir(root, step) / f"{part}.safetensors"
    if not path.exists():
        raise SmolError(f"checkpoint {path}: missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise SmolError(f"checkpoint {path}: corrupt ({str(e).splitlines()[0][:120]})") from None


def identity(cfg) -> dict:
    """What a checkpoint must share with the run that resumes it (a RunConfig)."""
    trajectory = {
        "strategy": cfg.strategy,
        "world_size": cfg.world_size,
        "model": cfg.model.to_dict(),
        "seed": cfg.seed,
        "batch": cfg.batch,
        "seq": cfg.seq,
        "lr": cfg.lr,
        "data": cfg.data_digest,
        "microbatches": cfg.microbatches,
        "schedule": cfg.schedule,
        "shares": list(cfg.shares) if cfg.shares else None,
    }
    # only when set: older checkpoints keep their identity. (diloco's H and outer step are not part
    # of it: `run` picks them from the plan and the run's length, which a longer resumed run changes)
    if getattr(cfg, "optimizer", "adamw") != "adamw":
        trajectory["optimizer"] = cfg.optimizer
    run = hashlib.sha256(json.dumps(trajectory, sort_keys=True).encode()).hexdigest()[:16]
    return {
        "strategy": cfg.strategy,
        "world_size": cfg.world_size,
        "model": cfg.model.name,
        "seed": cfg.seed,
        "batch": cfg.batch,
        "seq": cfg.seq,
        "lr": cfg.lr,
        "data": cfg.data_digest,
        "run": run,
    }


def mark_complete(root: str | os.PathLike, step: int, meta: dict) -> None:
    path = step_dir(root, step) / "complete.json"
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(dict(meta, step=step), indent=1))
    _durable_replace(tmp, path)


def remove_temp(root: str | os.PathLike) -> int:
    """Delete what a crash mid-write left behind (`*.tmp<pid>`); returns how many."""
    n = 0
    for t in Path(root).glob("step-*/*.tmp*"):
        t.unlink(missing_ok=True)
        n += 1
    return n


def _complete_steps(rootp: Path) -> list[tuple[int, Path]]:
    out = []
    for d in rootp.glob("step-*"):
        try:
            step = int(d.name.split("-", 1)[1])
        except ValueError:
            continue
        if (d / "complete.json").exists():
            out.append((step, d))
    return sorted(out, reverse=True)


def prune(root: str | os.PathLike, keep: int) -> list[int]:
    """Keep the newest `keep` complete steps; remove older steps, complete or not."""
    rootp = Path(root)
    done = _complete_steps(rootp)
    if len(done) <= keep:
        return []
    oldest_kept = done[keep - 1][0]
    removed = []
    for d in rootp.glob("step-*"):
        try:
            step = int(d.name.split("-", 1)[1])
        except ValueError:
            continue
        if step < oldest_kept:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(step)
    return sorted(removed)


def _foreign(meta: dict, expect: dict) -> list[str]:
    """The fields where a checkpoint's run differs from this one (empty: same run)."""
    keys = RUN_KEYS if "run" in meta and "run" in expect else MATCH_KEYS  # older markers: fewer fields
    diff = [f"{k}={meta.get(k)!r} (this run {expect.get(k)!r})" for k in keys if meta.get(k) != expect.get(k)]
    if not diff and "run" in meta and "run" in expect and meta["run"] != expect["run"]:
        diff.append(f"run {meta['run']} (this run {expect['run']}: other model shape, schedule or shares)")
    return diff


def latest(root: str | os.PathLike, expect: dict, parts: list[str] | None = None) -> int:
    """The step to resume from: the newest complete, readable checkpoint of this run."""
    rootp = Path(root)
    if not rootp.is_dir():
        raise SmolError(f"--resume: no checkpoint directory {root}")
    remove_temp(rootp)
    found = _complete_steps(rootp)
    if not found:
        raise SmolError(f"--resume: no complete checkpoint in {root}")
    damage = []
    for step, d in found:
        marker = d / "complete.json"
        try:
            meta = json.loads(marker.read_text())
            if not isinstance(meta, dict) or int(meta["step"]) != step:
                raise ValueError
        except (ValueError, KeyError, TypeError, OSError):
            damage.append(f"checkpoint {marker}: corrupt")
            continue
        diff = _foreign(meta, expect)
        if diff:
            raise SmolError(
                f"checkpoint {d} belongs to another run ({'; '.join(diff[:3])}): "
                "resume with the same options or use a fresh --checkpoint-dir"
            )
        try:
            # parts on this machine must read back (other hosts keep theirs)
            for part in [p for p in parts or [] if (d / f"{p}.safetensors").exists()]:
                load_part(root, step, part)
        except SmolError as e:
            damage.append(str(e))
            continue
        return step
    raise SmolError(damage[0] + (f" (and {len(damage) - 1} older)" if len(damage) > 1 else ""))


def tensors_equal(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
