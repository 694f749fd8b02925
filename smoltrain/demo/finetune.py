"""Demo stage: fine-tune a Hugging Face checkpoint across the hosts (issue 37, CONTRACT.md section 11).

No download is possible, so the stage makes its checkpoint in the run folder
(smoltrain/finetune/tinymodel.py: a small Llama with random weights, a byte-level BPE tokenizer
trained by `tokenizers` on the chats' text, a ChatML template) and a JSONL of house chats.
Then the command lines a user would type: `plan --strategy all --model DIR --lora-rank R` on
the demo's hosts, links and compute (each rank's memory, and the fastest setup that fits),
`run --model DIR --data chats.jsonl` with the plan's pick (LoRA: only the adapters train and
cross the wire), `export` of the adapter (a PEFT folder), and `generate` on the base without
and with `--adapter`: the same questions answered before and after, side by side in the report.

It costs more than --quick allows (a checkpoint to make and seven commands, one a 4-host run: about
45 s on a loaded 2-core machine), so --quick skips it and the report says so.
"""

from __future__ import annotations

import json
from pathlib import Path

RANK, TARGETS = 8, "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
STEPS, BATCH, SEQ, LR = 40, 8, 48, "3e-2"
NEW_TOKENS = 24
CHATS = [
    ("Where is the spare key?", "Under the blue pot by the door."),
    ("When does the bin go out?", "Tuesday night, before ten."),
    ("What is the wifi password?", "It is on the fridge, under the magnet."),
    ("Which host is the fastest?", "The Mac mini, then the laptop."),
    ("Who feeds the cat?", "Sam in the morning, Alex at night."),
    ("Where are the spare fuses?", "In the red box in the garage."),
    ("When is the bike serviced?", "Every spring, at the shop on Mill Road."),
    ("What does the Pi 5 run?", "The cluster's coordinator and the backups."),
]
ASK = (0, 4)  # the questions asked before and after
STAGE = "finetune-stage.json"
SKIPPED = "--quick: fine-tuning skipped (it takes about 45 s; `smoltrain demo` without --quick runs it)."


def folder(out: Path) -> Path:
    return out / "finetune"


def prepare(d: Path) -> tuple[Path, Path]:
    """The checkpoint and the chats, in the stage's folder."""
    from smoltrain.finetune.tinymodel import make_llama

    d.mkdir(parents=True, exist_ok=True)
    data = d / "chats.jsonl"
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in CHATS]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = Path(make_llama(str(d / "base"), corpus=[f"{q} {a}" for q, a in CHATS]))
    return model, data


def prompt_ids(model: Path, question: str) -> str:
    """The question rendered with the checkpoint's chat template and generation prompt, as token ids."""
    from smoltrain.infer.chat import Chat
    from smoltrain.models.hf import load_tokenizer

    tok = load_tokenizer(str(model))
    text, _ = Chat(str(model), tok).render_spans([{"role": "user", "content": question}], add_generation_prompt=True)
    return ",".join(str(i) for i in tok.encode(text, add_special_tokens=False).ids)


def pick(plan: dict) -> tuple[dict, dict] | None:
    """(the plan's fastest setup that fits, that strategy's plan) from `plan --strategy all`."""
    best = (plan.get("setups") or {}).get("best")
    chosen = [p for p in plan.get("plans") or [] if best and p["strategy"] == best["strategy"]]
    return (best, chosen[0]) if chosen else None


def run_args(chosen: dict) -> list:
    """The plan's choice as `run` flags: the strategy, its placement, diloco's H and sync dtype."""
    args = ["--strategy", chosen["strategy"], "--placement", chosen.get("placement_mode") or "even"]
    if chosen.get("outer"):
        args += ["--inner-steps", chosen["inner_steps"], "--sync-dtype", chosen.get("sync_dtype") or "fp32"]
    return args


def stages(demo, steps: int = STEPS) -> bool:
    """Plan, train, export and ask; leaves finetune/finetune-stage.json for the report. False when
    a command it needs failed (the demo then ends non-zero)."""
    from smoltrain.demo.stages import smol

    d, py, run = folder(demo.out), demo.py, demo.stages.run
    model, data = prepare(d)
    lora = ["--lora-rank", RANK, "--lora-targets", TARGETS]
    shape = ["--model", model, "--batch", BATCH, "--seq", SEQ]
    plan_json = d / "plan.json"
    if not run(
        f"17. plan: fine-tuning a Llama checkpoint with LoRA r={RANK} on every host (memory per rank)",
        smol(py, "smoltrain", "plan", "--strategy", "all", *demo.common(), *shape, *lora, "--no-what-if")
        + ["--json", plan_json],
        required=False,
    ):
        return False
    plan = json.loads(plan_json.read_text())
    if not pick(plan):
        why = "the fine-tuning plan names no setup that fits"
        demo.stages.results.append({"stage": "17. plan: a pick", "rc": 1, "seconds": 0, "ok": False, "why": why})
        return False
    best, chosen = pick(plan)
    ck, run_json, adapter = d / "checkpoints", d / "run.json", d / "adapter"
    got = run(
        f"18. train: {best['strategy']} with LoRA (the plan's pick) on the chats, {steps} steps",
        smol(py, "smoltrain", "run", *run_args(chosen), *demo.common(), *shape, *lora, "--data", data)
        + ["--lr", LR, "--steps", steps, "--checkpoint-dir", ck, "--json", run_json, "--out", d],
        required=False,
    )
    if got is None or not run_json.exists():
        return False
    if not run(
        "19. export: the adapter as a PEFT folder",
        smol(py, "smoltrain", "export", "--checkpoint-dir", ck) + ["--out", adapter],
        required=False,
    ):
        return False
    answers = []
    for i in ASK:
        q, ids = CHATS[i][0], prompt_ids(model, CHATS[i][0])
        row = {"question": q, "trained": CHATS[i][1]}
        for when, extra in (("before", []), ("after", ["--adapter", adapter])):
            gj = d / f"generate-{when}-{i}.json"
            got = run(
                f"20. generate: {q!r} {when} fine-tuning",
                smol(py, "smoltrain", "generate", "--local", "1", "--model", model, *extra, "--prompt-ids", ids)
                + ["--max-new-tokens", NEW_TOKENS, "--json", gj],
                required=False,
            )
            if got is None:
                return False
            row[when] = json.loads(gj.read_text())["text"]
        answers.append(row)
    r = json.loads(run_json.read_text())
    doc = {
        "plan": {
            "best": best,
            "single_host": plan["setups"].get("single_host"),
            "speedup": plan["setups"].get("speedup"),
        },
        "ranks": [{"name": k["name"], "device": k.get("device"), **k["memory"]} for k in chosen["ranks"]],
        "run": {
            "strategy": r["strategy"],
            "world_size": r["world_size"],
            "steps": len(r["steps"]),
            "first_loss": r["steps"][0]["loss"],
            "final_loss": r["final_loss"],
            "tokens_per_s": r.get("tokens_per_s"),
            "bytes": sum(b["bytes"] for b in r.get("bytes") or []),
            "model": r.get("model"),
            "trainable_params": r.get("trainable_params"),
            "lora": r.get("lora"),
        },
        "answers": answers,
    }
    (d / STAGE).write_text(json.dumps(doc, indent=1))
    return True


def _text(s: str) -> str:
    """An answer as one table cell: unprintable bytes as a dot, no pipes or newlines."""
    s = "".join(c if c.isprintable() else "·" for c in s).replace("|", "/").replace("`", "'")
    return f"`{s.strip()[:60]}`" if s.strip() else "(nothing)"


def section(out: Path, quick: bool) -> list[str]:
    """The report's section, from what the stage left (in --quick, a line saying it was skipped)."""
    from smoltrain.planner.bottleneck import human_bytes

    title = "## 9. Fine-tuning a Hugging Face checkpoint across the hosts (LoRA, the plan's pick)"
    p = folder(out) / STAGE
    if not p.exists():
        return [title, "", SKIPPED if quick else "**The fine-tuning stage did not finish (see the stages below).**", ""]
    s = json.loads(p.read_text())
    best, alone, run = s["plan"]["best"], s["plan"]["single_host"] or {}, s["run"]
    m = run.get("model") or {}
    lines = [
        title,
        "",
        f"A {m.get('arch', 'llama')} checkpoint made in the run folder ({m.get('params', 0):,} parameters; "
        "tokenizer trained by `tokenizers`, ChatML template), fine-tuned on "
        f"{len(CHATS)} house chats (`finetune/chats.jsonl`), LoRA r={RANK} on {TARGETS.replace(',', ', ')}, "
        f"batch {BATCH} x {SEQ}.",
        "",
        f"Plan (`plan --strategy all --model DIR --lora-rank {RANK}`): fastest setup that fits: **{best['strategy']}** "
        f"on {best['world']} ranks ({', '.join(best['hosts'])}), {best['tokens_per_s']:,.0f} tokens/s; "
        + (
            f"{s['plan']['speedup']:.2f}x the best single host, {alone['name']} alone "
            f"({alone['tokens_per_s']:,.0f} tokens/s)."
            if alone.get("tokens_per_s")
            else "no single host fits."
        ),
        "",
        "Memory per rank (the pick's plan):",
        "",
        "| rank | host | weights | grads | optimizer | activations | total | host memory | fits |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, k in enumerate(s["ranks"]):
        lines.append(
            f"| {i} | {k['name']} | {human_bytes(k['weights'])} | {human_bytes(k['grads'])} | "
            f"{human_bytes(k['optimizer'])} | {human_bytes(k['activations'])} | {human_bytes(k['total'])} | "
            f"{human_bytes(k['host_bytes'])} | {'yes' if k['fits'] else 'no'} |"
        )
    lines += [
        "",
        f"Trained: {run['strategy']} on {run['world_size']} ranks, {run['steps']} steps, "
        f"{run.get('trainable_params') or 0:,} trainable parameters (the adapters); loss {run['first_loss']:.3f} -> "
        f"{run['final_loss']:.3f}; {run.get('tokens_per_s') or 0:,.0f} tokens/s; {human_bytes(run['bytes'])} "
        "on the wire (adapters only). Exported as a PEFT adapter (`finetune/adapter`), answered by "
        "`generate --model base` without and with `--adapter` (greedy):",
        "",
        "| question | before | after | the chats' answer |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {a['question']} | {_text(a['before'])} | {_text(a['after'])} | {a['trained']} |" for a in s["answers"]
    ]
    return lines + [""]
