"""The run report (smoltrain.run/1) from what a controller gathered: each step's loss and
timings, the bytes per link, the events, the model, and the evals and outer steps a run has;
plus the loss curve.

Split from the controller (smoltrain.run.controller), which runs the message loop: this
module only reads what the loop recorded.
"""

from __future__ import annotations

import os
from pathlib import Path

from smolnet.errors import SmolError
from smolnet.files import write_json_atomic
from smoltrain.run.config import RunConfig


def run_report(ctl, partial: bool = False) -> dict:
    """The run report of a controller (smoltrain.run.controller) from what its workers sent;
    `partial`: only the steps that finished (a failed or interrupted run)."""
    start, steps = ctl.cfg.start_step, ctl.cfg.steps
    tokens = ctl.cfg.global_tokens
    rows = []
    for k in range(start, steps):
        rec = ctl.steps.get(k)
        if rec is None or not rec["parts"]:
            if partial:
                continue
            raise SmolError(f"step {k}: no loss reported")
        loss = step_loss(rec)
        row = {"step": k, "loss": loss, "step_s": rec["step_s"], "comm_s": rec["comm_s"], "tokens": tokens}
        rows.append(dict(row, loss_tokens=rec.get("loss_tokens", tokens)))
    total_s = sum(r["step_s"] for r in rows)
    order = {n: i for i, n in enumerate(ctl.names)}
    from smoltrain.run.timings import rank_timings

    # pipeline stages wait for each other by design: their communication is read off the schedule
    stages_m = (ctl.cfg.microbatches if ctl.info.microbatched else 1) if ctl.info.splits == "layers" else None
    for row in rows:
        by = ctl.steps[row["step"]].get("by", {})
        row["ranks"] = rank_timings(
            {order.get(n, len(order) + i): v for i, (n, v) in enumerate(sorted(by.items()))},
            row["step_s"],
            stages_m,
        )
    links = sorted(
        ctl.links.items(),
        key=lambda kv: (order.get(kv[0][0], 1 << 20), kv[0][0], order.get(kv[0][1], 1 << 20), kv[0][1]),
    )
    return {
        "schema": "smoltrain.run/1",
        "strategy": ctl.strategy,
        "backend": ctl.cfg.backend,
        "world_size": ctl.world,
        "hosts": ctl.names,
        "config": ctl.cfg.report_view(),
        "steps": rows,
        "bytes": [{"src": s, "dst": d, "bytes": n} for (s, d), n in links],
        "events": sorted(ctl.events, key=lambda e: (e["step"], e["kind"] != "resume")),
        "final_loss": rows[-1]["loss"] if rows else None,
        "tokens_per_s": (tokens * len(rows) / total_s) if total_s > 0 else None,
        "state_bytes": ctl.state_bytes,
        "threads": ctl.threads,
        "kernels": ctl.kernels,
        **model_sections(ctl.cfg),
        **extra_sections(ctl, tokens),
    }


def extra_sections(ctl, tokens: int) -> dict:
    """`mesh` (contract section 12), and `evals` (--eval-every) and `outer_steps` (diloco) when
    the run has them."""
    from smoltrain.mesh import mesh_of

    out = {"mesh": mesh_of(ctl.cfg).report()}
    if ctl.evals:
        out["evals"] = [
            {"step": k, "tokens": (k + 1) * tokens, "loss": step_loss(rec)} for k, rec in sorted(ctl.evals.items())
        ]
    if ctl.outer:
        order = {n: i for i, n in enumerate(ctl.names)}
        out["outer_steps"] = [
            {
                "step": k,
                "sync_s": max(r["sync_s"] for r in by.values()),
                "bytes": sum(r["bytes"] for r in by.values()),
                # the outer step's wall time: the rank that waited least at the sync came last, so
                # its inner steps and sync are the critical path (what others did between steps,
                # like evaluating, shows up in their waits, not here)
                "seconds": min(by.values(), key=lambda r: r["wait_s"])["seconds"],
                "ranks": [
                    dict(by[n], name=n, rank=order.get(n, -1)) for n in sorted(by, key=lambda n: order.get(n, 99))
                ],
            }
            for k, by in sorted(ctl.outer.items())
        ]
        # ranks run their inner steps apart: the outer steps' wall time gives the rate
        wall = sum(o["seconds"] for o in out["outer_steps"])
        rows = sum(1 for k in ctl.steps if k >= ctl.cfg.start_step)
        out["tokens_per_s"] = tokens * rows / wall if wall > 0 else None
    return out


def model_sections(cfg: RunConfig) -> dict:
    """The report's `model` {name, arch, params}, `trainable_params` and `lora` (contract section 11)."""
    spec = cfg.model
    trainable = spec.params()
    if cfg.lora:
        from smoltrain.models.causal import trainable_params

        trainable = trainable_params(spec, cfg.lora)
    return {
        "model": {"name": spec.name, "arch": spec.arch or "gpt", "params": spec.params()},
        "trainable_params": trainable,
        "lora": cfg.lora,
    }


def step_loss(rec: dict) -> float:
    """A step's loss: the ranks' shares summed; where shares carry the part of the batch they
    stand for (elastic members), over the parts that arrived."""
    loss = sum(v for _, v in sorted(rec["parts"].items()))
    weights = rec.get("weights") or {}
    if weights and len(weights) == len(rec["parts"]):
        total = sum(weights.values())
        return loss / total if total > 0 else loss
    return loss


def write_json(path: str | os.PathLike, doc: dict) -> None:
    write_json_atomic(path, doc, indent=1)


def plot_losses(doc: dict, path: str | os.PathLike) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([s["step"] + 1 for s in doc["steps"]], [s["loss"] for s in doc["steps"]], marker=".", label="training")
    if doc.get("evals"):  # --eval-every: the held-out slice no worker trains on
        ev = doc["evals"]
        ax.plot([e["step"] + 1 for e in ev], [e["loss"] for e in ev], marker="o", label="held-out")
        ax.legend()
    for e in doc["events"]:
        if e["kind"] in ("join", "leave"):
            ax.axvline(e["step"] + 1, color="red" if e["kind"] == "leave" else "green", ls="--", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over the global batch)")
    ax.set_title(f"{doc['strategy']} on {doc['world_size']} ranks ({doc['backend']})")
    fig.tight_layout()
    tmp = p.with_name(p.stem + f".tmp{os.getpid()}.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, p)
