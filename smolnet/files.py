"""Writing files so that a reader never sees half of one (temp file + rename)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def create_new(path: str | os.PathLike, mode: int = 0o644) -> int:
    """A write descriptor of a file created by this call (O_EXCL, O_NOFOLLOW): a name planted first
    (a link to elsewhere, in a folder others can write, a shared NFS checkpoint folder) is removed,
    never written through."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)


def write_text_atomic(path: str | os.PathLike, text: str, mode: int = 0o644) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str | os.PathLike, doc, indent: int = 2) -> None:
    write_text_atomic(path, json.dumps(doc, indent=indent) + "\n")


def save_figure_atomic(fig, path: str | os.PathLike, dpi: int = 110) -> None:
    """Save a matplotlib figure via a temp file, and always close it."""
    import matplotlib.pyplot as plt

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=dpi)
        os.replace(tmp, p)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_json(path: str | os.PathLike, what: str, missing_hint: str = "", schema: str | None = None):
    """Parse a JSON document; a missing or unreadable file is one clear line (UsageError).

    With `schema` (e.g. "smolnet.links/1"), the document must also pass that JSON Schema.
    """
    from smolnet.errors import UsageError

    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise UsageError(f"{p}: no such {what}{missing_hint}") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"{p}: cannot read {what}: {e}") from None
    if schema is not None:
        from smolnet.schema import check

        check(doc, schema, str(p))
    return doc
