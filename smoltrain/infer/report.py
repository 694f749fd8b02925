"""The generate report (`smoltrain.generate/1`): what the ranks measured, with the infer plan beside it."""

from __future__ import annotations

from smoltrain.infer.runner import COUNTED


def decode_request(args, mc, world: int, hosts, seq: int, placement=None):
    """The `--mode infer` PlanRequest of a generate or serve: this strategy, checkpoint, world,
    hosts and links (`plan` builds the same from the same arguments)."""
    from smoltrain.planner.links import read_report
    from smoltrain.planner.request import PlanRequest

    links = getattr(args, "links", None)
    # serve deals its requests into a lane per pp stage (infer.pp): its stages are balanced, not summed
    lanes = min(world, getattr(args, "max_batch", 1)) if args.strategy == "pp" else 1
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
        quantize=getattr(args, "quantize", None),
        wire_dtype=getattr(args, "wire_dtype", None),
        lanes=lanes,
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


def measured_bandwidth(cfg, hosts=None, path: str | None = None) -> dict | None:
    """Memory bandwidth by rank name from the compute report (calibrate), when it measured these hosts
    (--local ranks: this machine's uncapped entry); None: each rank's own copy measurement counts."""
    try:
        from smoltrain.planner.compute import default_path, for_local, load_compute

        path = default_path(path)
        if path is None:
            return None
        if hosts is None:
            f = for_local(path)
            return {n: f.mem_bw for n in cfg.names} if f else None
        return {n: h.mem_bw for n, h in load_compute(path, list(cfg.names)).items()}
    except Exception:  # advice only: fall back to the ranks' own measurement
        return None


def roofline(cfg, stats: list[dict], bandwidth: dict | None = None) -> float | None:
    """Tokens/s if decode did nothing but read each rank's weights at its memory bandwidth
    (`bandwidth`: bytes/s by host name from a compute report, else each rank's measured copy).
    pp stages run one after another (their times add up); the tp ranks of a stage (the ranks
    holding the same layers) read their shares at once."""
    stage: dict = {}
    for name, layers, s in zip(cfg.names, cfg.layers, stats):
        bw = (bandwidth or {}).get(name) or s.get("mem_bw_bytes_s")
        if not bw or not s.get("weight_bytes_per_token"):
            return None
        stage[tuple(layers)] = max(stage.get(tuple(layers), 0.0), s["weight_bytes_per_token"] / bw)
    total = sum(stage.values())
    return 1 / total if total > 0 else None


def _rate(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if tokens and seconds > 0 else None


def merge_rounds(rounds: list[list[dict]]) -> list[dict]:
    """Every rank's stats over several rounds of one request, as one: the decode counters and
    the bytes each link carried added up, the prompt's prefill and the text the first round's,
    and each round's decode rate kept (`decode_rounds`) so the spread stays visible. Why: a
    48-token decode on the home sim lasts about a quarter of a second, fifteen of the Pi's CFS
    periods, and where its throttles fall moved the rate from 0.78 to 1.43 of the plan over
    twelve runs of one tree on one sim; the plan predicts their mean."""
    if len(rounds) == 1:
        return rounds[0]
    out = []
    for r, first in enumerate(rounds[0]):
        m = dict(first)
        each = [rd[r] for rd in rounds]
        for k in ("decode_steps", "decode_s", *COUNTED):
            if k in first and k != "prefill_bytes":
                m[k] = sum(x.get(k, 0) for x in each)
        links: dict = {}
        for x in each:
            for peer, n in x.get("links", []):
                links[peer] = links.get(peer, 0) + n
        m["links"] = list(links.items())
        if "decode_s" in first:
            m["decode_rounds"] = [_rate(x["decode_steps"], x["decode_s"]) for x in each]
        out.append(m)
    return out


def build(
    cfg, mc, stats: list[dict], prompt_ids: list[int], text: str | None, plan: dict | None, bandwidth=None
) -> dict:
    r0 = stats[0]
    steps = r0["decode_steps"]
    busiest = max(s["decode_bytes"] for s in stats)
    links = []
    for r, s in enumerate(stats):
        for dst, n in s.get("links", []):
            links.append({"src": cfg.names[r], "dst": cfg.names[int(dst)], "bytes": int(n)})
    doc = {
        "schema": "smoltrain.generate/1",
        "strategy": cfg.strategy,
        "mesh": _mesh(cfg.mesh),
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
            "tokens_per_s": _rate(steps, r0["decode_s"]),
            "rounds": len(r0.get("decode_rounds") or [None]),
            "tokens_per_s_rounds": r0.get("decode_rounds") or [_rate(steps, r0["decode_s"])],
            "bytes_per_token": busiest / steps if steps else None,
            # CPU seconds of all ranks together: what the split costs, whatever else loads the machine
            "cpu_s": sum(s.get("decode_cpu_s", 0.0) for s in stats),
            "cpu_s_per_rank": {name: s.get("decode_cpu_s", 0.0) for name, s in zip(cfg.names, stats)},
            "per_rank": per_rank(cfg.names, stats, steps),
            # weights read per generated token, all ranks, and the memory-bandwidth bound they set
            "weight_bytes_per_token": sum(s.get("weight_bytes_per_token") or 0 for s in stats) or None,
            "roofline_tokens_per_s": roofline(cfg, stats, bandwidth),
        },
        "quantize": cfg.quantize,
        "wire_dtype": cfg.wire_dtype or cfg.dtype or mc.dtype,
        "threads": {name: s.get("threads") for name, s in zip(cfg.names, stats)},
        "kernels": {name: s.get("kernels") for name, s in zip(cfg.names, stats)},
        "devices": {name: s.get("device") for name, s in zip(cfg.names, stats)},
        "ttft_s": r0["prefill_s"],
        "links": links,
        "plan": plan,
    }
    doc["decode"]["vs_plan"] = vs_plan(plan, doc["decode"], cfg.strategy, cfg.mesh)
    return doc


def vs_plan(plan: dict | None, decode: dict, strategy: str, mesh=None) -> dict | None:
    """The decode token's terms against the plan's, per token: each rank's own work (its stage,
    and what the engine does around it: the step's wall time less its messages') and the rest
    of the token (messages and hops: the token's time less the stages' work, their sum for a pp
    chain, the slowest for tp's lockstep; planned: the plan's communication), each judged as
    `plan --compare` judges a training rank's. The plan's stages are each rank's at its pace; on
    a quota host the chain runs them in bursts, faster. A rate within its plan can hide a stage
    2x slow beside a hop 2x fast (issue 36); None without a timed plan, or for a mesh (its
    stages run tp groups)."""
    rate, ranks = decode.get("tokens_per_s"), (plan or {}).get("ranks") or []
    if mesh or not rate or not ranks or not plan.get("step_s") or any(r.get("compute_s") is None for r in ranks):
        return None
    got = decode.get("per_rank") or {}
    if any(r.get("name") not in got for r in ranks):
        return None
    token_s, step_s = 1 / rate, plan["step_s"]
    rows = [{"name": r["name"], **_term(r["compute_s"], got[r["name"]]["work_wall_ms"] / 1e3, step_s)} for r in ranks]
    chain = sum if strategy in ("pp", "local") else max
    planned_rest = plan.get("comm_s_per_step")  # on quota hosts the stages burst: the plan's own split
    if planned_rest is None:
        planned_rest = max(0.0, step_s - chain(r["planned_s"] for r in rows))
    rest = _term(planned_rest, max(0.0, token_s - chain(r["measured_s"] for r in rows)), step_s)
    outside = [f"stage on {r['name']} x{r['ratio']:.2f}" for r in rows if r["verdict"] == "outside"]
    if rest["verdict"] == "outside":
        outside.append(f"messages and hops x{rest['ratio']:.2f}")
    return {"token": {"planned_s": step_s, "measured_s": token_s}, "ranks": rows, "rest": rest, "outside": outside}


def _term(planned: float, measured: float, step_s: float) -> dict:
    from smoltrain.planner.compare import term_verdict

    ratio, verdict = term_verdict(planned, measured, step_s)
    return {"planned_s": planned, "measured_s": measured, "ratio": ratio, "verdict": verdict}


def per_rank(names: list[str], stats: list[dict], steps: int) -> dict:
    """Each rank's decode step, per token (ms): its CPU and wall time, and of them its
    messages' (their CPU, and their wall time, which includes the wait for a peer); the
    rest is its own work (`work_*`). The terms the plan's decode model adds up; a pp
    rank's turn in the chain is wall_ms - wait_ms."""
    out = {}
    for name, s in zip(names, stats):
        if not steps or "decode_wall_s" not in s:
            continue
        keys = ("cpu_s", "wall_s", "comm_cpu_s", "comm_wall_s", "wait_s")
        ms = {k: 1e3 * s.get(f"decode_{k}", 0.0) / steps for k in keys}
        out[name] = {
            "cpu_ms": ms["cpu_s"],
            "wall_ms": ms["wall_s"],
            "comm_cpu_ms": ms["comm_cpu_s"],
            "comm_wall_ms": ms["comm_wall_s"],
            "work_cpu_ms": ms["cpu_s"] - ms["comm_cpu_s"],
            "work_wall_ms": ms["wall_s"] - ms["comm_wall_s"],
            # pp: the wait for the step's input; the rest of wall_ms is the rank's turn in the chain
            "wait_ms": ms["wait_s"],
            "messages": s.get("decode_comm_calls", 0) / steps,
        }
    return out


def _mesh(text: str | None) -> dict | None:
    """The report's `mesh`, as run and plan reports carry it (axes, each rank's coordinates)."""
    from smoltrain.mesh import parse

    return parse(text, None).report() if text else None


def vs_plan_line(v: dict) -> str:
    """vs_plan in one line: each stage's and the rest's time a token, measured against planned."""

    def term(what: str, t: dict) -> str:
        x = f", x{t['ratio']:.2f}" if t["ratio"] else ""
        return f"{what} {t['measured_s'] * 1e3:.2f} ms (plan {t['planned_s'] * 1e3:.2f}{x})"

    parts = [term(f"stage {r['name']}", r) for r in v["ranks"]] + [term("messages and hops", v["rest"])]
    return "per token against the plan: " + ", ".join(parts)
