"""The generate report (`smoltrain.generate/1`): what the ranks measured, with the infer plan beside it."""

from __future__ import annotations


def infer_plan(cfg, mc, seq: int, hosts=None) -> dict | None:
    """The `--mode infer` plan of the same strategy, model, world and placement (advice: never fatal)."""
    try:
        from smoltrain.planner import plan_for_run

        strategy = cfg.strategy if cfg.strategy != "local" else "pp"
        dtype = cfg.dtype or mc.dtype
        links = None
        if hosts is not None:
            from smoltrain.planner.links import find_report

            links = find_report([h.name for h in hosts])
        doc = plan_for_run(
            strategy=strategy,
            model=mc.spec(),
            world=cfg.world_size,
            dtype=dtype,
            batch=1,
            seq=min(seq, mc.ctx),
            mode="infer",
            hosts=hosts,
            links=links,
        )
        doc.setdefault("placement", {"mode": "even", "order": list(cfg.names), "layers": [list(x) for x in cfg.layers]})
        return doc
    except Exception as e:  # the plan is advice; say why it is missing
        return {"error": f"{type(e).__name__}: {e}"}


def build(cfg, mc, stats: list[dict], prompt_ids: list[int], text: str | None, plan: dict | None) -> dict:
    r0 = stats[0]
    steps = r0["decode_steps"]
    busiest = max(s["decode_bytes"] for s in stats)
    links = []
    for r, s in enumerate(stats):
        for dst, n in s.get("links", []):
            links.append({"src": cfg.names[r], "dst": cfg.names[int(dst)], "bytes": int(n)})
    return {
        "schema": "smoltrain.generate/1",
        "strategy": cfg.strategy,
        "backend": cfg.backend if cfg.world_size > 1 else None,
        "world_size": cfg.world_size,
        "hosts": list(cfg.names),
        "model": {"dir": cfg.model_dir, **mc.to_dict()},
        "dtype": cfg.dtype or mc.dtype,
        "placement": {"mode": "even", "order": list(cfg.names), "layers": [list(x) for x in cfg.layers]},
        "prompt_ids": list(prompt_ids),
        "output_ids": list(r0["output_ids"]),
        "text": text,
        "prefill": {
            "tokens": r0["prefill_tokens"],
            "seconds": r0["prefill_s"],
            "tokens_per_s": r0["prefill_tokens"] / r0["prefill_s"] if r0["prefill_s"] > 0 else None,
            "bytes": max(s["prefill_bytes"] for s in stats),
        },
        "decode": {
            "tokens": steps,
            "seconds": r0["decode_s"],
            "tokens_per_s": steps / r0["decode_s"] if steps and r0["decode_s"] > 0 else None,
            "bytes_per_token": busiest / steps if steps else None,
            # CPU seconds of all ranks together: what the split costs, whatever else loads the machine
            "cpu_s": sum(s.get("decode_cpu_s", 0.0) for s in stats),
        },
        "ttft_s": r0["prefill_s"],
        "links": links,
        "plan": plan,
    }
