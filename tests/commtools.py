"""Run a function on N ranks (processes) on loopback and collect what each returns, as JSON.

Processes come from a forkserver that has imported torch once, so a 5-rank group costs
a fork each rather than a fresh interpreter. Every group has a deadline; stragglers are
killed, so a hung transport fails the test instead of hanging the suite.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
import traceback

SECRET = b"test-secret-0123456789abcdef"

_ctx = None


def context():
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(
            [
                "torch",
                "smoltrain.comm",
                "smoltrain.comm.socket_comm",
                "smoltrain.comm.torch_comm",
                "commtools",
                "comm_cases",
            ]
        )
    return _ctx


def _child(case: str, rank: int, n: int, backend: str, port: int, params: dict, out: str) -> None:
    import comm_cases
    import torch

    from smoltrain.comm import CommError, make_comm

    torch.set_num_threads(1)
    res: dict
    comm = None
    try:
        comm = make_comm(backend, rank, n, "127.0.0.1", port, SECRET, timeout=params.get("timeout", 20.0))
        if params.get("chunk_bytes") and backend == "socket":
            comm.chunk_bytes = params["chunk_bytes"]
        res = {"ok": True, "result": getattr(comm_cases, case)(comm, params)}
    except CommError as e:
        res = {"ok": False, "error": str(e), "peer": e.peer, "type": "CommError", "t": time.time()}
    except Exception as e:
        res = {
            "ok": False,
            "error": repr(e),
            "type": type(e).__name__,
            "t": time.time(),
            "trace": traceback.format_exc()[-2000:],
        }
    finally:
        if comm is not None:
            comm.close()
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f)
    os.replace(tmp, out)


class Group:
    """N rank processes running comm_cases.<case>; start(), then results()."""

    def __init__(self, case: str, n: int, backend: str, params: dict | None = None):
        from smoltrain.comm.group import free_port_base

        self.n = n
        self.dir = tempfile.mkdtemp(prefix="smolcomm-")
        self.port = free_port_base(n)
        ctx = context()
        self.procs = [
            ctx.Process(
                target=_child,
                args=(
                    case,
                    r,
                    n,
                    backend,
                    self.port,
                    dict(params or {}, dir=self.dir),
                    os.path.join(self.dir, f"r{r}.json"),
                ),
                daemon=True,
            )
            for r in range(n)
        ]

    def start(self) -> Group:
        for p in self.procs:
            p.start()
        return self

    def kill(self, rank: int) -> float:
        os.kill(self.procs[rank].pid, signal.SIGKILL)
        return time.time()

    def results(self, timeout: float = 60.0) -> list[dict | None]:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        out = []
        for r, p in enumerate(self.procs):
            if p.is_alive():
                p.kill()
                p.join(5)
            path = os.path.join(self.dir, f"r{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    out.append(json.load(f))
            else:
                out.append(None)
        shutil.rmtree(self.dir, ignore_errors=True)  # read once: nothing left in /tmp
        return out


def run_group(case: str, n: int, backend: str, params: dict | None = None, timeout: float = 60.0) -> list:
    return Group(case, n, backend, params).start().results(timeout)
