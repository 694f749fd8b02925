"""Decode on bench_compute's sims: pp and tp generate across each cluster's hosts and the
tokens/s they reach is held against the plan `generate` prints from the same links and
compute reports (issue 36: decode within 25% for pp and tp on the same clusters).

The model is tiny8, the one calibration times (its decode engine cost and messages are what
the plan's decode model adds up), exported once per bench as a Hugging Face folder on this
machine's file system, which the sim's hosts share. tp needs the rank count to divide tiny8's
4 heads; on 3, 5 or 6 hosts it is reported as not run, with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path

from common import PY
from compute_bars import within
from compute_sims import sh

DECODE = ("pp", "tp")
MODEL = "tiny8"
HEADS = 4
PROMPT_IDS = "1,2,3,4,5,6,7,8"
NEW_TOKENS = 48  # enough steps that the first token's warm-up is a small share of the rate
ROUNDS = 5  # one 48-token decode moved 0.78-1.43 of plan run to run on one home sim (infer.report.merge_rounds)


def checkpoint(d: Path) -> Path:
    """tiny8 after one training step from its seed, exported as a Hugging Face folder: the
    decode cost does not depend on what the weights learned."""
    ck, model = d / "decode-ck", d / f"{MODEL}-hf"
    sh(
        [PY, "-m", "smoltrain", "run", "--strategy", "dp", "--local", "1", "--model", MODEL, "--steps", "1"]
        + ["--batch", "8", "--checkpoint-dir", ck, "--json", d / "decode-ck.json", "--out", d]
    )
    sh([PY, "-m", "smoltrain", "export", "--checkpoint-dir", ck, "--out", model])
    return model


def run_decode(inv: Path, d: Path, model: Path, strategies=DECODE, rounds: int = ROUNDS) -> list[dict]:
    """Generate with each strategy across the cluster (placement auto) and compare tokens/s
    with its plan; one row per strategy: `pred` and `meas` in tokens/s (and each round's), or
    `error`/`skipped`."""
    world = len(json.loads((d / "links.json").read_text()).get("hosts", []))
    rows = []
    for s in strategies:
        if s == "tp" and HEADS % max(world, 1):
            rows.append({"strategy": s, "skipped": f"{MODEL}'s {HEADS} heads do not split over {world} ranks"})
            continue
        out = d / f"generate-{s}.json"
        r = sh(
            [PY, "-m", "smoltrain", "generate", "--strategy", s, "-i", inv, "--model", model]
            + ["--links", d / "links.json", "--compute", d / "compute.json", "--prompt-ids", PROMPT_IDS]
            + ["--max-new-tokens", NEW_TOKENS, "--rounds", rounds, "--ignore-eos", "--json", out],
            ok=(0, 1, 2, 4),
        )
        g = json.loads(out.read_text()) if out.exists() and r.returncode == 0 else None
        pred = ((g or {}).get("plan") or {}).get("tokens_per_s")
        meas = ((g or {}).get("decode") or {}).get("tokens_per_s")
        if not (pred and meas):
            why = ((r.stdout + r.stderr).strip().splitlines() or ["no report"])[-1]
            rows.append({"strategy": s, "error": (why if g is None else "no plan or no decode rate")[:120]})
            continue
        each = g["decode"].get("tokens_per_s_rounds") or [meas]
        row = {"strategy": s, "pred": pred, "meas": meas, "rounds": each, "order": g["placement"]["order"]}
        terms = g["decode"].get("vs_plan")  # each stage's and the rest's time a token against the plan
        if terms:
            row["terms"] = {
                "stages": {r["name"]: r["ratio"] for r in terms["ranks"]},
                "rest": terms["rest"]["ratio"],
                "outside": terms["outside"],
            }
        rows.append(row)
    return rows


def spread(r: dict) -> str:
    """A row's slowest and fastest round, each over the plan."""
    each = [x / r["pred"] for x in r.get("rounds") or [] if x]
    return f"{min(each):.2f}-{max(each):.2f}" if each else "-"


def lines(rows: list[dict]) -> list[str]:
    """The report's decode table for one scenario."""
    if not rows:
        return []
    out = [
        "",
        f"### decode: {MODEL}, {NEW_TOKENS} new tokens, {ROUNDS} rounds, placement auto",
        "",
        "| strategy | plan tok/s | measured tok/s | measured/plan | rounds/plan | within 25% | rank order "
        "| terms outside 25% (measured/plan) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "pred" not in r:
            out.append(f"| {r['strategy']} | - | - | - | - | - | {r.get('skipped') or r.get('error')} | - |")
            continue
        q = r["meas"] / r["pred"]
        out.append(
            f"| {r['strategy']} | {r['pred']:.1f} | {r['meas']:.1f} | {q:.2f} | {spread(r)} | "
            f"{'yes' if within(r) else 'no'} | "
            f"{' > '.join(r['order'])} | {', '.join((r.get('terms') or {}).get('outside') or []) or '-'} |"
        )
    return out
