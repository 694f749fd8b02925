"""A small Llama checkpoint made here, with no download: a byte-level BPE tokenizer trained by
`tokenizers` on the text it will see, a ChatML chat template, and random weights written under
the names and shapes a transformers Llama folder has (models.hf.expected_tensors), so `run`,
`plan`, `export`, `generate` and `serve --model` read it as any Hugging Face folder.

The demo fine-tunes one (smoltrain/demo/finetune.py) and the fine-tuning tests take their
tokenizer and templates from here (tests/finetune_models.py builds the weights with transformers
itself, as an independent reference).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

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

CORPUS = [
    "Hello there, how are you today? I am fine.",
    "The quick brown fox jumps over the lazy dog.",
    "é ü ñ 日本 🙂",
    "system user assistant terse",
]


def make_tokenizer(corpus: list[str] | None = None, vocab: int = 320):
    """Byte-level BPE (`vocab` tokens) with ChatML's special tokens, trained on a few sentences
    (CORPUS, then `corpus`): every byte stays representable, frequent words get their own token."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tm

    tok = Tokenizer(tm.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator((CORPUS + list(corpus or [])) * 20, trainer)
    return tok


def write_tokenizer(path: str, tok, template: str | None = MARKED, ctx: int = 128) -> None:
    """tokenizer.json and tokenizer_config.json (EOS <|im_end|>, the chat template) into `path`."""
    tok.save(os.path.join(path, "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "model_max_length": ctx}
    if template is not None:
        cfg["chat_template"] = template
    Path(path, "tokenizer_config.json").write_text(json.dumps(cfg))


def make_llama(
    path: str,
    corpus: list[str] | None = None,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    ctx: int = 128,
    vocab: int = 384,
    seed: int = 0,
    std: float = 0.15,
) -> str:
    """A random Llama folder (config.json, model.safetensors, tokenizer with a chat template).
    Weights are N(0, `std`), norms ones: a model that knows nothing, but whose frozen embeddings
    and head are wide enough (0.15, not transformers' 0.02) for LoRA adapters to steer its answers
    in a few dozen steps."""
    import torch
    from safetensors.torch import save_file

    from smoltrain.models.hf import expected_tensors, read_config

    tok = make_tokenizer(corpus, vocab)
    os.makedirs(path, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tok.get_vocab_size(),
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": ctx,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": tok.token_to_id("<|im_start|>"),
        "eos_token_id": tok.token_to_id("<|im_end|>"),
        "torch_dtype": "float32",
    }
    Path(path, "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(path, tok, MARKED, ctx)
    gen = torch.Generator().manual_seed(seed)
    state = {
        name: torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * std
        for name, shape in expected_tensors(read_config(path)).items()
    }
    save_file(state, os.path.join(path, "model.safetensors"), {"format": "pt"})
    return path
