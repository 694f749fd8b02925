"""The demo's last act: the model it trained goes on the share and generates across the cluster.

Stages (plain command lines, like the rest of the demo): a short dp run of tiny8 that checkpoints,
`smoltrain export` of it as a Hugging Face GPT-2 folder onto the model share (the
inventory's `nfs_mount_dir` when it is mounted here, else a folder beside the report:
the sim's hosts share this machine's file system), then `smoltrain generate` with pp and
tp across the hosts. REPORT.md gains a table of predicted vs measured decode tokens/s
and bytes per token.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from smoltrain.models.spec import get_model

MODEL = "tiny8"  # 8 layers and 4 heads: pp and tp both split over the demo's 4 hosts


def model_dir(inv: Path, out: Path) -> Path:
    try:
        from smolnet.inventory import load_inventory

        share = Path(load_inventory(str(inv)).nfs_mount_dir)
        if os.path.ismount(share) and os.access(share, os.W_OK):
            return share / "smoltrain-demo"
    except Exception:  # the share is optional: fall back to a shared local path
        pass
    return out / "model-share"


def generate_stages(stage, py: str, inv: Path, out: Path, steps: str, report: Path | None = None) -> list[dict]:
    gen = out / "generate"  # its own folder: the training sections' run-*.json and PNGs stay as they are
    ck, model = gen / "checkpoints", model_dir(inv, out)
    stage.run(
        "10. train with checkpoints: dp across the cluster",
        [
            py,
            "-m",
            "smoltrain",
            "run",
            "--strategy",
            "dp",
            "-i",
            str(inv),
            "--model",
            MODEL,
            "--steps",
            steps,
            "--checkpoint-dir",
            str(ck),
            "--json",
            str(gen / "train.json"),
            "--out",
            str(gen),
        ],
        timeout=900,
    )
    stage.run(
        "11. export: the trained model as a Hugging Face checkpoint on the share",
        [py, "-m", "smoltrain", "export", "--checkpoint-dir", str(ck), "--out", str(model)],
    )
    world = len(json.loads((gen / "train.json").read_text()).get("hosts", []))
    rows = []
    for strat in ("pp", "tp"):
        if strat == "tp" and get_model(MODEL).heads % max(world, 1):
            continue  # the heads do not split over this many hosts
        rep = gen / f"generate-{strat}.json"
        stage.run(
            f"12. generate: {strat} across the cluster from the share",
            [
                py,
                "-m",
                "smoltrain",
                "generate",
                "--strategy",
                strat,
                "-i",
                str(inv),
                "--model",
                str(model),
                "--prompt",
                "def main():",
                "--max-new-tokens",
                "32",
                "--ignore-eos",
                "--json",
                str(rep),
            ],
        )
        rows.append(json.loads(rep.read_text()))
    if report is not None and rows:
        with open(report, "a") as f:
            f.write(
                "\n## Generation across the cluster (the trained model, from the share)\n\n"
                "| strategy | hosts | decode tok/s (plan) | B/token (plan) | ttft ms | text |\n|---|---|---|---|---|---|\n"  # noqa: E501
            )
            for d in rows:
                p = d.get("plan") or {}
                f.write(
                    f"| {d['strategy']} | {d['world_size']} | {d['decode']['tokens_per_s'] or 0:,.1f} "
                    f"({p.get('tokens_per_s') or 0:,.1f}) | {d['decode']['bytes_per_token'] or 0:,.0f} "
                    f"({p.get('bytes_per_token') or 0:,.0f}) | {d['ttft_s'] * 1e3:.0f} | "
                    f"`{(d.get('text') or '').replace('|', ' ').replace(chr(10), ' ')[:40]}` |\n"
                )
    return rows
