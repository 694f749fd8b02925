"""A random-weight Hugging Face Llama checkpoint with a SentencePiece tokenizer, built here (never downloaded).

The tokenizer is trained on this Python's standard-library sources, so llama.cpp's
converter (which refuses tokenizer.json pre-tokenizers it does not know) accepts the
folder through tokenizer.model. Default shape: hidden 1024, 12 layers, 16 heads over 4 kv
heads, MLP 2816, vocabulary 8000, untied head: 152M parameters, 606 MB in fp32, so decode
reads far more than any cache holds.

    .venv/bin/python bench/llama_checkpoint.py /tmp/llama-152m
"""

from __future__ import annotations

import argparse
import json
import os


def train_tokenizer(folder: str, vocab: int) -> None:
    import sentencepiece as spm

    from smoltrain.models.data import load_corpus

    text = os.path.join(folder, "corpus.txt")
    with open(text, "wb") as f:
        f.write(load_corpus(None, 4 << 20))
    spm.SentencePieceTrainer.train(
        input=text,
        model_prefix=os.path.join(folder, "tokenizer"),
        vocab_size=vocab,
        model_type="bpe",
        byte_fallback=True,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        pad_id=-1,
        input_sentence_size=200000,
        shuffle_input_sentence=True,
        num_threads=1,
        minloglevel=2,
    )
    os.remove(text)
    os.remove(os.path.join(folder, "tokenizer.vocab"))


def build(
    folder: str,
    hidden: int = 1024,
    layers: int = 12,
    vocab: int = 8000,
    init: float = 0.02,
    ctx: int = 2048,
    tokenizer: bool = True,
    ffn: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    tied: bool = False,
) -> str:
    """The checkpoint folder (built once; reused when its config.json exists). `ffn`, `heads`,
    `kv_heads` and `tied` give another family's shape (SmolLM2-135M: 1536, 9, 3, tied); by
    default MLP 2.75 x hidden, heads of 64, a kv head per 256 of width, an untied head."""
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    import torch
    import transformers

    os.makedirs(folder, exist_ok=True)
    if tokenizer:
        train_tokenizer(folder, vocab)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn or int(hidden * 2.75),
        num_hidden_layers=layers,
        num_attention_heads=heads or hidden // 64,
        num_key_value_heads=kv_heads or max(1, hidden // 256),
        max_position_embeddings=ctx,
        tie_word_embeddings=tied,
        initializer_range=init,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = transformers.LlamaForCausalLM(cfg)
    model.train(False).save_pretrained(folder, safe_serialization=True)  # inference mode (no dropout)
    if tokenizer:
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False}, f)
    return folder


def params(folder: str) -> int:
    from smoltrain.models.hf import Checkpoint

    return sum(_numel(shape) for _, shape, _ in Checkpoint(folder).index.values())


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("folder")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=8000)
    a = p.parse_args()
    build(a.folder, a.hidden, a.layers, a.vocab)
    print(f"{a.folder}: {params(a.folder) / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
