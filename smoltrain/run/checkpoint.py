"""Checkpoints: state dicts only, in safetensors files, written atomically and durably.

Layout: `DIR/step-000005/` holds one `<part>.safetensors` per rank that owns
state (`rank0`, `rank1`, ... or `server` for the parameter-server strategies)
and, once every part is on disk, `complete.json` written by the controller: the run's
identity (`run`, a digest of everything that determines the trajectory: model shape, data,
seed, lr, strategy, batch, seq, world, schedule, shares), its readable fields, and `parts`:
the sha256 and size of every part, as the rank that wrote it computed them.

`--resume` takes the newest checkpoint whose marker reads and whose every part matches its
digest (a flipped bit, a torn or missing part, an empty marker: skipped, and said so), refuses
one made by another run (a folder reused with another lr must not silently continue the older
run), and each rank checks its part against the digest again as it loads it (parts on other
hosts are seen only there). Parts, marker and folder are fsynced before the marker counts;
temp files of a crash are removed; only the newest `keep` complete steps are kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from smolnet.errors import SmolError
from smolnet.files import create_new

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


def plain_part(part) -> bool:
    """A part name that stays inside its step folder (complete.json is read from disk: a name
    like `../../x` or `/etc/x` must never become a path)."""
    return isinstance(part, str) and re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", part) is not None


def part_path(root: str | os.PathLike, step: int, part: str) -> Path:
    if not plain_part(part):
        raise SmolError(f"checkpoint part name {str(part)[:80]!r} is not a plain file name")
    return step_dir(root, step) / f"{part}.safetensors"


def save_part(root: str | os.PathLike, step: int, part: str, tensors: dict) -> dict:
    """Write one part durably; returns its `{"sha256", "bytes"}` for the step's complete.json."""
    from safetensors.torch import save

    d = step_dir(root, step)
    new = not d.exists()
    d.mkdir(parents=True, exist_ok=True)
    if new:
        _fsync_path(d.parent, directory=True)
    data = save({k: v.detach().contiguous().cpu().clone() for k, v in tensors.items()})
    path = part_path(root, step, part)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        with open(create_new(tmp), "wb") as f:  # never through a link planted at the temp name
            f.write(data)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _durable_replace(tmp, path)
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def load_part(root: str | os.PathLike, step: int, part: str, sha256: str | None = None) -> dict:
    """The part's tensors; with `sha256` (from complete.json) only if the file still matches it."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    path = part_path(root, step, part)
    try:
        data = path.read_bytes()
    except OSError as e:
        why = "missing" if isinstance(e, FileNotFoundError) else f"unreadable ({e.strerror or e})"
        raise SmolError(f"checkpoint {path}: {why}") from None
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise SmolError(f"checkpoint {path}: damaged (sha256 differs from complete.json)")
    try:
        return load(data)
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
    lora = getattr(cfg, "lora", None)
    if lora:
        trajectory["lora"] = lora
    if getattr(cfg, "quantize", None):  # the base the adapters train on
        trajectory["quantize"] = cfg.quantize
    mesh = getattr(cfg, "mesh", None)  # a 2-D mesh: its strategy and world alone do not say how ranks hold the model
    if mesh:
        trajectory["mesh"] = mesh
    run = hashlib.sha256(json.dumps(trajectory, sort_keys=True).encode()).hexdigest()[:16]
    extra = {"model_spec": cfg.model.to_dict(), "lora": lora} if cfg.model.source else {}  # export rebuilds it
    if mesh:
        extra["mesh"] = mesh  # export refuses a mesh's parts
    return {
        **extra,
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


def mark_complete(root: str | os.PathLike, step: int, meta: dict, parts: dict[str, dict]) -> None:
    """Written last, once every part is on disk: the identity and each part's sha256 and size."""
    path = step_dir(root, step) / "complete.json"
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    doc = dict(meta, step=step, parts={p: dict(parts[p]) for p in sorted(parts)})
    with open(create_new(tmp), "w") as f:
        f.write(json.dumps(doc, indent=1))
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


@dataclass
class Resume:
    """Where `--resume` starts: the step, the newer checkpoints skipped (`{step, why}`), and each
    part's sha256 from the marker (empty for markers written before parts carried digests)."""

    step: int
    skipped: list[dict] = field(default_factory=list)
    sha256: dict[str, str] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def skipped_line(self) -> str:
        """One line naming what was skipped and why ('' when nothing was)."""
        if not self.skipped:
            return ""
        what = "; ".join(f"step-{s['step']:06d} ({s['why']})" for s in self.skipped)
        return f"resume: skipped {what}; resuming from step {self.step}"


def _read_marker(d: Path, step: int) -> dict:
    marker = d / "complete.json"
    try:
        text = marker.read_text()
    except OSError as e:
        raise ValueError(f"complete.json is unreadable: {e.strerror or e}") from None
    if not text.strip():
        raise ValueError("complete.json is empty")
    try:
        meta = json.loads(text)
    except ValueError:
        raise ValueError("complete.json is not valid JSON") from None
    if not isinstance(meta, dict) or meta.get("step") != step:
        raise ValueError("complete.json does not describe this step")
    parts = meta.get("parts")
    if parts is not None and not (
        isinstance(parts, dict)
        and all(
            isinstance(v, dict) and isinstance(v.get("sha256"), str) and isinstance(v.get("bytes"), int)
            for v in parts.values()
        )
    ):
        raise ValueError("complete.json has malformed part digests")
    bad = next((p for p in parts or () if not plain_part(p)), None)
    if bad is not None:
        raise ValueError(f"complete.json names a part {bad[:80]!r} that is not a plain file name")
    return meta


def verify(d: Path, meta: dict, parts: list[str], all_here: bool = True) -> str | None:
    """Why the checkpoint in folder d cannot be loaded, or None: every part of `parts` present
    (or, with all_here False, those present on this machine) matches the marker's digest."""
    digests = meta.get("parts")
    for part in parts:
        path = d / f"{part}.safetensors"
        name = path.name
        if digests is not None and part not in digests:
            return f"complete.json lists no digest for {name}"
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            if all_here:
                return f"{name} is missing"
            continue  # on another host: its rank checks it against the digest
        if digests is None:  # a marker from before digests: the part must at least read back
            try:
                load_part(d.parent, meta["step"], part)
            except SmolError:
                return f"{name} is corrupt: it does not read back"
            continue
        want = digests[part]
        if size != want["bytes"]:
            how = "truncated" if size < want["bytes"] else "longer than written"
            return f"{name} is {how}: {size} of {want['bytes']} bytes"
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        if h.hexdigest() != want["sha256"]:
            return f"{name} is damaged: its sha256 differs from complete.json"
    return None


def latest(
    root: str | os.PathLike,
    expect: dict | None,
    parts: list[str] | None = None,
    all_here: bool = True,
    tidy: bool = True,
) -> Resume:
    """The newest checkpoint of this run that verifies, and what was skipped on the way.

    expect: this run's identity (None: take whatever run wrote it, as export does); parts: the
    parts a checkpoint must hold (None: those its marker lists); all_here: every part is on this
    machine (a --local run or a shared folder), so a missing one is damage; tidy: delete what a
    crash left half-written (a resume does; export, which may run beside a live run, does not)."""
    rootp = Path(root)
    if not rootp.is_dir():
        raise SmolError(f"no checkpoint directory {root}")
    if tidy:
        remove_temp(rootp)
    found = _complete_steps(rootp)
    if not found:
        raise SmolError(f"no complete checkpoint in {root}")
    skipped = []
    for step, d in found:
        try:
            meta = _read_marker(d, step)
        except ValueError as e:
            skipped.append({"step": step, "why": str(e)})
            continue
        diff = _foreign(meta, expect) if expect is not None else []
        if diff:
            raise SmolError(
                f"checkpoint {d} belongs to another run ({'; '.join(diff[:3])}): "
                "resume with the same options or use a fresh --checkpoint-dir"
            )
        want = parts if parts is not None else sorted(meta.get("parts") or (p.stem for p in d.glob("*.safetensors")))
        why = verify(d, meta, list(want), all_here)
        if why is not None:
            skipped.append({"step": step, "why": why})
            continue
        sha = {p: v["sha256"] for p, v in (meta.get("parts") or {}).items()}
        return Resume(step, skipped, sha, meta)
    what = "; ".join(f"step-{s['step']:06d}: {s['why']}" for s in skipped)
    raise SmolError(f"no intact checkpoint in {root}: {what}")


def tensors_equal(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
