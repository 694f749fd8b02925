"""`--data` for a Hugging Face checkpoint: the user's text, chats or prompt/completion pairs as
examples of token ids with a loss mask, and the batches every rank draws from them.

- A text file or folder: each file is a document, tokenized with the checkpoint's own
  tokenizer.json and followed by EOS; the documents are joined and cut into windows of
  `seq + 1` tokens (stride `seq`, so every token is a target once).
- `.jsonl`: one object a line, `{"messages": [...]}` or `{"prompt", "completion"}`
  (finetune.examples says how each is rendered and masked). Every example must fit one row of
  `seq + 1` tokens and the model's context; a bad line is named by its number.

Batches depend only on the seed and the step (as models.data's byte windows do): step k takes
the examples at positions k*B .. k*B+B-1 of an endless sequence of epochs, each a permutation of
the training examples seeded by (seed, epoch). Rows are right-padded with EOS whose targets are
-100, so no attention mask is needed (attention is causal) and the loss is transformers' own:
cross-entropy over the targets that are not -100. The held-out examples (with --eval-every)
are the last sixteenth, never drawn for training.

The controller loads the data once and sends `Dataset.to_bytes()` to every rank (safetensors:
arrays and a JSON header, nothing executable), so hosts without the files train on the same tokens.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from smoltrain.finetune.examples import DataError, Tokenizing

HOLDOUT_FRACTION = 16
EVAL_BATCHES = 4
IGNORE = -100
SCHEMA = "smoltrain.finetune.data/1"


class Dataset:
    """Examples (token ids, loss mask), concatenated: example i is ids[offsets[i]:offsets[i+1]]."""

    def __init__(self, ids, mask, offsets, kind: str, pad: int, source: str = ""):
        self.ids, self.mask, self.offsets = ids, mask, offsets  # int32, uint8, int64 tensors
        self.kind, self.pad, self.source = kind, int(pad), source

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def example(self, i: int):
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.ids[a:b], self.mask[a:b]

    def to_bytes(self) -> bytes:
        from safetensors.torch import save

        meta = {"schema": SCHEMA, "kind": self.kind, "pad": str(self.pad)}
        return save({"ids": self.ids, "mask": self.mask, "offsets": self.offsets}, metadata=meta)

    @classmethod
    def from_bytes(cls, data: bytes) -> Dataset:
        from safetensors.torch import load

        try:
            t = load(data)
            n = int.from_bytes(data[:8], "little")
            meta = json.loads(data[8 : 8 + n]).get("__metadata__") or {}
        except Exception as e:
            raise DataError(f"training data that does not read: {e}") from None
        if meta.get("schema") != SCHEMA:
            raise DataError(f"training data of another format ({meta.get('schema')!r}, expected {SCHEMA})")
        return cls(t["ids"], t["mask"], t["offsets"], meta["kind"], int(meta["pad"]))

    def digest(self) -> str:
        """Of the content (the safetensors bytes order their header as they like): for the run's identity."""
        h = hashlib.sha256(f"{SCHEMA} {self.kind} {self.pad}".encode())
        for t in (self.ids, self.mask, self.offsets):
            h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()[:16]


def load(path: str, model_dir: str, seq: int, cap_bytes: int = 2 << 20) -> Dataset:
    """The examples of `--data path` for the checkpoint in `model_dir`, each at most seq + 1 tokens."""
    from smoltrain.models.hf import CheckpointError, load_tokenizer, read_config

    root = Path(path).expanduser()
    if not root.exists():
        raise DataError(f"--data {path}: no such file or folder")
    try:
        cfg = read_config(model_dir)
        tok = load_tokenizer(model_dir)
    except CheckpointError as e:
        raise DataError(str(e)) from None
    if tok is None:
        raise DataError(f"--model {model_dir} has no tokenizer.json: --data needs the checkpoint's own tokenizer")
    if seq > cfg.ctx:
        raise DataError(f"--seq {seq} exceeds the model's context of {cfg.ctx} tokens")
    t = Tokenizing(model_dir, tok, cfg.eos)
    if root.is_file() and root.suffix == ".jsonl":
        kinds, examples = _jsonl(root, t, seq, cfg.ctx)
        kind = "+".join(sorted(kinds))
    else:
        examples, kind = _text_windows(root, t, seq, cap_bytes), "text"
    if not examples:
        raise DataError(f"--data {path}: nothing to train on")
    import numpy as np
    import torch

    ids = np.concatenate([np.asarray(e, dtype=np.int64) for e, _ in examples])
    if int(ids.max()) >= cfg.vocab:
        raise DataError(f"the tokenizer gives id {int(ids.max())}, outside the model's vocabulary of {cfg.vocab}")
    mask = np.concatenate([np.asarray(m, dtype=np.uint8) for _, m in examples])
    lengths = torch.tensor([0] + [len(e) for e, _ in examples], dtype=torch.int64)
    pad = t.eos if t.eos is not None else 0
    return Dataset(
        torch.from_numpy(ids.astype(np.int32)), torch.from_numpy(mask), lengths.cumsum(0), kind, pad, str(root)
    )


def _text_windows(root: Path, t: Tokenizing, seq: int, cap_bytes: int) -> list:
    """Documents joined with EOS, cut into windows of seq + 1 tokens at a stride of seq."""
    from smoltrain.models.data import TEXT_SUFFIXES, _files

    docs, size = [], 0
    for f in [root] if root.is_file() else _files(root, TEXT_SUFFIXES):
        try:
            b = f.read_bytes()
        except OSError:
            continue
        b = b[: cap_bytes - size]  # the cap cuts the last document (a cut character decodes as U+FFFD)
        docs.append(b.decode("utf-8", errors="replace"))
        size += len(b)
        if size >= cap_bytes:
            break
    import numpy as np

    texts = t.texts(docs)
    if not texts:
        return []
    stream = np.concatenate([np.asarray(d, dtype=np.int64) for d in texts])
    windows = [stream[a : a + seq + 1] for a in range(0, len(stream) - 1, seq)]
    return [(w, np.ones(len(w), dtype=np.uint8)) for w in windows]


def _jsonl(path: Path, t: Tokenizing, seq: int, ctx: int):
    from smoltrain.infer.chat import ChatError

    kinds, out = set(), []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"--data {path} line {n}"
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise DataError(f"{where}: not JSON ({e})") from None
            try:
                kind, (ids, mask) = _example(obj, t)
            except (ChatError, DataError) as e:
                raise DataError(f"{where}: {e}") from None
            if len(ids) > ctx:
                raise DataError(f"{where}: {len(ids)} tokens, longer than the model's context of {ctx}")
            if len(ids) > seq + 1:
                raise DataError(f"{where}: {len(ids)} tokens, more than --seq {seq} + 1 (raise --seq, up to {ctx})")
            if not any(mask[1:]):
                raise DataError(f"{where}: no tokens to learn from (no assistant turn or completion)")
            kinds.add(kind)
            out.append((ids, mask))
    return kinds, out


def _messages(v, what: str) -> list:
    if not isinstance(v, list) or not v:
        raise DataError(f"{what} is not a non-empty list of messages")
    for m in v:
        ok = isinstance(m, dict) and isinstance(m.get("role"), str)
        c = m.get("content") if ok else None
        if not ok or not (c is None or isinstance(c, (str, list))):
            raise DataError(f'{what} holds {json.dumps(m)[:60]}, not a message {{"role", "content"}}')
    return v


def _example(obj, t: Tokenizing):
    if isinstance(obj, dict) and "messages" in obj:
        return "chat", t.chat_example(_messages(obj["messages"], '"messages"'))
    if isinstance(obj, dict) and "prompt" in obj and "completion" in obj:
        p, c = obj["prompt"], obj["completion"]
        if isinstance(p, str) and isinstance(c, str):
            return "pairs", t.pair_example(p, c)
        return "pairs", t.pair_example(_messages(p, '"prompt"'), _messages(c, '"completion"'))
    raise DataError('not a chat ({"messages": [...]}) nor a {"prompt", "completion"} pair')


class Batches:
    """Global batches of examples, a pure function of (seed, step); x, y LongTensor [batch, seq]."""

    def __init__(self, ds: Dataset, batch: int, seq: int, seed: int, holdout: bool = False):
        n = len(ds)
        self.held = max(1, n // HOLDOUT_FRACTION) if holdout else 0
        if n - self.held < 1:
            raise DataError(f"--data has {n} example(s): too few to hold one out for --eval-every")
        self.ds, self.batch, self.seq, self.seed = ds, batch, seq, seed
        self.n_train = n - self.held
        self._perms: dict = {}
        self._last: tuple | None = None

    def _index(self, p: int) -> int:
        import torch

        epoch, i = divmod(p, self.n_train)
        if epoch not in self._perms:
            if len(self._perms) > 2:
                self._perms.pop(min(self._perms))
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(self.n_train, generator=gen)
        return int(self._perms[epoch][i])

    def rows(self, indices: list[int]):
        """x, y of these examples: targets are the next tokens where the mask is 1, else -100."""
        import torch

        x = torch.full((len(indices), self.seq), self.ds.pad, dtype=torch.long)
        y = torch.full((len(indices), self.seq), IGNORE, dtype=torch.long)
        for r, i in enumerate(indices):
            ids, mask = self.ds.example(i)
            ids, n = ids.long(), len(ids) - 1
            x[r, :n] = ids[:-1]
            y[r, :n] = torch.where(mask[1:].bool(), ids[1:], IGNORE)
        return x, y

    def global_batch(self, step: int):
        if self._last is None or self._last[0] != step:
            self._last = (step, self.rows([self._index(step * self.batch + j) for j in range(self.batch)]))
        return self._last[1]

    def slice(self, step: int, lo: int, hi: int):
        """Sequences [lo, hi) of step's global batch."""
        x, y = self.global_batch(step)
        return x[lo:hi], y[lo:hi]

    def loss_tokens(self, step: int) -> int:
        """Targets that carry loss in step's global batch (the divisor of its mean loss)."""
        return int((self.global_batch(step)[1] != IGNORE).sum())

    def eval_batches(self):
        """The held-out examples as up to EVAL_BATCHES global batches, always the same."""
        if not self.held:
            raise DataError("no held-out examples: build Batches with holdout=True")
        k = min(EVAL_BATCHES, -(-self.held // self.batch))
        return [
            self.rows([self.n_train + (b * self.batch + j) % self.held for j in range(self.batch)]) for b in range(k)
        ]
