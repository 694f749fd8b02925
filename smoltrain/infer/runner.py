"""What `generate` and `serve` drive: a model that takes requests and calls back with tokens.

A Runner takes requests at any time (`submit`), calls `on_token(id)` for each new token
and `on_done(reason, stats, error)` once at the end; `cancel` ends a request early. The
one-process reference (`LocalRunner`, launch.py) batches in a thread of its own; a
Cluster of ranks (cluster.py) batches on its rank 0. Either way, a failure of the model ends
every open request with the one-line reason, and every later submit raises RankDied; a failure
of one request (its ids cannot be sent, the engine refused its step) ends that request alone:
RequestFailed at submit, or `on_done("error", stats, why)`.
"""

from __future__ import annotations

import sys
import threading
from array import array
from dataclasses import replace

from smolnet.errors import SmolError

MAX_IDS = 1 << 22  # token ids one control frame may carry (16 MiB): far past any context


class RankDied(SmolError):
    """A rank exited, failed or went silent; the model cannot serve until restarted."""


class RequestFailed(SmolError):
    """One request cannot run (its ids cannot be packed, the engine failed its step); the model serves on."""


def pack_ids(ids) -> bytes:
    """Token ids as a frame's payload (int32, little-endian): never in its JSON header, whose
    64 KiB bound a long prompt would pass. An id outside int32 or too many is this request's error."""
    if len(ids) > MAX_IDS:
        raise RequestFailed(f"{len(ids)} token ids exceed the {MAX_IDS} one frame carries")
    try:
        a = array("i", ids)
    except (OverflowError, TypeError) as e:
        raise RequestFailed(f"token ids must be 32-bit integers ({e})") from None
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def unpack_ids(payload: bytes) -> list[int]:
    if len(payload) % 4:
        raise ValueError(f"a token id payload of {len(payload)} bytes is not whole int32s")
    a = array("i")
    a.frombytes(payload)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


class Runner:
    def __init__(self):
        self.lock = threading.Lock()
        self.admitting = threading.Lock()
        self.handles: dict[int, tuple] = {}
        self.next_rid = 1
        self.dead: str | None = None

    @property
    def load(self) -> int:
        """Requests submitted and not yet done."""
        return len(self.handles)

    def submit(self, req, on_token, on_done) -> int:
        with self.admitting:  # every rank sees the requests in the order of their ids
            with self.lock:
                if self.dead:
                    raise RankDied(self.dead)
                rid = self.next_rid
                self.next_rid += 1
                self.handles[rid] = (on_token, on_done)
            try:
                self._admit(replace(req, rid=rid))
            except RequestFailed:  # nothing reached a rank: this request alone fails
                with self.lock:
                    self.handles.pop(rid, None)
                raise
        return rid

    def _tokens(self, items) -> None:
        for rid, tok in items:
            h = self.handles.get(int(rid))
            if h is not None:
                h[0](int(tok))

    def _done(self, rid: int, reason: str, stats: dict) -> None:
        """A request ended; reason `error`: it failed alone (stats["error"] says why)."""
        with self.lock:
            h = self.handles.pop(int(rid), None)
        if h is not None:
            h[1](reason, stats, (stats.get("error") or "the request failed") if reason == "error" else None)

    def _fail(self, why: str) -> None:
        with self.lock:
            self.dead = self.dead or why
            handles, self.handles = self.handles, {}
        for _, on_done in handles.values():
            on_done(None, None, self.dead)

    def generate(self, req, on_token=lambda t: None) -> list[dict]:
        """One request, start to end, then every rank's counters for it: the stats `generate`
        reports (taken before and after, so a warm-up or an earlier request is not counted)."""
        ended, box = threading.Event(), {}

        def on_done(reason, stats, error):
            box.update(reason=reason, stats=stats, error=error)
            ended.set()

        before = self.stats()
        self.submit(req, on_token, on_done)
        ended.wait()
        if box["error"]:
            raise (RequestFailed if box["reason"] == "error" else RankDied)(box["error"])
        out = []
        for r, (st, b) in enumerate(zip(self.stats(), before)):
            c, c0 = st["stats"], b["stats"]
            sent0 = {int(p): n for p, n in b["links"]}
            links = [(p, n - sent0.get(int(p), 0)) for p, n in st["links"]]
            d = {"rank": r, "links": links, **(st.get("machine") or {})}  # threads, device, weight bytes
            d.update({k: c.get(k, 0) - c0.get(k, 0) for k in COUNTED})
            if r == 0:
                d.update(box["stats"])
            out.append(d)
        return out

    def warm_up(self, ctx: int) -> None:
        """One short request at load, as llama.cpp does: the first pass over a split pays allocation,
        operator dispatch and fresh TCP windows that no later token pays (on the capped sim a first
        request decoded at half the pace of the next)."""
        half = max(1, ctx // 2)
        self.generate(_warm_request(min(4, half), min(16, half)))

    # what each runner provides
    def _admit(self, req) -> None:
        raise NotImplementedError

    def cancel(self, rid: int) -> None:
        raise NotImplementedError

    def stats(self) -> list[dict]:
        """Per rank: {"stats": the engine's counters, "links": [(peer, bytes sent)], "machine": host facts}."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def health(self) -> None:
        """Raise RankDied (and fail every open request) when the model can no longer serve."""


COUNTED = (
    "decode_bytes",
    "prefill_bytes",
    "decode_cpu_s",
    "decode_wall_s",
    "decode_comm_cpu_s",
    "decode_comm_wall_s",
    "decode_comm_calls",
    "decode_wait_s",
)


def _warm_request(prompt: int, new: int):
    from smoltrain.infer.batching import Request

    return Request([0] * prompt, new, 0.0, 1.0, 0, [])
