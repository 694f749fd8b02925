"""One inference rank: `python -m smoltrain.infer.worker --control ADDR:PORT --rank R` (secret on stdin).

It dials the controller, gets the InferConfig, joins the rank group, loads only its own
layers (or tp slice) from the shared checkpoint folder, says `ready`, then serves until
`quit`. The controller sends every rank each request (`admit`); rank 0 batches them
(`batching.lead`), sends each step's `tokens` and each request's `done` with its stats;
the other ranks follow rank 0's headers. `cancel` (rank 0) drops a request; `stats`
gets a rank's counters. A failure is one `error` message with a one-line reason.
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import sys
import threading
import time
import traceback

from smolnet import wire
from smoltrain.infer.batching import Admissions, Batcher, Request, lead
from smoltrain.infer.config import InferConfig
from smoltrain.infer.engine import make_engine
from smoltrain.infer.runner import MAX_IDS, pack_ids, unpack_ids

MSG = 1


class Control:
    """The worker's end of the control connection; a reader thread queues what arrives."""

    def __init__(self, addr: str, port: int, secret: bytes, rank: int):
        self.sock, key = wire.connect(addr, port, secret, timeout=60.0, what="controller", keyed=True)
        self.session = wire.Session(key, client=True, full=True)  # every frame MACed, payload too
        self.lock = threading.Lock()
        self.inbox: queue.Queue = queue.Queue()
        self.send({"type": "hello", "rank": rank, "pid": os.getpid(), "host": socket.gethostname()})
        kind, msg, _ = wire.recv_frame(self.sock, timeout=60.0, max_payload=0, session=self.session)
        if msg.get("type") != "config":
            raise wire.WireError("the controller did not send a config")
        self.config = InferConfig.from_wire(msg.get("config"))
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                _, msg, payload = wire.recv_frame(
                    self.sock, timeout=None, max_payload=4 * MAX_IDS, session=self.session
                )
                if payload:  # token ids (an `admit`'s prompt) travel as the payload, never in the JSON
                    msg["ids"] = unpack_ids(payload)
            except (OSError, wire.WireError, TimeoutError, ValueError) as e:
                if isinstance(e, wire.WireError) and not isinstance(e, wire.PeerClosed):  # forged, altered: dropped
                    print(f"control connection: frame dropped, connection closed: {e}", file=sys.stderr, flush=True)
                self.inbox.put({"type": "quit"})
                return
            self.inbox.put(msg)

    def send(self, msg: dict, payload: bytes = b"") -> None:
        with self.lock:
            wire.send_frame(self.sock, MSG, msg, payload, timeout=30.0, session=self.session)


def serve(ctl: Control, rank: int, secret: bytes) -> None:

    from smoltrain import host
    from smoltrain.finetune.adapter import open_checkpoint
    from smoltrain.models import backends
    from smoltrain.models.stage import Stage

    cfg = ctl.config
    threads, device = host.setup(cfg.rank_threads(rank), cfg.rank_device(rank), cfg.dtype)
    backends.select(cfg.kernels)  # a backend this host cannot run: the rank's one-line error
    world = cfg.world_size
    t0 = time.perf_counter()
    comm = None
    if world > 1:
        from smoltrain.comm import make_comm

        comm = make_comm(
            cfg.backend,
            rank,
            world,
            cfg.coord_addr,
            cfg.port,
            secret,
            timeout=cfg.timeout,
            addrs=list(cfg.addrs) or None,
        )
    first, last = cfg.layers[rank]
    if cfg.mesh:  # pp x tp: this rank's stage and its place in the stage's tp group
        from smoltrain.infer.mesh_layout import place

        s, stages, t, tp = place(cfg.mesh, rank)
    else:
        pp, tp_ = cfg.strategy == "pp", cfg.strategy == "tp"
        s, stages, t, tp = (rank if pp else 0), (world if pp else 1), (rank if tp_ else 0), (world if tp_ else 1)
    stage = Stage(
        open_checkpoint(cfg.model_dir, cfg.adapter_dir),
        first,
        last,
        is_first=s == 0,
        is_last=s == stages - 1,
        tp_rank=t,
        tp_world=tp,
        dtype=cfg.dtype,
        quantize=cfg.quantize,
        device=device,
        batched=cfg.max_batch > 1,
    )
    if cfg.mesh:
        from smoltrain.infer.meshed import MeshEngine

        engine = MeshEngine(stage, comm, rank, world, cfg.mesh, cfg.wire_dtype)
    else:
        engine = make_engine(cfg.strategy, stage, comm, rank, world, cfg.wire_dtype)
    machine = host.rank_facts(stage, threads, device)
    batcher = admissions = None
    if rank == 0:
        batcher = Batcher(
            cfg.max_batch,
            engine.lanes,
            on_tokens=lambda items: ctl.send({"type": "tokens", "items": items}),
            on_done=lambda rid, reason, stats: send_done(ctl, rid, reason, stats),
        )
    else:
        admissions = Admissions(cfg.timeout)

    def pump() -> None:  # the control messages, while the main thread steps
        while True:
            msg = ctl.inbox.get()
            kind = msg.get("type")
            if kind == "admit":
                req = Request(**msg["request"], prompt_ids=msg.get("ids") or [])
                if batcher:
                    batcher.submit(req)
                else:
                    admissions.put(req)
            elif kind == "cancel" and batcher:
                batcher.cancel(int(msg["rid"]))
            elif kind == "stats":
                counters, sent = engine.snapshot()  # between steps: a step still counting is waited for
                ctl.send({"type": "stats", "stats": counters, "links": sorted(sent.items()), "machine": machine})
            elif kind == "quit":
                if batcher:
                    batcher.stop()
                return

    ctl.send({"type": "ready", "load_s": time.perf_counter() - t0})
    threading.Thread(target=pump, daemon=True).start()
    try:
        if batcher is not None:
            lead(engine, batcher, keepalive_s=max(1.0, cfg.timeout / 4))
        else:
            engine.follow(admissions)
    finally:
        if comm is not None:
            comm.close()


def send_done(ctl: Control, rid: int, reason: str, stats: dict) -> None:
    """A request's end; its output ids as the frame's payload (a long answer passes the JSON bound)."""
    rest = {k: v for k, v in stats.items() if k != "output_ids"}
    ctl.send({"type": "done", "rid": rid, "reason": reason, "stats": rest}, pack_ids(stats["output_ids"]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="smoltrain.infer.worker")
    p.add_argument("--control", required=True)
    p.add_argument("--rank", type=int, required=True)
    a = p.parse_args(argv)
    import faulthandler

    faulthandler.enable()  # a native crash leaves its Python stack in the log, not silence
    from smolnet.secret import parse_secret

    secret = parse_secret(sys.stdin.buffer.readline(), "stdin")
    addr, _, port = a.control.rpartition(":")
    ctl = Control(addr, int(port), secret, a.rank)
    try:
        serve(ctl, a.rank, secret)
        return 0
    except BaseException as e:  # one line to the controller, the trace to the log
        traceback.print_exc()
        line = str(e).splitlines()[0] if str(e) else type(e).__name__
        try:
            ctl.send({"type": "error", "message": f"{type(e).__name__}: {line}"})
        except Exception:
            pass
        return 1


def exit_now(code: int) -> None:
    """End the process without interpreter teardown: the work is over and reported, and teardown
    (the control reader blocked in recv as a daemon thread, torch's thread pools) is the one step
    left that could still turn a finished rank's exit status into a failure."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
