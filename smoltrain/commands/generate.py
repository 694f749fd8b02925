"""`smoltrain generate`: a Hugging Face model split over ranks (pp or tp), tokens streamed as they come."""

from __future__ import annotations

import sys

from smolnet.errors import SmolError, UsageError
from smoltrain import validate


def add_arguments(p) -> None:
    from smoltrain.infer.launch import add_placement_arguments

    add_placement_arguments(p)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer.json)")
    what.add_argument("--prompt-ids", help="prompt as token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=validate.TOKENS, default=32)
    p.add_argument("--temperature", type=validate.TEMPERATURE, default=0.0, help="0: greedy, deterministic")
    p.add_argument("--top-p", type=validate.PROBABILITY, default=1.0)
    p.add_argument("--seed", type=validate.SEED, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument(
        "--rounds",
        type=validate.ROUNDS,
        default=1,
        help="generate the same request this many times and report decode over all of them (a short "
        "decode on a CPU-capped host swings with where its throttles fall; the text is the first round's)",
    )
    p.add_argument("--json", help="write the report (smoltrain.generate/1) here")


def prompt_ids(args, tokenizer, vocab: int) -> list[int]:
    if args.prompt_ids is not None:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise UsageError(f"--prompt-ids {args.prompt_ids}: expected token ids like 1,2,3") from None
    else:
        if tokenizer is None:
            raise UsageError(
                f"--prompt needs a tokenizer, and {args.model} has no tokenizer.json (give --prompt-ids instead)"
            )
        ids = tokenizer.encode(args.prompt).ids
    if not ids:
        raise UsageError("the prompt is empty")
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise UsageError(f"prompt token id {bad[0]} is outside the model's vocabulary (0..{vocab - 1})")
    return ids


def check_request(ids, max_new: int, temperature: float, top_p: float, ctx: int) -> None:
    if max_new < 1:
        raise UsageError("--max-new-tokens must be at least 1")
    if len(ids) + max_new > ctx:
        raise UsageError(f"prompt ({len(ids)} tokens) + {max_new} new tokens exceed the model's context of {ctx}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise UsageError("--temperature must be >= 0 and --top-p in (0, 1]")


class Printer:
    """Streams text (or ids) to the terminal as tokens arrive."""

    def __init__(self, tokenizer, out=None):
        self.tok, self.out, self.ids, self.shown = tokenizer, out or sys.stdout, [], ""

    def __call__(self, t: int) -> None:
        self.ids.append(t)
        if self.tok is None:
            self.out.write(f"{t} ")
        else:
            text = self.tok.decode(self.ids)
            self.out.write(text[len(self.shown) :] if text.startswith(self.shown) else text)
            self.shown = text
        self.out.flush()


def run(args) -> int:
    from smoltrain.infer import report
    from smoltrain.infer.batching import Request
    from smoltrain.infer.launch import open_model
    from smoltrain.infer.runner import RankDied

    if args.strategy == "local" and args.local is None and not args.inventory:
        args.local = 1
    # checks that need only the folder come before any rank starts
    import os

    from smoltrain.models.hf import CheckpointError, load_tokenizer, read_config

    try:
        mc = read_config(os.path.abspath(args.model)) if os.path.isdir(args.model) else None
        tok = load_tokenizer(args.model) if mc else None
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    if mc is not None:
        ids = prompt_ids(args, tok, mc.vocab)
        check_request(ids, args.max_new_tokens, args.temperature, args.top_p, mc.ctx)
    setup = open_model(args, seq=len(ids) + args.max_new_tokens if mc is not None else None)
    mc = setup.ckpt.config
    try:
        req = Request(
            ids,
            args.max_new_tokens,
            args.temperature,
            args.top_p,
            args.seed,
            [] if args.ignore_eos or mc.eos is None else [mc.eos],
        )
        pr = Printer(setup.tokenizer)
        try:
            rounds = [setup.runner.generate(req, on_token=pr)]
            print()
            rounds += [setup.runner.generate(req) for _ in range(args.rounds - 1)]
        except RankDied as e:
            raise SmolError(f"generation failed: {e}") from None
    finally:
        setup.runner.close()
    stats = report.merge_rounds(rounds)
    text = setup.tokenizer.decode(stats[0]["output_ids"]) if setup.tokenizer else None
    plan = setup.plan
    if plan is None:  # one process: the pp plan of one stage, for the record
        plan = report.decode_plan(args, mc, 1, setup.hosts, len(ids) + args.max_new_tokens)
    doc = report.build(
        setup.cfg, mc, stats, ids, text, plan, report.measured_bandwidth(setup.cfg, setup.hosts, args.compute)
    )
    d, p = doc["decode"], doc["prefill"]
    line = (
        f"{setup.cfg.strategy} on {setup.cfg.world_size} rank(s): ttft {doc['ttft_s'] * 1e3:.1f} ms, "
        f"prefill {p['tokens_per_s'] or 0:,.0f} tok/s, decode {d['tokens_per_s'] or 0:,.1f} tok/s, "
        f"{d['bytes_per_token'] or 0:,.0f} B/token"
    )
    each = d["tokens_per_s_rounds"]
    if d["rounds"] > 1 and all(each):
        line += f" over {d['rounds']} rounds ({min(each):,.1f}-{max(each):,.1f} each)"
    if d["roofline_tokens_per_s"] and d["tokens_per_s"]:
        line += f", {d['tokens_per_s'] / d['roofline_tokens_per_s']:.0%} of the memory-bandwidth bound"
    if plan and plan.get("tokens_per_s") is None and "bytes_per_token" in plan:  # a mesh: bytes only
        line += f" (plan: {plan['bytes_per_token']:,.0f} B/token)"
    elif plan and "bytes_per_token" in plan:
        line += f" (plan: {plan['tokens_per_s']:,.1f} tok/s, {plan['bytes_per_token']:,.0f} B/token)"
    print(line, file=sys.stderr)
    if d["vs_plan"] and setup.cfg.world_size > 1:
        print(report.vs_plan_line(d["vs_plan"]), file=sys.stderr)
    if args.json:
        from smolnet.files import write_json_atomic

        write_json_atomic(args.json, doc, indent=1)
    return 0
