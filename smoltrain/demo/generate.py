"""The demo's last act: a model trained on prose goes on the share and generates across the hosts.

Stages (plain command lines, like the rest): train `tiny8` on a paragraph of English
(smoltrain/demo/corpus.txt) until it can write it back, with checkpoints; `smoltrain export`
as a Hugging Face GPT-2 folder onto the model share (the inventory's `nfs_mount_dir` when
mounted here, else a folder beside the report: the sim's hosts share this machine's file
system); then `smoltrain generate` with pp and tp across the hosts, placed by measured speed
(`--placement auto`, the decode rule: least sum of stage compute and hops) and planned on the
same compute report. A 1M-parameter model trained for a minute learns a paragraph, not a
language: what the text shows is that a model split over the hosts still writes words it
learned (a broken split would not), where the old demo's model, trained a few steps on Python
sources, printed spaces.

The training runs as one process on this machine: the sim's hosts are slices of a few cores,
and the cluster's training was checked against its plan in the sections before.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from smoltrain.demo.stages import smol

MODEL = "tiny8"  # 8 layers and 4 heads: pp and tp both split over the demo's 4 hosts
STEPS, QUICK_STEPS = 400, 100  # loss ~0.25 (it writes the paragraph back) and ~1.5 (words, some garbled)
BATCH, SEQ, LR = 32, 32, "1e-3"
CORPUS = Path(__file__).with_name("corpus.txt")
PROMPT = "The cluster "
NEW_TOKENS = 32
ROUNDS = 5  # one 32-token decode on the capped sim lasts a few of the Pi's CFS periods; its rate swings (merge_rounds)


def describe(quick: bool = False) -> str:
    return (
        f"{MODEL} trained {QUICK_STEPS if quick else STEPS} steps of batch {BATCH} x {SEQ} on a paragraph of prose; "
        f"greedy from {PROMPT.strip()!r}, {NEW_TOKENS} tokens" + ("" if quick else f", decode over {ROUNDS} rounds")
    )


def model_dir(inv: Path, out: Path) -> Path:
    try:
        from smolnet.inventory import load_inventory

        share = Path(load_inventory(str(inv)).nfs_mount_dir)
        if os.path.ismount(share) and os.access(share, os.W_OK):
            return share / "smoltrain-demo"
    except Exception:  # the share is optional: fall back to a shared local path
        pass
    return demo_dir(out) / "model-share"


def demo_dir(out: Path) -> Path:
    return out / "generate"  # its own folder: the training sections' run-*.json and PNGs stay as they are


def stages(demo) -> None:
    gen, py = demo_dir(demo.out), demo.py
    ck, model = gen / "checkpoints", model_dir(demo.inv, demo.out)
    steps = QUICK_STEPS if demo.args.quick else STEPS
    run = demo.stages.run
    run(
        f"10. train {MODEL} on a paragraph of prose, {steps} steps, with checkpoints",
        smol(py, "smoltrain", "run", "--strategy", "dp", "--local", "1", "--model", MODEL, "--data", CORPUS)
        + ["--steps", steps, "--batch", BATCH, "--seq", SEQ, "--lr", LR, "--checkpoint-dir", ck]
        + ["--json", gen / "train.json", "--out", gen],
        timeout=1800,
    )
    run(
        "11. export: the trained model as a Hugging Face checkpoint on the share",
        smol(py, "smoltrain", "export", "--checkpoint-dir", ck, "--out", model),
    )
    world = len(json.loads(demo.links.read_text()).get("hosts", []))
    for strat in ("pp", "tp"):
        if strat == "tp" and 4 % max(world, 1):
            continue  # tiny8's 4 heads do not split over this many hosts
        run(
            f"12. generate: {strat} across the cluster from the share",
            smol(py, "smoltrain", "generate", "--strategy", strat, "-i", demo.inv, "--model", model)
            + [
                "--links",
                demo.links,
                "--compute",
                demo.compute,
                "--prompt",
                PROMPT,
                "--max-new-tokens",
                NEW_TOKENS,
                "--rounds",
                1 if demo.args.quick else ROUNDS,  # the quick demo checks the flow, not the rate
                "--ignore-eos",
            ]
            + ["--json", gen / f"generate-{strat}.json"],
            required=False,
        )
