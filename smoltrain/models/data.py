"""Byte-level training data: nothing to download, nothing to tokenize.

The default corpus is the Python standard library's own `.py` sources on the
controller (sorted paths, capped in size); `--data` takes any text file or folder
instead. The controller reads it once and hands the bytes to every worker with
its configuration, so hosts with different Pythons still train on the same data.

Batches depend on the seed and the step only: step k draws the same B windows of
T+1 bytes for any world size, and each rank takes its slice of them. That is what
lets every synchronous strategy reproduce the `--local 1` loss curve, and what
lets `--resume` continue exactly without saving a data-loader state.

With `--eval-every` the last sixteenth of the corpus is held out: no training batch
draws from it, and the held-out loss is measured on a fixed set of windows there
(the same windows at every evaluation and for every strategy, so curves compare at
equal tokens).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

from smolnet.errors import UsageError

DEFAULT_CAP_BYTES = 2 << 20
TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".c", ".h", ".json", ".yml", ".yaml", ".toml", ".cfg", ".sh"}


def _files(root: Path, suffixes: set[str]):
    """Files under root in a fixed order (sorted, depth first), lazily: we stop at the cap."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("__pycache__", "site-packages", "dist-packages"))
        for f in sorted(filenames):
            if os.path.splitext(f)[1] in suffixes:
                yield Path(dirpath) / f


def load_corpus(path: str | None = None, cap_bytes: int = DEFAULT_CAP_BYTES) -> bytes:
    """The training bytes: a file, a folder of text files, or the stdlib sources."""
    if path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = _files(root, {".py"})
    else:
        root = Path(path).expanduser()
        if not root.exists():
            raise UsageError(f"--data {path}: no such file or folder")
        files = iter([root]) if root.is_file() else _files(root, TEXT_SUFFIXES)
    chunks, size = [], 0
    for f in files:
        try:
            b = f.read_bytes()
        except OSError:
            continue
        chunks.append(b)
        size += len(b)
        if size >= cap_bytes:
            break
    data = b"".join(chunks)[:cap_bytes]
    if len(data) < 2:
        raise UsageError(f"--data {path or root}: no text to train on")
    return data


def corpus_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


HOLDOUT_FRACTION = 16  # with --eval-every, the last 1/16 of the corpus is never trained on
EVAL_BATCHES = 4  # held-out windows: this many global batches' worth


def holdout_start(n: int, seq: int) -> int:
    """Where the held-out bytes begin: the last 1/16, at least two windows, never all of it."""
    start = n - max(n // HOLDOUT_FRACTION, 2 * (seq + 1))
    if start < seq + 2:
        raise UsageError(f"corpus has {n} bytes: too few to hold out a slice for --eval-every at --seq {seq}")
    return start


def make_batches(cfg, corpus: bytes):
    """A rank's batches from the controller's payload, checked against the run's digest: byte
    windows for the built-in models; for a Hugging Face checkpoint, the examples (token ids and
    loss masks) of finetune.data."""
    if cfg.model.source:
        from smoltrain.finetune import data

        ds = data.Dataset.from_bytes(corpus)
        digest, batches = ds.digest(), data.Batches(ds, cfg.batch, cfg.seq, cfg.seed, cfg.eval_every > 0)
    else:
        digest, batches = corpus_digest(corpus), Batches(corpus, cfg.batch, cfg.seq, cfg.seed, cfg.eval_every > 0)
    if digest != cfg.data_digest:
        raise ValueError("the corpus received from the controller does not match its digest")
    return batches


class Batches:
    """Global batches of byte windows, a pure function of (seed, step).

    Every target carries loss (finetune.data's batches mask some with -100); `loss_tokens(step)`
    is how many do, the denominator of the step's mean loss."""

    def __init__(self, data: bytes, batch: int, seq: int, seed: int, holdout: bool = False):
        if len(data) <= seq + 1:
            raise UsageError(f"corpus has {len(data)} bytes, fewer than --seq {seq} + 1")
        import torch

        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.batch, self.seq, self.seed = batch, seq, seed
        self.train_end = holdout_start(len(data), seq) if holdout else len(self.tokens)

    def _windows(self, seed: int, lo: int, hi: int):
        import torch

        gen = torch.Generator().manual_seed(seed)
        starts = lo + torch.randint(0, hi - lo - self.seq - 1, (self.batch,), generator=gen)
        win = torch.stack([self.tokens[s : s + self.seq + 1] for s in starts.tolist()])
        return win[:, :-1], win[:, 1:]

    def global_batch(self, step: int):
        return self._windows(self.seed * 1_000_003 + step, 0, self.train_end)

    def eval_batches(self):
        """The held-out windows (EVAL_BATCHES global batches from the held-out slice), always the same."""
        if self.train_end >= len(self.tokens):
            raise ValueError("no held-out slice: build Batches with holdout=True")
        return [
            self._windows(self.seed * 1_000_003 - 1 - i, self.train_end, len(self.tokens)) for i in range(EVAL_BATCHES)
        ]

    def loss_tokens(self, step: int) -> int:
        """Targets of step's global batch that carry loss: all of them."""
        return self.batch * self.seq

    def slice(self, step: int, lo: int, hi: int):
        """Sequences [lo, hi) of step's global batch."""
        x, y = self.global_batch(step)
        return x[lo:hi], y[lo:hi]
