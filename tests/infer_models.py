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
    vocab: int = 97,
    eos=2,
    ctx: int = 64,
) -> str:
    """Save a tiny model (hidden 32, 4 heads; Llama with 2 kv heads) with safetensors; returns the folder."""
    import torch
    import transformers

    torch.manual_seed(seed)
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=ctx,
            rope_theta=rope_theta,
            tie_word_embeddings=tied,
            initializer_range=init,
            bos_token_id=1,
            eos_token_id=eos,
        )
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=vocab,
            n_embd=32,
            n_layer=layers,
            n_head=4,
            n_positions=ctx,
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


# Llama 3's chat template, as its tokenizer_config.json carries it, and a guard that uses raise_exception
LLAMA3_TEMPLATE = (
    "{% if messages[0]['role'] == 'tool' %}{{ raise_exception('a conversation cannot start with a tool message') }}"
    "{% endif %}"
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def checkpoints(root, prompt: list[int], new: int) -> dict:
    """A tiny 3-layer Llama and GPT-2 under `root`, each with transformers' greedy tokens: the
    module fixture of the inference tests."""
    return {
        arch: (path, reference(path, prompt, new))
        for arch in ("llama", "gpt2")
        for path in [make_checkpoint(str(root / arch), arch, layers=3)]
    }


def make_bytelevel_tokenizer():
    """A byte-level BPE tokenizer (300 tokens, Llama 3's special tokens), trained with `tokenizers`:
    multi-byte characters span several tokens, as in GPT-2's and Llama 3's tokenizers."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors, trainers
    from tokenizers import models as tm

    tok = Tokenizer(tm.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["Hello there, how are you today? I am fine.", "The quick brown fox jumps over the lazy dog."]
    corpus.append("é ü ñ 日本 🙂")
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus * 20, trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
    )
    return tok


def make_chat_checkpoint(path: str, layers: int = 2) -> str:
    """A tiny Llama with a byte-level BPE tokenizer and a Llama-3-style chat template in
    tokenizer_config.json; ends of sequence: end of text and end of turn."""
    import json

    tok = make_bytelevel_tokenizer()
    eos = [tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")]
    make_checkpoint(path, "llama", layers=layers, vocab=tok.get_vocab_size(), eos=eos, ctx=256)
    tok.save(os.path.join(path, "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "chat_template": LLAMA3_TEMPLATE,
        "model_max_length": 256,
    }
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    return path
