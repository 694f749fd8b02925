"""Checkpoints: state dicts only, in safetensors files, written atomically.

Layout: `DIR/step-000005/` holds one `<part>.safetensors` per rank that owns
state (`rank0`, `rank1`, ... or `server` for the parameter-server strategies)
and, once every part is on disk, `complete.json` written by the controller
({strategy, world_size, step, model, seed, batch, seq}). `--resume` takes the
newest complete directory and continues at its step; since batches are a
function of (seed, step), that continues exactly.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from smolnet.errors import SmolError

MATCH_KEYS = ("strategy", "world_size", "model", "seed", "batch", "seq")


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def save_part(root: str | os.PathLike, step: int, part: str, tensors: dict) -> Path:
    from safetensors.torch import save_file

    d = step_dir(root, step)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{part}.safetensors"
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save_file({k: v.detach().contiguous().cpu().clone() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)
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
    return {"strategy": cfg.strategy, "world_size": cfg.world_size, "model": cfg.model.name, "seed": cfg.seed,
            "batch": cfg.batch, "seq": cfg.seq}


def mark_complete(root: str | os.PathLike, step: int, meta: dict) -> None:
    path = step_dir(root, step) / "complete.json"
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(dict(meta, step=step), indent=1))
    os.replace(tmp, path)


def latest(root: str | os.PathLike, expect: dict, parts: list[str] | None = None) -> int:
    """The step to resume from: newest complete checkpoint, checked against this run."""
    rootp = Path(root)
    if not rootp.is_dir():
        raise SmolError(f"--resume: no checkpoint directory {root}")
    found = []
    for d in rootp.glob("step-*"):
        marker = d / "complete.json"
        if marker.exists():
            try:
                meta = json.loads(marker.read_text())
                found.append((int(meta["step"]), meta, d))
            except (ValueError, KeyError, TypeError):
                raise SmolError(f"checkpoint {marker}: corrupt") from None
    if not found:
        raise SmolError(f"--resume: no complete checkpoint in {root}")
    step, meta, d = max(found, key=lambda f: f[0])
    for k in MATCH_KEYS:
        if meta.get(k) != expect.get(k):
            raise SmolError(f"checkpoint {d}: was made with {k}={meta.get(k)!r}, this run has {expect.get(k)!r}")
    for part in parts or []:  # parts on this machine: check they read back
        p = d / f"{part}.safetensors"
        if p.exists():
            load_part(root, step, part)
    return step


def tensors_equal(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
