"""Hand-built `smoltrain.compute/1` reports for placement and plan tests: one fast host,
the others three times slower per sequence (a fixed cost as well where asked)."""

from __future__ import annotations

import json


def compute_doc(names, fast, model="tiny", seq=64, fixed=0.0, machine_id=None, slow=0.03) -> dict:
    """Timed steps at batch 2 and 8: `fixed + batch * (0.01 if fast else slow)` seconds."""
    hosts = [
        {
            "name": n,
            "machine_id": machine_id or n,
            "cores": 1,
            "cpu_limit_cores": 1,
            "flops": {"fp32": 1e10},
            "mem_bw_bytes_s": 1e10,
            "usable_memory_bytes": 4e9,
            "train_step": [
                {"model": model, "batch": b, "seq": seq, "seconds": fixed + b * (0.01 if n == fast else slow)}
                for b in (2, 8)
            ],
        }
        for n in names
    ]
    return {"schema": "smoltrain.compute/1", "created": "2026-12-03T00:00:00Z", "hosts": hosts}


def write_compute(path, names, fast, **kw):
    path.write_text(json.dumps(compute_doc(names, fast, **kw)))
    return path
