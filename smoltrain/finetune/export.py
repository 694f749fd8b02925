"""What a fine-tuning run leaves behind, in the forms the Hugging Face tools load.

- `write_full`: a transformers folder (the base's config.json, `model.safetensors`, and the
  base's tokenizer files and chat template) that `AutoModelForCausalLM.from_pretrained` and
  `AutoTokenizer.from_pretrained` load, and that `generate`/`serve --model` read.
- `write_adapter`: a PEFT adapter folder (`adapter_config.json`, `adapter_model.safetensors` with
  `base_model.model.` key names) that `peft.PeftModel.from_pretrained(base, DIR)` loads.
- `merged_state`: the base folder's tensors with an adapter folded in (PEFT's merge_and_unload),
  for `export --merge`.

A folder is written beside its destination and moved into place file by file (each an atomic
rename), so a failed export leaves no half-written file behind.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
SAFETENSORS_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


def _publish(staging: Path, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(staging.iterdir()):
        os.replace(f, out / f.name)
    staging.rmdir()
    return out


def _staging(out: Path) -> Path:
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def _write(out_dir: str, fill) -> Path:
    out = Path(out_dir).resolve()
    staging = _staging(out)
    try:
        fill(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return _publish(staging, out)


def write_full(out_dir: str, state: dict, base_dir: str, note: dict | None = None) -> Path:
    """A transformers folder of `state` (the base folder's tensor names) with the base's config and tokenizer."""
    from safetensors.torch import save_file

    def fill(d: Path):
        config = json.loads((Path(base_dir) / "config.json").read_text())
        dtypes = {str(t.dtype) for t in state.values() if t.is_floating_point()}
        if len(dtypes) == 1 and next(iter(dtypes)) in SAFETENSORS_DTYPES:
            dt = SAFETENSORS_DTYPES[next(iter(dtypes))]
            config["dtype" if "dtype" in config or "torch_dtype" not in config else "torch_dtype"] = dt
        if note:
            config["smoltrain"] = note
        (d / "config.json").write_text(json.dumps(config, indent=2))
        save_file(
            {k: v.detach().contiguous() for k, v in state.items()}, str(d / "model.safetensors"), {"format": "pt"}
        )
        copy_tokenizer(base_dir, d)

    return _write(out_dir, fill)


def copy_tokenizer(base_dir: str, out: Path) -> None:
    for name in TOKENIZER_FILES:
        src = Path(base_dir) / name
        if src.is_file():
            shutil.copyfile(src, out / name)


def adapter_config(lora_cfg, arch: str, base_dir: str, targets: list[str]) -> dict:
    """PEFT's LoraConfig as adapter_config.json writes it (what vLLM and llama.cpp's converter read too)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(Path(base_dir).resolve()),
        "r": lora_cfg.rank,
        "lora_alpha": lora_cfg.alpha,
        "lora_dropout": lora_cfg.dropout,
        "target_modules": sorted(targets),
        "fan_in_fan_out": arch == "gpt2",
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def peft_name(name: str, arch: str) -> str:
    """A layer's name in transformers' module tree: GPT-2's blocks sit under `transformer.`."""
    if arch == "gpt2" and not name.startswith(("transformer.", "lm_head")):
        return "transformer." + name
    return name


def write_adapter(out_dir: str, state: dict, lora_cfg, arch: str, base_dir: str) -> Path:
    """A PEFT adapter folder of `state` ({layer.lora_A.weight: tensor}, names as lora.adapter_state gives)."""
    from safetensors.torch import save_file

    targets = lora_cfg.targets_for(arch)

    def fill(d: Path):
        cfg = adapter_config(lora_cfg, arch, base_dir, list(targets))
        (d / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
        tensors = {"base_model.model." + peft_name(k, arch): v.detach().contiguous() for k, v in state.items()}
        save_file(tensors, str(d / "adapter_model.safetensors"), {"format": "pt"})

    return _write(out_dir, fill)


def merged_state(base_dir: str, adapter) -> dict:
    """Every tensor of the base folder, the adapted weights with the adapter (a folder or an
    adapter.Adapter) folded in: fp32 sum, stored at the base's dtype, as PEFT's merge does."""
    from safetensors import safe_open

    from smoltrain.finetune.adapter import AdaptedCheckpoint

    ckpt = AdaptedCheckpoint(base_dir, adapter)
    out = {}
    for key, (path, _, _) in ckpt.index.items():
        with safe_open(path, framework="pt") as f:
            t = f.get_tensor(key)
        name = key.removeprefix(ckpt.prefix) if key != "lm_head.weight" else key
        if name in ckpt.adapted:
            t = (t.float() + ckpt.delta(name)).to(t.dtype)
        out[key] = t
    return out


def export_checkpoint(ckpt_dir: str, found, out_dir: str, merge: bool) -> tuple[Path, str]:
    """A fine-tuning run's newest intact checkpoint (`found`, run.checkpoint.latest) as a full folder,
    a PEFT adapter folder, or (`merge`) the merged folder; returns (folder, what it is)."""
    from smolnet.errors import UsageError
    from smoltrain.finetune.lora import LoraConfig
    from smoltrain.infer.export import gather_units
    from smoltrain.models.causal import hf_name
    from smoltrain.models.hf import Checkpoint, CheckpointError
    from smoltrain.models.spec import ModelSpec

    meta = found.meta
    known = set(ModelSpec.__dataclass_fields__)
    spec = ModelSpec(**{k: v for k, v in meta["model_spec"].items() if k in known})
    lora_cfg = LoraConfig.from_dict(meta["lora"]) if meta.get("lora") else None
    if merge and lora_cfg is None:
        raise UsageError(f"{ckpt_dir}: --merge folds LoRA adapters into the base, and this run trained the full model")
    if meta.get("mesh"):
        raise UsageError(f"{ckpt_dir}: a --mesh {meta['mesh']} run; export reads the runs of one strategy")
    try:
        base = Checkpoint(spec.source)
    except CheckpointError as e:
        raise UsageError(f"{ckpt_dir}: the run's base checkpoint is gone or changed: {e}") from None
    cfg, n = base.config, spec.layers + 2
    step_dir = Path(ckpt_dir) / f"step-{found.step:06d}"
    if meta["strategy"] == "tp":
        units = tp_units(step_dir, meta, found.sha256, cfg)
    else:
        _, units = gather_units(step_dir, meta, found.sha256, spec)
    trained = {}
    for key, t in units.items():
        i, name = key.split(".", 2)[1:]
        if lora_cfg is not None and ".lora_" not in name:
            continue
        h = hf_name(cfg, int(i), name, n)
        if not (h == "lm_head.weight" and cfg.tied):
            trained[h] = t
    note = {k: meta.get(k) for k in ("strategy", "world_size", "seed", "step", "lora")}
    if lora_cfg is not None:
        from smoltrain.finetune.adapter import AdaptedCheckpoint, from_state

        if not trained:
            raise UsageError(f"{step_dir}: a LoRA run's checkpoint without adapters")
        adapter = from_state(trained, lora_cfg)
        try:
            AdaptedCheckpoint(spec.source, adapter)  # every adapter fits its layer's shape
        except CheckpointError as e:
            raise UsageError(f"{step_dir}: {e}") from None
        if merge:
            state = merged_state(spec.source, adapter)
            return write_full(out_dir, state, spec.source, note), "the merged model (base + LoRA)"
        return write_adapter(out_dir, trained, lora_cfg, cfg.arch, spec.source), "a PEFT LoRA adapter"
    state = {}
    for key, (_, shape, _) in base.index.items():
        name = key if key == "lm_head.weight" else key.removeprefix(base.prefix)
        t = trained.get(name)
        if t is None:
            raise UsageError(f"{step_dir}: the checkpoint lacks {name}")
        if tuple(t.shape) != shape and name == "wpe.weight":  # the run kept only the positions it trains
            import torch

            t = torch.cat([t, base.read(name)[t.shape[0] :].to(t.dtype)])
        if tuple(t.shape) != shape:
            raise UsageError(f"{step_dir}: {name} has shape {list(t.shape)}, the base's is {list(shape)}")
        state[key] = t
    return write_full(out_dir, state, spec.source, note), "the full fine-tuned model"


def tp_units(step_dir: Path, meta: dict, sha256: dict, cfg) -> dict:
    """`units.<i>.<name>` of a tp run of a Hugging Face model (`cfg`, its HFConfig), its ranks'
    slices joined in rank order along the dimension tp cut them (models.blocks.tp_windows: each
    rank holds a contiguous range of heads and MLP units, in each window a parameter is cut into,
    as GPT-2's c_attn in q, k and v); what every rank holds whole, or rank 0 alone, from rank 0."""
    import torch

    from smoltrain.models.blocks import make_block, tp_windows
    from smoltrain.run.checkpoint import load_part

    with torch.device("meta"):
        windows = tp_windows(make_block(cfg), (0, cfg.heads), (0, cfg.ffn))
    world, step, n_units = int(meta["world_size"]), int(meta["step"]), cfg.layers + 2
    parts = [load_part(step_dir.parent, step, f"rank{r}", sha256.get(f"rank{r}")) for r in range(world)]
    out = {}
    for key, t in parts[0].items():
        if not key.startswith("param."):
            continue
        i, name = key[len("param.") :].split(".", 1)
        if 0 < int(i) < n_units - 1 and name in windows:  # blocks only: the ends are whole
            dim, ranges = windows[name]
            pieces = [p[key].chunk(len(ranges), dim) for p in parts]  # each rank's share of each window
            t = torch.cat([torch.cat([x[w] for x in pieces], dim) for w in range(len(ranges))], dim)
        out[f"units.{i}.{name}"] = t
    return out
