"""Tiny random Hugging Face checkpoints of every architecture `smoltrain run --model` trains,
made by transformers itself, each with a byte-level BPE tokenizer.json (tests/infer_models)."""

from __future__ import annotations

import functools
import os

from infer_models import make_bytelevel_tokenizer

tokenizer = functools.lru_cache(maxsize=1)(make_bytelevel_tokenizer)  # trained once per session

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def make(path: str, arch: str, layers: int = 2, tied: bool = False, seed: int = 0, ctx: int = 64) -> str:
    """hidden 32, 4 heads (2 kv heads but GPT-2), vocab of the tokenizer (300); Llama with Llama 3's
    rope scaling, Qwen2 with its q/k/v biases, Qwen3 with head_dim 16 (not hidden/heads) and q/k norms."""
    import torch
    import transformers as tf

    tok = tokenizer()
    vocab = tok.get_vocab_size()
    torch.manual_seed(seed)
    shape = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=ctx,
        tie_word_embeddings=tied,
        initializer_range=0.1,
        eos_token_id=1,
    )
    if arch == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**shape, rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE)))
    elif arch == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**shape, rope_theta=1e6))
    elif arch == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**shape, head_dim=16, rope_theta=1e6))
    elif arch == "gpt2":
        cfg = tf.GPT2Config(
            vocab_size=vocab,
            n_embd=32,
            n_layer=layers,
            n_head=4,
            n_positions=ctx,
            tie_word_embeddings=tied,
            bos_token_id=1,
            eos_token_id=1,
        )
        model = tf.GPT2LMHeadModel(cfg)
    else:
        raise ValueError(arch)
    with torch.no_grad():  # biases and norms away from their zeros and ones, so a dropped one shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    return path


TEXT = "Hello there, how are you today? I am fine.\nThe quick brown fox jumps over the lazy dog.\n" * 30


def llama_and_text(root) -> tuple[str, str]:
    """A small Llama checkpoint and a text file to train it on, both under `root`."""
    (root / "text.txt").write_text(TEXT)
    return make(str(root / "llama"), "llama"), str(root / "text.txt")
