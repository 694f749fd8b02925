"""Tiny fine-tuning checkpoints: transformers' random Llama/GPT-2 with a ChatML tokenizer trained by
`tokenizers` here (no download) and a chat template, with or without `{% generation %}` markers."""

from __future__ import annotations

import json
import os

from infer_models import make_checkpoint

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML as SmolLM2 / Qwen2.5 write it; MARKED wraps the assistant's text and end of turn in
# {% generation %} (as TRL's *_training.jinja templates do)
CHATML = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}@@{{ message['content'] + '<|im_end|>\\n' }}##"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
MARKED = CHATML.replace("@@", "{% generation %}").replace("##", "{% endgeneration %}")
PLAIN = CHATML.replace("@@", "").replace("##", "")

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


def make_tokenizer():
    """Byte-level BPE (320 tokens) with ChatML's special tokens, trained on a few sentences."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tm

    tok = Tokenizer(tm.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["Hello there, how are you today? I am fine.", "The quick brown fox jumps over the lazy dog."]
    corpus += ["é ü ñ 日本 🙂", "system user assistant terse"]
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus * 20, trainer)
    return tok


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
    tok.save(os.path.join(path, "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "model_max_length": ctx}
    if template is not None:
        cfg["chat_template"] = template
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def write_jsonl(path: str, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
    return path
