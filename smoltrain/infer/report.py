"""The generate report (`smoltrain.generate/1`): what the ranks measured, with the infer plan beside it."""

from __future__ import annotations


def decode_request(args, mc, world: int, hosts, seq: int, placement=None):
    """The `--mode infer` PlanRequest of a generate or serve: this strategy, checkpoint, world,
    hosts and links (`plan` builds the same from the same arguments)."""
    from smoltrain.planner.links import read_report
    from smoltrain.planner.request import PlanRequest

    links = getattr(args, "links", None)
    return PlanRequest(
        args.strategy if args.strategy != "local" else "pp",
        mc.spec(),
        mode="infer",
        world=world,
        dtype=args.dtype or mc.dtype,
        batch=1,
        seq=min(seq, mc.ctx),
        placement=placement if placement is not None else getattr(args, "placement", None),
        hosts=hosts,
        links=read_report(links) if links else None,
        compute=getattr(args, "compute", None),
        local=hosts is None,
        strict=True,
    )


def decode_plan(args, mc, world: int, hosts, seq: int) -> dict:
    """The infer plan, placed: the decode placement (`auto`: the sum over stages of compute
    plus hop time, within memory; a ring or chain that avoids a down link) is what the ranks
    then run. A placement that cannot be made is refused (PlacementError); a planner fault
    is recorded as the plan's `error` and the ranks run the even split."""
    from smoltrain.planner.placement import PlacementError
    from smoltrain.planner.request import build_plan

    try:
        return build_plan(decode_request(args, mc, world, hosts, seq))
    except PlacementError:
        raise
    except Exception as e:  # say why it is missing; the even split still runs
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
        "placement": {
            "mode": ((plan or {}).get("placement") or {}).get("mode", "even"),
            "order": list(cfg.names),
            "layers": [list(x) for x in cfg.layers],
        },
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
