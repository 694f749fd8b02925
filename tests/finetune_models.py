"""Tiny fine-tuning checkpoints: transformers' random Llama/GPT-2 with the ChatML tokenizer and chat
templates of smoltrain/finetune/tinymodel.py (with or without `{% generation %}` markers)."""

from __future__ import annotations

import json
import os

from infer_models import make_checkpoint

from smoltrain.finetune.tinymodel import CHATML, MARKED, PLAIN, SPECIALS, make_tokenizer, write_tokenizer  # noqa: F401

CHATS = [
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello there, how are you?"},
        {"role": "assistant", "content": "I am fine. 🙂"},
        {"role": "user", "content": "And the fox?"},
        {"role": "assistant", "content": "The quick brown fox jumps over the lazy dog."},
    ],
    [{"role": "user", "content": "é ü ñ 日本"}, {"role": "assistant", "content": "today"}],
]


def make_finetune_checkpoint(
    path: str, arch: str = "llama", template: str | None = MARKED, layers: int = 2, ctx: int = 128, tied=False
):
    """A tiny transformers checkpoint with tokenizer.json and tokenizer_config.json (EOS <|im_end|>)."""
    tok = make_tokenizer()
    eos = tok.token_to_id("<|im_end|>")
    make_checkpoint(path, arch, layers=layers, vocab=tok.get_vocab_size(), eos=eos, ctx=ctx, tied=tied)
    if arch == "gpt2":  # make_checkpoint's GPT-2 keeps its own eos id: name ours
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        cfg["eos_token_id"] = eos
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f)
    write_tokenizer(path, tok, template, ctx)
    return path


def write_jsonl(path: str, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
    return path
