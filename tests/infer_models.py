"""Tiny random-weight Hugging Face checkpoints, made by transformers itself, for the inference tests."""

from __future__ import annotations

import os


def make_checkpoint(
    path: str,
    arch: str,
    layers: int = 3,
    seed: int = 0,
    tied: bool = False,
    hidden: int = 32,
    init: float = 0.2,
    rope_theta: float = 5000.0,
) -> str:
    """Save a tiny model (hidden 32, 4 heads; Llama with 2 kv heads) with safetensors; returns the folder."""
    import torch
    import transformers

    torch.manual_seed(seed)
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=97,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            rope_theta=rope_theta,
            tie_word_embeddings=tied,
            initializer_range=init,
            bos_token_id=1,
            eos_token_id=2,
        )
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=97,
            n_embd=32,
            n_layer=layers,
            n_head=4,
            n_positions=64,
            initializer_range=1.0,
            bos_token_id=1,
            eos_token_id=2,
        )
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        raise ValueError(arch)
    model.eval()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def reference(path: str, prompt: list[int], new: int) -> list[int]:
    """transformers' own greedy generation of the checkpoint (new tokens only, no early stop)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    model.eval()
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()
