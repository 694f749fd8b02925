"""A `smoltrain run` checkpoint as a Hugging Face GPT-2 checkpoint (what `transformers` and `generate` load).

The trained GPT maps onto GPT2LMHeadModel one to one: Conv1D weights are the
transposed Linear weights, q/k/v are concatenated into c_attn, the bias-free linears
get zero biases, the exact GELU becomes `activation_function: gelu`, and the untied
head of `tiny` becomes `tie_word_embeddings: false` with its own `lm_head.weight`.
Token ids are bytes, so a byte-level tokenizer.json is written beside it.

Readable checkpoints: strategies whose parts hold named parameters (dp: the whole model
on rank 0; mp and pp: one stage per rank).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from smolnet.errors import SmolError, UsageError
from smolnet.files import create_new


def newest_intact(root: str):
    """The newest checkpoint whose parts match complete.json's digests (run.checkpoint.latest),
    saying in one line which newer ones were skipped and why."""
    import sys

    from smoltrain.run import checkpoint

    if not sorted(Path(root).glob("step-*/complete.json")):
        raise UsageError(f"{root}: no complete checkpoint (step-*/complete.json) to export")
    found = checkpoint.latest(root, None, tidy=False)
    if found.skipped:
        print(f"export: {found.skipped_line().removeprefix('resume: ')}", file=sys.stderr)
    return found


def gather_units(step_dir: Path, meta: dict, sha256: dict | None = None, spec=None) -> dict:
    """`units.<i>.<name>` -> tensor for the whole model, from each rank's part (`spec`: the run's
    model where the checkpoint's name alone does not say it, as for a Hugging Face checkpoint)."""
    from smoltrain.models.spec import get_model
    from smoltrain.run.checkpoint import load_part

    strategy, world = meta["strategy"], int(meta["world_size"])
    sha = sha256 or {}  # checked again as each part is read: nothing changed since verification
    spec = spec or get_model(meta["model"])
    out = {}
    if strategy in ("dp", "diloco"):  # every rank holds the whole model (diloco: rank 0's weights)
        for k, v in load_part(step_dir.parent, int(meta["step"]), "rank0", sha.get("rank0")).items():
            if k.startswith("param.units."):
                out[k[len("param.") :]] = v
    elif strategy in ("mp", "pp"):
        parts = [load_part(step_dir.parent, int(meta["step"]), f"rank{r}", sha.get(f"rank{r}")) for r in range(world)]
        ranges = stage_units(parts, spec.layers + 2, step_dir)
        for r, part in enumerate(parts):
            for k, v in part.items():
                if k.startswith("param."):
                    j, rest = k[len("param.") :].split(".", 1)
                    out[f"units.{ranges[r][int(j)]}.{rest}"] = v
    else:
        raise UsageError(f"export reads dp, diloco, mp, pp (and a fine-tune's tp) checkpoints; this is {strategy}")
    return spec, out


def stage_units(parts: list[dict], n_units: int, where) -> list[range]:
    """The units each mp/pp stage held, read from its part (a stage numbers its units from 0, and the
    placement may cut the layers unevenly): all but the last stage hold up to their highest unit
    with a parameter (every block has one, trained or adapted); the last stage holds the rest."""
    counts = []
    for part in parts[:-1]:
        js = [int(k.split(".")[1]) for k in part if k.startswith("param.")]
        counts.append(max(js) + 1 if js else 0)
    counts.append(n_units - sum(counts))
    if min(counts) < 1:
        raise SmolError(f"{where}: cannot tell which layers each stage held (a stage's part has no parameters)")
    out, lo = [], 0
    for c in counts:
        out.append(range(lo, lo + c))
        lo += c
    return out


def to_gpt2(spec, units: dict) -> dict:
    import torch

    L, h = spec.layers, spec.hidden
    u = lambda n: units[n].float()  # noqa: E731
    sd = {"transformer.wte.weight": u("units.0.wte.weight"), "transformer.wpe.weight": u("units.0.wpe.weight")}
    for i in range(L):
        b, p = f"units.{i + 1}.", f"transformer.h.{i}."
        sd[p + "ln_1.weight"], sd[p + "ln_1.bias"] = u(b + "ln1.weight"), u(b + "ln1.bias")
        sd[p + "ln_2.weight"], sd[p + "ln_2.bias"] = u(b + "ln2.weight"), u(b + "ln2.bias")
        sd[p + "attn.c_attn.weight"] = torch.cat([u(b + f"attn.{x}.weight").t() for x in "qkv"], 1)
        sd[p + "attn.c_attn.bias"] = torch.zeros(3 * h)
        sd[p + "attn.c_proj.weight"], sd[p + "attn.c_proj.bias"] = u(b + "attn.out.weight").t(), torch.zeros(h)
        sd[p + "mlp.c_fc.weight"], sd[p + "mlp.c_fc.bias"] = u(b + "mlp.fc.weight").t(), torch.zeros(spec.ffn)
        sd[p + "mlp.c_proj.weight"], sd[p + "mlp.c_proj.bias"] = u(b + "mlp.proj.weight").t(), torch.zeros(h)
    hd = f"units.{L + 1}."
    sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"] = u(hd + "ln_f.weight"), u(hd + "ln_f.bias")
    if not spec.tied_embeddings:
        sd["lm_head.weight"] = u(hd + "lm_head.weight")
    return {k: v.contiguous() for k, v in sd.items()}


def byte_tokenizer():
    """Ids are bytes: a byte-level BPE without merges maps each byte to its own id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # the ByteLevel alphabet in byte order (the GPT-2 bytes_to_unicode table)
    order = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    table, n = {}, 0
    for b in range(256):
        if b in order:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    assert set(table.values()) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def export(ckpt_dir: str, out_dir: str, found=None) -> Path:
    found = found or newest_intact(ckpt_dir)
    meta = found.meta
    step_dir = Path(ckpt_dir) / f"step-{found.step:06d}"
    try:
        spec, units = gather_units(step_dir, meta, found.sha256)
        sd = to_gpt2(spec, units)
    except KeyError as e:
        raise SmolError(f"{step_dir}: checkpoint lacks tensor {e}") from None
    from safetensors.torch import save

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": spec.vocab,
        "n_embd": spec.hidden,
        "n_layer": spec.layers,
        "n_head": spec.heads,
        "n_positions": spec.ctx,
        "n_inner": spec.ffn,
        "activation_function": "gelu",
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": bool(spec.tied_embeddings),
        "dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": None,
        "smoltrain": {k: meta.get(k) for k in ("strategy", "world_size", "model", "seed", "step")},
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tmp = out / f"model.safetensors.tmp{os.getpid()}"
    with open(create_new(tmp), "wb") as f:  # never through a link planted at the temp name
        f.write(save(sd, metadata={"format": "pt"}))
    os.replace(tmp, out / "model.safetensors")
    byte_tokenizer().save(str(out / "tokenizer.json"))
    return out
