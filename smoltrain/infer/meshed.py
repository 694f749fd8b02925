"""Decode on a pp x tp mesh (`--mesh pp=P,tp=T`): pipeline stages whose layers are tensor-split.

The ranks sit on the mesh as smoltrain.mesh lays them out; each stage is one tp group, and
its tp rank 0 is the stage's door: it alone receives the step's header and hidden states
from the previous stage's door (over the pp group) and hands them to its tp peers with a
broadcast over the tp group, so a hop between stages carries one copy of the hidden state,
as in pp alone. Inside a stage every layer makes tp's two all-reduces (at `--wire-dtype`).
Stage 0 has no previous stage: world rank 0 leads, broadcasting the header and, for a
decode step, each row's last token (8 bytes a row) to its tp peers. Every rank of the last
stage holds the head and samples the same tokens with the same seeded generators; its door
sends them back to rank 0. Rank 0 keeps one step per stage in flight, as pp does.
"""

from __future__ import annotations

import torch

from smolnet.errors import UsageError
from smoltrain.infer.batching import DECODE, IDLE, PREFILL, QUIT, slots_of
from smoltrain.infer.engine import Engine

INFER_AXES = ("pp", "tp")


def layout(text: str, world: int, mc) -> tuple[str, str | None, list[tuple[int, int]]]:
    """(strategy, mesh text or None, [first, last) per world rank) for `--mesh` over `world` ranks;
    a mesh with one axis wider than 1 is that strategy alone. One-line errors (exit 2) for a mesh
    that is not the world, an axis inference does not split along, tp wider than the KV heads."""
    from smoltrain.mesh import parse
    from smoltrain.models.stage import check_tp, even_layers

    other = [a for a in text.replace(" ", "").split(",") if a.partition("=")[0] not in INFER_AXES]
    if other:
        raise UsageError(f"--mesh {text}: inference splits along pp and tp only, not {other[0].partition('=')[0]}")
    mesh = parse(text, world, mc.spec())
    pp, tp = mesh.size("pp"), mesh.size("tp")
    if tp > 1:
        check_tp(mc, tp)
    stages = even_layers(mc.layers, pp)
    layers = [stages[place(mesh.text(), r)[0]] for r in range(world)]
    if pp == 1 or tp == 1:
        return ("pp" if pp > 1 else "tp" if tp > 1 else "local"), None, layers
    return "pp", mesh.text(), layers


def decode_plan(text: str, mc, names, dtype: str, wire: str | None) -> dict:
    """The report's `plan` of a pp x tp decode: bytes per link and the busiest rank's per generated
    token (planner.mesh_traffic); the infer planner gives no time, memory or placement for a mesh."""
    from smoltrain.mesh import parse
    from smoltrain.planner.mesh_traffic import mesh_decode_bytes

    links = mesh_decode_bytes(parse(text, len(names)), mc.spec(), dtype, wire)
    sent = [sum(b for (src, _), b in links.items() if src == r) for r in range(len(names))]
    return {
        "mode": "infer",
        "mesh": text,
        "bytes_per_token": max(sent),
        "links": [{"src": names[a], "dst": names[b], "bytes": n} for (a, b), n in sorted(links.items())],
        "tokens_per_s": None,
        "note": "a pp x tp mesh is planned for its bytes only (no time, memory or placement yet)",
    }


def place(text: str, rank: int) -> tuple[int, int, int, int]:
    """(stage, stages, tp rank, tp width) of a world rank on the mesh."""
    from smoltrain.mesh import parse

    mesh = parse(text, None)
    c = dict(zip(mesh.names, mesh.coords(rank)))
    return c.get("pp", 0), mesh.size("pp"), c.get("tp", 0), mesh.size("tp")


class MeshEngine(Engine):
    def __init__(self, stage, comm, rank: int, world: int, mesh: str, wire: str | None = None):
        from smoltrain.mesh import axis_comms, parse

        super().__init__(stage, comm, rank, world, wire)
        self.s, self.stages, self.t, _ = place(mesh, rank)
        comms = axis_comms(parse(mesh, world), comm)  # every rank builds every group, in order
        self.pp, self.tp = comms["pp"], comms["tp"]
        self.depth = self.lanes = self.stages
        self.last = self.s == self.stages - 1

    def _reduce(self, t):
        return self.codec.all_reduce(self.tp, t)

    def _onward(self, h, out) -> None:
        """The stage's output on its way: the next stage's door, or (last stage) the tokens to rank 0."""
        if self.last:
            toks = self.sample(self.slots, out)
            if self.t == 0:
                self.pp.send(torch.tensor(toks, dtype=torch.int64), 0)
        elif self.t == 0:
            self.pp.send(h, self.s + 1)
            self.pp.send(self.codec.encode(out), self.s + 1)

    # --- rank 0 ---
    def issue(self, item) -> None:
        def run():
            h = self.header(item)
            self.tp.broadcast(h, 0)
            ids = torch.tensor(item.ids)
            if item.kind == DECODE:
                self.tp.broadcast(ids.reshape(-1).to(torch.int64), 0)
            if item.kind == PREFILL:
                self.stage.open(item.slots[0], len(item.req.prompt_ids) + item.req.max_new_tokens)
            self.slots = item.slots
            self._onward(h, self.stage(ids, item.slots, self._reduce))

        self.counted(item.kind, len(item.slots), run)

    def collect(self, item) -> list[int]:
        toks = torch.zeros(len(item.slots), dtype=torch.int64)
        self.pp.recv(toks, self.stages - 1)
        return toks.tolist()

    def pass_header(self, h) -> None:
        self.tp.broadcast(h, 0)
        self.pp.send(h, 1)

    # --- every other rank ---
    def follow(self, admissions) -> None:
        s, door = self.s, self.t == 0
        while True:
            h = self.empty_header()
            b0 = self.sent()
            if door:
                self.pp.recv(h, s - 1)
            self.tp.broadcast(h, 0)
            kind, mask, T, rid = h.tolist()
            self.slots = slots = slots_of(mask)
            if kind in (IDLE, QUIT):
                if door and not self.last:
                    self.pp.send(h, s + 1)
                self.counters["idle_bytes"] += self.sent() - b0
                if kind == QUIT:
                    return
                continue
            self.counters["decode_bytes" if kind == DECODE else "prefill_bytes"] += self.sent() - b0
            req = admissions.take(rid) if kind == PREFILL else None
            self.counted(kind, len(slots), lambda h=h, k=kind, T=T, r=req: self._step(h, k, T, r))

    def _step(self, h, kind: int, T: int, req) -> None:
        slots = self.slots
        if kind == PREFILL and self.last:
            self.open(slots[0], req)  # the stage's cache and the request's sampler
        elif kind == PREFILL:
            self.stage.open(slots[0], len(req.prompt_ids) + req.max_new_tokens)
        if self.s == 0:  # tokens in: the prompt (every rank has the request), or each row's last token
            if kind == PREFILL:
                x = torch.tensor([req.prompt_ids])
            else:
                x = torch.zeros(len(slots), dtype=torch.int64)
                self.tp.broadcast(x, 0)
                x = x[:, None]
        else:
            buf = self.codec.buffer(len(slots) * (T if kind == PREFILL else 1))
            if self.t == 0:
                self.pp.recv(buf, self.s - 1)
            self.tp.broadcast(buf, 0)
            x = self.codec.decode(buf).reshape(len(slots), T if kind == PREFILL else 1, -1)
        self._onward(h, self.stage(x, slots, self._reduce))
