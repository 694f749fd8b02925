"""`smoltrain export`: a `smoltrain run` checkpoint as a Hugging Face GPT-2 folder (generate, serve, transformers)."""

from __future__ import annotations


def add_arguments(p) -> None:
    p.add_argument("--checkpoint-dir", required=True, help="the --checkpoint-dir of a `smoltrain run` (newest step)")
    p.add_argument("--out", required=True, help="folder to write config.json, model.safetensors, tokenizer.json")


def run(args) -> int:
    from smoltrain.infer.export import export

    out = export(args.checkpoint_dir, args.out)
    print(f"exported {args.checkpoint_dir} as a Hugging Face GPT-2 checkpoint in {out}")
    return 0
