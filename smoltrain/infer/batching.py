"""Continuous batching: which requests run together at each step, decided on rank 0.

Requests wait in arrival order for a free slot (one KV cache per slot on every rank, at
most `max_batch`). A new request's prompt runs alone (prefill), its first token comes
back, and from the next step on it decodes together with every other active request:
one forward over all of them. A request leaves the batch as soon as it is finished
(token budget, end of sequence, cancelled); its slot takes the next waiting request.

Active requests are dealt into `lanes` (pp: one per stage), each a batch of its own, so
several batches can be in the pipeline at once and every stage has work; a lane has at
most one step in flight. Rank 0 tells the other ranks what each step is with a 4-number
header (HEADER_BYTES on the wire, counted in the plan): kind, the slots as a bit mask
(rows in ascending slot order), the prompt length of a prefill, and its request id.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

DECODE, PREFILL, IDLE, QUIT = 0, 1, 2, 3


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: list[int] = field(default_factory=list)
    rid: int = 0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


HEADER_FIELDS = 4  # int64: kind, slot mask, prompt tokens (prefill), request id (prefill)
HEADER_BYTES = 8 * HEADER_FIELDS
MAX_SLOTS = 62  # the slot mask is one int64


def slots_of(mask: int) -> list[int]:
    return [s for s in range(MAX_SLOTS) if mask >> s & 1]


def mask_of(slots) -> int:
    return sum(1 << s for s in slots)


@dataclass
class Item:
    """One step rank 0 issues: a prompt's prefill, or one decode step of a lane's requests."""

    kind: int
    slots: list[int]
    ids: list[list[int]]  # the first stage's input per row: the prompt, or the last token
    lane: int | None = None
    rid: int = 0
    req: object = None  # a prefill's request (rank 0 only; the others get it from the controller)

    def header(self) -> list[int]:
        return [self.kind, mask_of(self.slots), len(self.ids[0]) if self.kind == PREFILL else 0, self.rid]


@dataclass
class Live:
    """A request in a slot."""

    req: object
    slot: int
    t_admit: float
    t_start: float = 0.0
    t_first: float = 0.0
    lane: int | None = None
    out: list[int] = field(default_factory=list)
    steps: int = 0
    cancelled: bool = False


class Batcher:
    """Rank 0's scheduler. submit/cancel/stop come from other threads; the step loop (`lead`)
    calls next_item and finish. on_tokens([(rid, token), ...]) once per step;
    on_done(rid, reason, stats) once per request, reason `length`, `stop` or `cancelled`."""

    def __init__(self, max_batch: int, lanes: int, on_tokens, on_done):
        if not 1 <= max_batch <= MAX_SLOTS:
            raise ValueError(f"max_batch must be 1..{MAX_SLOTS}")
        self.max_batch, self.on_tokens, self.on_done = max_batch, on_tokens, on_done
        self.cv = threading.Condition()
        self.waiting: deque = deque()  # (req, t_admit)
        self.free = list(range(max_batch))
        self.live: dict[int, Live] = {}  # slot -> request
        self.lanes: list[list[int]] = [[] for _ in range(max(1, lanes))]
        self.in_flight: set[int] = set()  # lanes with a step in the pipeline
        self.prefilling: set[int] = set()  # slots whose prefill is in the pipeline
        self.cancels: set[int] = set()
        self.turn = 0
        self.stopped = False

    # --- from other threads ---
    def submit(self, req) -> None:
        with self.cv:
            self.waiting.append((req, time.perf_counter()))
            self.cv.notify_all()

    def cancel(self, rid: int) -> None:
        with self.cv:
            self.cancels.add(rid)
            self.cv.notify_all()

    def stop(self) -> None:
        with self.cv:
            self.stopped = True
            self.cv.notify_all()

    def wait(self, timeout: float) -> bool:
        """Block until there may be something to issue; False on timeout (the loop is idle)."""
        with self.cv:
            return self.cv.wait_for(lambda: self.stopped or self.cancels or self.waiting, timeout)

    @property
    def active(self) -> int:
        return len(self.live)

    # --- the step loop ---
    def _apply_cancels(self) -> None:
        with self.cv:
            cancels, self.cancels = self.cancels, set()
            if self.stopped:  # closing: every request ends now
                cancels |= {lv.req.rid for lv in self.live.values()} | {req.rid for req, _ in self.waiting}
            kept = deque()
            for req, t in self.waiting:
                if req.rid in cancels:
                    self.on_done(req.rid, "cancelled", self._stats(Live(req, -1, t)))
                else:
                    kept.append((req, t))
            self.waiting = kept
        for lv in self.live.values():
            if lv.req.rid in cancels:
                lv.cancelled = True
        for lv in list(self.live.values()):
            if lv.cancelled and lv.slot not in self.prefilling and lv.lane not in self.in_flight:
                self._leave(lv, "cancelled")

    def next_item(self) -> Item | None:
        """The next step to issue: a waiting prompt when a slot is free, else the next lane's
        decode step; None when nothing can go now."""
        self._apply_cancels()
        with self.cv:
            nxt = self.waiting.popleft() if self.waiting and self.free and not self.stopped else None
        if nxt is not None:
            req, t = nxt
            slot = self.free.pop(0)
            self.live[slot] = Live(req, slot, t, t_start=time.perf_counter())
            self.prefilling.add(slot)
            return Item(PREFILL, [slot], [list(req.prompt_ids)], rid=req.rid, req=req)
        for k in range(len(self.lanes)):
            lane = (self.turn + k) % len(self.lanes)
            if self.lanes[lane] and lane not in self.in_flight:
                self.turn = lane + 1
                self.in_flight.add(lane)
                slots = sorted(self.lanes[lane])
                for s in slots:
                    self.live[s].steps += 1
                return Item(DECODE, slots, [[self.live[s].out[-1]] for s in slots], lane=lane)
        return None

    def finish(self, item: Item, toks: list[int]) -> None:
        """The step's sampled tokens came back: emit them, let finished requests leave."""
        if item.kind == PREFILL:
            self.prefilling.discard(item.slots[0])
            self.live[item.slots[0]].t_first = time.perf_counter()
        else:
            self.in_flight.discard(item.lane)
        emitted, done = [], []
        for s, tok in zip(item.slots, toks):
            lv = self.live[s]
            if lv.cancelled:
                done.append((lv, "cancelled"))
                continue
            lv.out.append(int(tok))
            emitted.append((lv.req.rid, int(tok)))
            if len(lv.out) >= lv.req.max_new_tokens:
                done.append((lv, "length"))
            elif tok in lv.req.stop_ids:
                done.append((lv, "stop"))
            elif item.kind == PREFILL:  # joins the emptiest lane at its next step
                lv.lane = min(range(len(self.lanes)), key=lambda i: (len(self.lanes[i]), i))
                self.lanes[lv.lane].append(s)
        if emitted:
            self.on_tokens(emitted)
        for lv, reason in done:
            self._leave(lv, reason)

    def fail(self, item: Item, why: str) -> None:
        """The engine could not run this step: its requests end with reason `error`, the rest go on."""
        if item.kind == PREFILL:
            self.prefilling.discard(item.slots[0])
        else:
            self.in_flight.discard(item.lane)
        for s in item.slots:
            self._leave(self.live[s], "error", why)

    def _leave(self, lv: Live, reason: str, error: str | None = None) -> None:
        if lv.lane is not None:
            self.lanes[lv.lane].remove(lv.slot)
        del self.live[lv.slot]
        self.free.append(lv.slot)
        self.free.sort()
        self.on_done(lv.req.rid, reason, dict(self._stats(lv), error=error) if error else self._stats(lv))

    @staticmethod
    def _stats(lv: Live) -> dict:
        now = time.perf_counter()
        first = lv.t_first or now
        return {
            "output_ids": list(lv.out),
            "prefill_tokens": len(lv.req.prompt_ids),
            "queue_s": (lv.t_start or now) - lv.t_admit,
            "prefill_s": first - (lv.t_start or now),
            "decode_steps": lv.steps,
            "decode_s": now - first,
        }


def lead(engine, batcher: Batcher, keepalive_s: float = 10.0) -> None:
    """Rank 0's step loop: keep up to engine.depth steps in flight, take their tokens back in
    order, and when idle tell the other ranks so every `keepalive_s` (they wait on the wire).
    A one-process engine (world 1) that raises on a step fails that step's requests alone: no
    other rank has seen the step, so nothing is out of step; across ranks it ends the model."""
    inflight: deque = deque()
    while True:
        item = batcher.next_item() if len(inflight) < engine.depth else None
        if item is not None:
            try:
                engine.issue(item)
            except Exception as e:
                if getattr(engine, "world", 1) != 1:
                    raise
                batcher.fail(item, f"the model failed this request: {type(e).__name__}: {e}")
                continue
            inflight.append(item)
        elif inflight:
            done = inflight.popleft()
            batcher.finish(done, engine.collect(done))
        elif batcher.stopped:
            break
        elif not batcher.wait(keepalive_s) and not batcher.live:
            engine.keepalive()
    engine.quit()


class Admissions:
    """Requests as the controller sent them, on ranks other than 0, until a prefill header names them.
    Rank 0 admits in arrival order, so a prefill of request r means every earlier one is over."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.cv = threading.Condition()
        self.reqs: dict[int, object] = {}

    def put(self, req) -> None:
        with self.cv:
            self.reqs[req.rid] = req
            self.cv.notify_all()

    def take(self, rid: int):
        with self.cv:
            if not self.cv.wait_for(lambda: rid in self.reqs, self.timeout):
                raise TimeoutError(f"rank 0 started request {rid}, which never reached this rank")
            for r in [r for r in self.reqs if r < rid]:
                del self.reqs[r]
            return self.reqs.pop(rid)
