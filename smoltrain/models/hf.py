"""Reading a Hugging Face checkpoint folder: config.json, *.safetensors, optional tokenizer.json.

Only the safetensors headers are read up front (names, shapes, dtypes), so the
controller can check the whole checkpoint before any rank starts; each rank then
reads just its own layers (and, under tp, just its own slice of each matrix)
through safetensors' lazy `safe_open`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from smolnet.errors import SmolError

DTYPES = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}
GELUS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}
TORCH_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


class CheckpointError(SmolError):
    """A checkpoint folder that is missing, of an unknown architecture, or not what its config says."""


@dataclass(frozen=True)
class HFConfig:
    arch: str  # "llama", "qwen2", "qwen3" or "gpt2"
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    ctx: int
    eps: float
    rope_theta: float = 10000.0
    tied: bool = True
    dtype: str = "fp32"
    bias: bool = False  # llama attention_bias
    eos: int | None = None
    name: str = ""
    act: str = "silu"  # gpt2: gelu_new (tanh) or gelu (exact)
    qkv_bias: bool = False  # qwen2: biases on q, k, v only (none on o_proj)
    qk_norm: bool = False  # qwen3: RMSNorm over each head of q and k, before RoPE
    rope_scaling: tuple | None = None  # llama3: (factor, low_freq_factor, high_freq_factor, original_max)

    @property
    def family(self) -> str:
        """The block code an arch runs: qwen2 and qwen3 are Llama blocks with biases or q/k norms
        ("gpt": the built-in shapes' own block, models.gpt.config, training only)."""
        return self.arch if self.arch in ("gpt2", "gpt") else "llama"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> HFConfig:
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = tuple(d["rope_scaling"])
        return cls(**d)

    def spec(self):
        """The planner's ModelSpec of this checkpoint (for the `--mode infer` plan)."""
        from smoltrain.models.spec import ModelSpec

        return ModelSpec(
            self.name or self.arch,
            vocab=self.vocab,
            layers=self.layers,
            hidden=self.hidden,
            heads=self.heads,
            kv_heads=self.kv_heads,
            ffn=self.ffn,
            ctx=self.ctx,
            tied_embeddings=self.tied,
            gated_mlp=self.family == "llama",
            learned_pos=self.arch == "gpt2",
            arch=self.arch,
            head_size=self.head_dim,
            qkv_bias=self.bias or self.qkv_bias,
            o_bias=self.bias,
            qk_norm=self.qk_norm,
        )


def _first_eos(v):
    if isinstance(v, list):
        return int(v[0]) if v else None
    return int(v) if isinstance(v, int) else None


def read_config(model_dir: str) -> HFConfig:
    """The checkpoint's config, its shapes checked (check_shapes) before anything uses them."""
    cfg = _parse_config(model_dir)
    check_shapes(cfg, Path(model_dir) / "config.json")
    return cfg


def check_shapes(cfg: HFConfig, path) -> None:
    """Sizes a kernel divides or indexes by: the one-row attention maps q head h to kv head
    h // (heads // kv_heads), so anything but 0 < kv_heads <= heads, heads % kv_heads == 0 would
    divide by zero or read past the cache."""
    sizes = {"vocab": cfg.vocab, "hidden": cfg.hidden, "layers": cfg.layers, "heads": cfg.heads}
    sizes.update(kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, ffn=cfg.ffn, ctx=cfg.ctx)
    bad = next((k for k, v in sizes.items() if not isinstance(v, int) or v <= 0), None)
    if bad:
        raise CheckpointError(f"{path}: {bad} is {sizes[bad]}; it must be a positive integer")
    if cfg.kv_heads > cfg.heads or cfg.heads % cfg.kv_heads:
        raise CheckpointError(f"{path}: {cfg.kv_heads} kv heads must divide the {cfg.heads} attention heads")
    if cfg.family == "gpt2" and cfg.heads * cfg.head_dim != cfg.hidden:
        raise CheckpointError(f"{path}: hidden size {cfg.hidden} is not a multiple of {cfg.heads} heads")


def _parse_config(model_dir: str) -> HFConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: no config.json (is this a Hugging Face checkpoint folder?)")
    try:
        c = json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{path}: not JSON: {e}") from None
    kind = c.get("model_type")
    dtype = TORCH_DTYPES.get(str(c.get("dtype") or c.get("torch_dtype") or "float32"), "fp32")
    name = Path(model_dir).resolve().name
    try:
        if kind in LLAMA_LIKE:
            return _llama_like(kind, c, path, dtype, name)
        if kind == "gpt2":
            for field, plain in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False)):
                if bool(c.get(field, plain)) != plain:
                    raise CheckpointError(f"{path}: {field} {c[field]} is not supported ({plain} only)")
            if c.get("reorder_and_upcast_attn"):
                raise CheckpointError(f"{path}: reorder_and_upcast_attn is not supported")
            h, heads = int(c["n_embd"]), int(c["n_head"])
            return HFConfig(
                "gpt2",
                vocab=int(c["vocab_size"]),
                hidden=h,
                layers=int(c["n_layer"]),
                heads=heads,
                kv_heads=heads,
                head_dim=h // heads,
                ffn=int(c.get("n_inner") or 4 * h),
                ctx=int(c["n_positions"]),
                eps=float(c.get("layer_norm_epsilon", 1e-5)),
                tied=bool(c.get("tie_word_embeddings", True)),
                dtype=dtype,
                bias=True,
                eos=_first_eos(c.get("eos_token_id")),
                name=name,
                act=str(c.get("activation_function", "gelu_new")),
            )
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise CheckpointError(f"{path}: missing or bad field {e}") from None
    raise CheckpointError(f"{path}: unknown architecture {kind!r} (supported: llama, qwen2, qwen3, gpt2)")


LLAMA_LIKE = ("llama", "qwen2", "qwen3")


def _rope(c: dict, path) -> tuple[float, tuple | None]:
    """theta and the llama3 frequency scaling; any other rope type is named and refused."""
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    if kind in ("default", None):
        return theta, None
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return theta, tuple(float(rope[k]) for k in keys)
    raise CheckpointError(f"{path}: rope scaling type {kind!r} is not supported (default, llama3)")


def _check_full_attention(c: dict, path) -> None:
    """Sliding-window attention (Qwen's use_sliding_window, Mistral's window) is refused by name."""
    types = c.get("layer_types")
    if types and any(t != "full_attention" for t in types):
        bad = sorted({t for t in types if t != "full_attention"})
        raise CheckpointError(f"{path}: layer_types {bad} are not supported (full_attention only)")
    if c.get("use_sliding_window") or (c.get("sliding_window") is not None and "use_sliding_window" not in c):
        raise CheckpointError(f"{path}: sliding_window {c.get('sliding_window')} is not supported (full attention)")


def _llama_like(kind: str, c: dict, path, dtype: str, name: str) -> HFConfig:
    heads = int(c["num_attention_heads"])
    theta, scaling = _rope(c, path)
    _check_full_attention(c, path)
    if c.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: hidden_act {c.get('hidden_act')!r} is not supported (silu)")
    if kind == "llama" and c.get("mlp_bias"):
        raise CheckpointError(f"{path}: mlp_bias is not supported")
    return HFConfig(
        kind,
        vocab=int(c["vocab_size"]),
        hidden=int(c["hidden_size"]),
        layers=int(c["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
        ffn=int(c["intermediate_size"]),
        ctx=int(c["max_position_embeddings"]),
        eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        tied=bool(c.get("tie_word_embeddings", False)),
        dtype=dtype,
        bias=bool(c.get("attention_bias", False)) and kind != "qwen2",
        eos=_first_eos(c.get("eos_token_id")),
        name=name,
        qkv_bias=kind == "qwen2",
        qk_norm=kind == "qwen3",
        rope_scaling=scaling,
    )


def expected_tensors(cfg: HFConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model reads, by its checkpoint name (without a `transformer.` prefix), with its shape."""
    h, f, q, kv = cfg.hidden, cfg.ffn, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    out: dict[str, tuple[int, ...]] = {}
    if cfg.family == "llama":
        out["model.embed_tokens.weight"] = (cfg.vocab, h)
        for i in range(cfg.layers):
            p = f"model.layers.{i}."
            out.update(
                {
                    p + "self_attn.q_proj.weight": (q, h),
                    p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h),
                    p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_proj.weight": (f, h),
                    p + "mlp.up_proj.weight": (f, h),
                    p + "mlp.down_proj.weight": (h, f),
                    p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,),
                }
            )
            if cfg.bias or cfg.qkv_bias:
                out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,)})
                out[p + "self_attn.v_proj.bias"] = (kv,)
            if cfg.bias:
                out[p + "self_attn.o_proj.bias"] = (h,)
            if cfg.qk_norm:
                out.update(
                    {p + "self_attn.q_norm.weight": (cfg.head_dim,), p + "self_attn.k_norm.weight": (cfg.head_dim,)}
                )
        out["model.norm.weight"] = (h,)
        if not cfg.tied:
            out["lm_head.weight"] = (cfg.vocab, h)
    else:
        out["wte.weight"] = (cfg.vocab, h)
        out["wpe.weight"] = (cfg.ctx, h)
        for i in range(cfg.layers):
            p = f"h.{i}."
            out.update(
                {
                    p + "ln_1.weight": (h,),
                    p + "ln_1.bias": (h,),
                    p + "ln_2.weight": (h,),
                    p + "ln_2.bias": (h,),
                    p + "attn.c_attn.weight": (h, 3 * h),
                    p + "attn.c_attn.bias": (3 * h,),
                    p + "attn.c_proj.weight": (h, h),
                    p + "attn.c_proj.bias": (h,),
                    p + "mlp.c_fc.weight": (h, f),
                    p + "mlp.c_fc.bias": (f,),
                    p + "mlp.c_proj.weight": (f, h),
                    p + "mlp.c_proj.bias": (h,),
                }
            )
        out["ln_f.weight"] = (h,)
        out["ln_f.bias"] = (h,)
        if not cfg.tied:
            out["lm_head.weight"] = (cfg.vocab, h)
    return out


class Checkpoint:
    """The tensor index of a checkpoint folder: name -> (file, shape, dtype), from the headers only."""

    def __init__(self, model_dir: str):
        self.dir = str(model_dir)
        self.config = read_config(model_dir)
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{model_dir}: no *.safetensors files")
        from safetensors import safe_open

        self.index: dict[str, tuple[str, tuple[int, ...], str]] = {}
        for fp in files:
            try:
                # numpy: the headers alone are read, and the controller need not import torch
                with safe_open(str(fp), framework="numpy") as f:
                    for k in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                        sl = f.get_slice(k)
                        if k in self.index:  # which copy a rank read would depend on the file order
                            raise CheckpointError(f"{fp}: tensor {k} is also in {self.index[k][0]}")
                        self.index[k] = (str(fp), tuple(sl.get_shape()), sl.get_dtype())
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(f"{fp}: not a readable safetensors file: {e}") from None
        self.prefix = "transformer." if self.config.arch == "gpt2" and "transformer.wte.weight" in self.index else ""

    def key(self, name: str) -> str:
        return name if name == "lm_head.weight" else self.prefix + name

    def check(self, names=None) -> None:
        """Name, shape and dtype of every tensor the model needs; raises CheckpointError naming the first miss."""
        if self.config.arch == "gpt2" and self.config.act not in GELUS:
            raise CheckpointError(f"{self.dir}: activation {self.config.act!r} is not supported ({', '.join(GELUS)})")
        want = expected_tensors(self.config)
        dtypes = set()
        for name, shape in want.items():
            if names is not None and name not in names:
                continue
            got = self.index.get(self.key(name))
            if got is None:
                raise CheckpointError(f"{self.dir}: missing tensor {self.key(name)}")
            if got[1] != shape:
                raise CheckpointError(
                    f"{self.dir}: tensor {self.key(name)} has shape {list(got[1])}, config.json implies {list(shape)}"
                )
            if got[2] not in DTYPES:
                raise CheckpointError(
                    f"{self.dir}: tensor {self.key(name)} has dtype {got[2]} (supported: {', '.join(DTYPES)})"
                )
            dtypes.add(got[2])
        if len(dtypes) > 1:
            raise CheckpointError(f"{self.dir}: tensors of mixed dtypes {sorted(dtypes)}")

    def read(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None):
        """One tensor, or only a [rows, cols] window of it (read lazily from disk)."""
        from safetensors import safe_open

        key = self.key(name)
        if key not in self.index:
            raise CheckpointError(f"{self.dir}: missing tensor {key}")
        with safe_open(self.index[key][0], framework="pt") as f:
            sl = f.get_slice(key)
            if rows is None and cols is None:
                return sl[:]
            r = slice(*rows) if rows else slice(None)
            if len(self.index[key][1]) == 1:
                return sl[r]
            return sl[r, slice(*cols) if cols else slice(None)]


def load_tokenizer(model_dir: str):
    """The checkpoint's tokenizer.json through `tokenizers`, or None when the folder has none."""
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as e:
        raise CheckpointError(f"{path}: not a tokenizer: {e}") from None
