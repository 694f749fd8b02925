"""`smoltrain export`: a `smoltrain run` checkpoint as a Hugging Face folder (generate, serve, transformers).

A run of a built-in model becomes a GPT-2 folder (infer.export); a fine-tuning run of a Hugging
Face checkpoint becomes a folder of the same architecture with the base's tokenizer and chat
template, or under LoRA a PEFT adapter folder, or with `--merge` the merged model (finetune.export).
"""

from __future__ import annotations


def add_arguments(p) -> None:
    p.add_argument("--checkpoint-dir", required=True, help="the --checkpoint-dir of a `smoltrain run` (newest step)")
    p.add_argument("--out", required=True, help="folder to write the model (or the LoRA adapter) into")
    p.add_argument("--merge", action="store_true", help="LoRA runs: write the base with the adapters folded in")


def run(args) -> int:
    from smolnet.errors import UsageError
    from smoltrain.infer.export import export, newest_intact

    found = newest_intact(args.checkpoint_dir)
    if (found.meta.get("model_spec") or {}).get("source"):
        from smoltrain.finetune.export import export_checkpoint

        out, what = export_checkpoint(args.checkpoint_dir, found, args.out, args.merge)
        print(f"exported {args.checkpoint_dir} (step {found.step}) as {what} in {out}")
        return 0
    if args.merge:
        raise UsageError("--merge folds LoRA adapters into a base model; this run trained a built-in model")
    out = export(args.checkpoint_dir, args.out, found)
    print(f"exported {args.checkpoint_dir} as a Hugging Face GPT-2 checkpoint in {out}")
    return 0
