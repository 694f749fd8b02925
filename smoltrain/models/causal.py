"""The trainable causal LM: Llama (and SmolLM2, Llama 3.x), Qwen2/2.5, Qwen3, GPT-2, and the built-in GPT.

One model for every strategy: `units` = `Embed`, one block per layer, `Head`, so mp/pp take a
run of units, fsdp each unit's parameters and tp the inside of each block (`Block.tp_slice`;
the built-in block through strategies.tp). A config picks the block: a Hugging Face
checkpoint's (models.hf.HFConfig) or the built-in shapes' (`tiny`, `tiny8`, a JSON shape:
models.gpt.config, arch "gpt": LayerNorm, learned positions, exact GELU, no linear biases,
its own short parameter names, which its checkpoints and export keep). The arithmetic is the
inference blocks' (models.llama: RMSNorm, RoPE tables with Llama 3 scaling, grouped-query
attention), written once more without KV caches or packed weights because training needs
plain parameters and autograd; both follow transformers number for number, and the tests
hold both to it.

Sub-module names inside a block are the checkpoint's (`self_attn.q_proj`, `mlp.gate_proj`,
GPT-2's `attn.c_attn`), so `hf_name` maps every parameter to its checkpoint key: what
LoRA targets and what export writes.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from smoltrain.models.hf import GELUS, Checkpoint, HFConfig
from smoltrain.models.llama import apply_rope, rms_norm, rope_table
from smoltrain.models.spec import ModelSpec


def _same(t):
    return t


def run_block(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`block.body(x)`, under activation checkpointing when `block.checkpoint` is set
    (--checkpoint-activations): autograd keeps the block's input only and reruns its forward
    (with the same RNG state) in backward; without grad (eval) it runs plainly."""
    if block.checkpoint and torch.is_grad_enabled():
        from torch.utils.checkpoint import checkpoint

        return checkpoint(block.body, x, use_reentrant=False)
    return block.body(x)


class Embed(nn.Module):
    """Token embeddings, plus learned positions where the model has them (GPT-2, the built-in GPT)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.wte = nn.Embedding(spec.vocab, spec.hidden)
        self.wpe = nn.Embedding(spec.ctx, spec.hidden) if spec.learned_pos else None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        return x


def _carry_adapters(part, whole, cuts: dict) -> None:
    """LoRA adapters of `whole`'s layers onto the tp slice `part` (finetune.lora.attach_like): a
    column-parallel layer's B cut by its output rows, a row-parallel layer's A by its input columns;
    the uncut factor then has a partial-sum gradient, which tp all-reduces (`partial_grads`)."""
    mods = dict(whole.named_modules())
    if any(hasattr(m, "lora_A") for m in mods.values()):
        from smoltrain.finetune.lora import attach_like

        dst = dict(part.named_modules())
        for name, (rows, cols) in cuts.items():
            if hasattr(mods[name], "lora_A"):
                attach_like(dst[name], mods[name], rows=rows, cols=cols)
                part.partial_grads.append(dst[name].lora_A.weight if cols is None else dst[name].lora_B.weight)
    frozen = {n for n, p in whole.named_parameters() if not p.requires_grad}  # the base, under LoRA
    for n, p in part.named_parameters():
        p.requires_grad_(n not in frozen)


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class Conv1D(nn.Module):
    """GPT-2's linear layer: weight stored [in, out] as in the checkpoint (and as PEFT expects)."""

    fan_in_fan_out = True  # PEFT's flag for a weight stored [in, out]

    def __init__(self, n_in: int, n_out: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features, self.nf = n_in, n_out, n_out
        self.weight = nn.Parameter(torch.zeros(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out)) if bias else None

    def forward(self, x):
        y = x @ self.weight
        return y if self.bias is None else y + self.bias


class LlamaAttention(nn.Module):
    def __init__(self, cfg: HFConfig, heads: int, kv_heads: int, o_bias: bool):
        super().__init__()
        h, hd = cfg.hidden, cfg.head_dim
        self.cfg, self.heads, self.kv_heads = cfg, heads, kv_heads
        bias = cfg.bias or cfg.qkv_bias
        self.q_proj = nn.Linear(h, heads * hd, bias=bias)
        self.k_proj = nn.Linear(h, kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(h, kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(heads * hd, h, bias=o_bias)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(hd, cfg.eps), RMSNorm(hd, cfg.eps)

    def forward(self, x):
        (B, T), hd, cfg = x.shape[:2], self.cfg.head_dim, self.cfg
        q = self.q_proj(x).view(B, T, self.heads, hd)
        k = self.k_proj(x).view(B, T, self.kv_heads, hd)
        v = self.v_proj(x).view(B, T, self.kv_heads, hd)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        scaling = tuple(cfg.rope_scaling) if cfg.rope_scaling else None
        cos, sin = rope_table(cfg.rope_theta, hd, T, torch.float32, str(x.device), scaling)
        cos, sin = cos.to(x.dtype)[:, None], sin.to(x.dtype)[:, None]
        q, k = apply_rope(q, cos, sin).transpose(1, 2), apply_rope(k, cos, sin).transpose(1, 2)
        a = F.scaled_dot_product_attention(
            q, k, v.transpose(1, 2), is_causal=True, enable_gqa=self.kv_heads != self.heads
        )
        return self.o_proj(a.transpose(1, 2).reshape(B, T, self.heads * hd))


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """A pre-norm block: `body` holds its maths; `enter`/`leave` are identities alone and tp's f/g
    all-reduces when sliced; forward goes through models.gpt.run_block (activation checkpointing)."""

    def __init__(self, cfg: HFConfig):
        super().__init__()
        self.cfg = cfg
        self.enter, self.leave = _same, _same
        self.checkpoint = False  # activation checkpointing (models.gpt.run_block)
        self.partial_grads: list[nn.Parameter] = []  # tp: replicated weights whose gradients need a sum

    def forward(self, x):
        return run_block(self, x)


class LlamaBlock(Block):
    def __init__(self, cfg: HFConfig, heads: int, kv_heads: int, ffn: int, o_bias: bool | None = None):
        super().__init__(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        self.self_attn = LlamaAttention(cfg, heads, kv_heads, cfg.bias if o_bias is None else o_bias)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        self.mlp = LlamaMLP(cfg.hidden, ffn)

    def body(self, x):
        x = x + self.leave(self.self_attn(self.enter(self.input_layernorm(x))))
        return x + self.leave(self.mlp(self.enter(self.post_attention_layernorm(x))))

    def tp_slice(self, heads: tuple[int, int], ffn: tuple[int, int], enter, leave, keep_bias: bool) -> LlamaBlock:
        """This rank's heads [lo, hi) (whole KV groups) and MLP units: q, k, v, gate, up by output
        rows, o and down by input columns; the o_proj bias only on the rank that keeps it (added once)."""
        cfg, hd = self.cfg, self.cfg.head_dim
        g = cfg.heads // cfg.kv_heads
        qs, ks, fs = slice(heads[0] * hd, heads[1] * hd), slice(heads[0] // g * hd, heads[1] // g * hd), slice(*ffn)
        part = LlamaBlock(cfg, heads[1] - heads[0], (heads[1] - heads[0]) // g, ffn[1] - ffn[0], cfg.bias and keep_bias)
        a, b = self.self_attn, part.self_attn
        rows = {"q_proj": qs, "k_proj": ks, "v_proj": ks}
        with torch.no_grad():
            for n, sl in rows.items():
                getattr(b, n).weight.copy_(getattr(a, n).weight[sl])
                if getattr(b, n).bias is not None:
                    getattr(b, n).bias.copy_(getattr(a, n).bias[sl])
            b.o_proj.weight.copy_(a.o_proj.weight[:, qs])
            if b.o_proj.bias is not None:
                b.o_proj.bias.copy_(a.o_proj.bias)
            if cfg.qk_norm:  # shared by every rank's heads: each rank's gradient is a partial sum
                b.q_norm.weight.copy_(a.q_norm.weight), b.k_norm.weight.copy_(a.k_norm.weight)
                part.partial_grads += [b.q_norm.weight, b.k_norm.weight]
            part.mlp.gate_proj.weight.copy_(self.mlp.gate_proj.weight[fs])
            part.mlp.up_proj.weight.copy_(self.mlp.up_proj.weight[fs])
            part.mlp.down_proj.weight.copy_(self.mlp.down_proj.weight[:, fs])
            part.input_layernorm.weight.copy_(self.input_layernorm.weight)
            part.post_attention_layernorm.weight.copy_(self.post_attention_layernorm.weight)
        cuts = {f"self_attn.{n}": (sl, None) for n, sl in rows.items()}
        cuts.update({"self_attn.o_proj": (None, qs), "mlp.down_proj": (None, fs)})
        cuts.update({"mlp.gate_proj": (fs, None), "mlp.up_proj": (fs, None)})
        _carry_adapters(part, self, cuts)
        part.enter, part.leave, part.checkpoint = enter, leave, self.checkpoint
        return part


class GPT2Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, head_dim: int, proj_bias: bool):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.c_attn = Conv1D(hidden, 3 * heads * head_dim)
        self.c_proj = Conv1D(heads * head_dim, hidden, bias=proj_bias)

    def forward(self, x):
        (B, T), n, hd = x.shape[:2], self.heads, self.head_dim
        q, k, v = (t.view(B, T, n, hd).transpose(1, 2) for t in self.c_attn(x).split(n * hd, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(a.transpose(1, 2).reshape(B, T, n * hd))


class GPT2MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int, act: str, proj_bias: bool):
        super().__init__()
        self.c_fc, self.c_proj, self.approx = Conv1D(hidden, ffn), Conv1D(ffn, hidden, bias=proj_bias), GELUS[act]

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approx))


class GPT2Block(Block):
    def __init__(self, cfg: HFConfig, heads: int, ffn: int, proj_bias: bool = True):
        super().__init__(cfg)
        self.ln_1 = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.attn = GPT2Attention(cfg.hidden, heads, cfg.head_dim, proj_bias)
        self.ln_2 = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.mlp = GPT2MLP(cfg.hidden, ffn, cfg.act, proj_bias)

    def body(self, x):
        x = x + self.leave(self.attn(self.enter(self.ln_1(x))))
        return x + self.leave(self.mlp(self.enter(self.ln_2(x))))

    def tp_slice(self, heads: tuple[int, int], ffn: tuple[int, int], enter, leave, keep_bias: bool) -> GPT2Block:
        """Megatron's split of GPT-2: c_attn's q, k, v columns of these heads, c_fc's columns, the
        rows of both c_proj; their biases on the rank that keeps them."""
        h, hd = self.cfg.hidden, self.cfg.head_dim
        c = slice(heads[0] * hd, heads[1] * hd)
        part = GPT2Block(self.cfg, heads[1] - heads[0], ffn[1] - ffn[0], keep_bias)
        with torch.no_grad():
            w, b = self.attn.c_attn.weight, self.attn.c_attn.bias
            part.attn.c_attn.weight.copy_(torch.cat([w[:, o + c.start : o + c.stop] for o in (0, h, 2 * h)], 1))
            part.attn.c_attn.bias.copy_(torch.cat([b[o + c.start : o + c.stop] for o in (0, h, 2 * h)]))
            part.attn.c_proj.weight.copy_(self.attn.c_proj.weight[c])
            part.mlp.c_fc.weight.copy_(self.mlp.c_fc.weight[:, slice(*ffn)])
            part.mlp.c_fc.bias.copy_(self.mlp.c_fc.bias[slice(*ffn)])
            part.mlp.c_proj.weight.copy_(self.mlp.c_proj.weight[slice(*ffn)])
            if keep_bias:
                part.attn.c_proj.bias.copy_(self.attn.c_proj.bias)
                part.mlp.c_proj.bias.copy_(self.mlp.c_proj.bias)
            for n in ("ln_1", "ln_2"):
                getattr(part, n).load_state_dict(getattr(self, n).state_dict())
        qkv = torch.cat([torch.arange(o + c.start, o + c.stop) for o in (0, h, 2 * h)])
        cuts = {"attn.c_attn": (qkv, None), "attn.c_proj": (None, c)}
        _carry_adapters(part, self, dict(cuts, **{"mlp.c_fc": (slice(*ffn), None), "mlp.c_proj": (None, slice(*ffn))}))
        part.enter, part.leave, part.checkpoint = enter, leave, self.checkpoint
        return part


class Attention(nn.Module):
    """The built-in GPT's causal self-attention over `heads` heads (tp builds it with a slice)."""

    def __init__(self, hidden: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.q = nn.Linear(hidden, inner, bias=False)
        self.k = nn.Linear(hidden, inner, bias=False)
        self.v = nn.Linear(hidden, inner, bias=False)
        self.out = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mix(x))

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        """Everything up to (not including) the output projection."""
        b, t, _ = x.shape
        split = lambda y: y.view(b, t, self.heads, self.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        return (att @ v).transpose(1, 2).reshape(b, t, self.heads * self.head_dim)


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc = nn.Linear(hidden, ffn, bias=False)
        self.proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class GPTBlock(Block):
    """The built-in GPT's block: GPT-2's pre-norm layout without linear biases, exact GELU."""

    def __init__(self, cfg: HFConfig):
        super().__init__(cfg)
        self.ln1 = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.attn = Attention(cfg.hidden, cfg.heads, cfg.head_dim)
        self.ln2 = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.mlp = MLP(cfg.hidden, cfg.ffn)

    def body(self, x):
        x = x + self.leave(self.attn(self.enter(self.ln1(x))))
        return x + self.leave(self.mlp(self.enter(self.ln2(x))))


class Head(nn.Module):
    """The final norm and the LM head (tied: the embedding table itself)."""

    def __init__(self, cfg: HFConfig):
        super().__init__()
        if cfg.family in ("gpt2", "gpt"):
            self.ln_f = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        else:
            self.norm = RMSNorm(cfg.hidden, cfg.eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, x):
        return self.lm_head(self.ln_f(x) if hasattr(self, "ln_f") else self.norm(x))


class CausalLM(nn.Module):
    """`units`: Embed, blocks, Head; `forward(ids)` -> logits [B, T, vocab]."""

    def __init__(self, cfg: HFConfig, spec: ModelSpec):
        super().__init__()
        self.cfg, self.spec = cfg, spec
        if cfg.family == "gpt2":
            blocks = [GPT2Block(cfg, cfg.heads, cfg.ffn) for _ in range(cfg.layers)]
        elif cfg.family == "gpt":
            blocks = [GPTBlock(cfg) for _ in range(cfg.layers)]
        else:
            blocks = [LlamaBlock(cfg, cfg.heads, cfg.kv_heads, cfg.ffn) for _ in range(cfg.layers)]
        self.units = nn.ModuleList([Embed(spec), *blocks, Head(cfg)])
        if cfg.tied:
            self.units[-1].lm_head.weight = self.units[0].wte.weight

    def forward(self, idx):
        x = idx
        for unit in self.units:
            x = unit(x)
        return x

    def hf_named_modules(self):
        """(checkpoint module name, module) of every sub-module of the blocks and ends, e.g.
        `model.layers.0.self_attn.q_proj` or GPT-2's `h.0.attn.c_attn`: what LoRA targets."""
        n = len(self.units)
        for i, unit in enumerate(self.units):
            for name, mod in unit.named_modules():
                if name:
                    yield hf_name(self.cfg, i, name + ".weight", n)[: -len(".weight")], mod

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return hf_state_dict(self)


def hf_name(cfg: HFConfig, unit: int, name: str, n_units: int) -> str:
    """The checkpoint key of parameter `name` of unit `unit` (without GPT-2's `transformer.` prefix)."""
    gpt2 = cfg.family == "gpt2"
    if unit == 0:
        table = "wte" if gpt2 else "model.embed_tokens"
        return table + name[3:] if name.startswith("wte") else name
    if unit == n_units - 1:
        if name.startswith("lm_head"):
            return name
        return name if gpt2 else "model." + name
    return f"h.{unit - 1}.{name}" if gpt2 else f"model.layers.{unit - 1}.{name}"


def hf_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """Every parameter under its checkpoint key (a tied head is the embedding: not repeated)."""
    out, n = {}, len(model.units)
    for i, unit in enumerate(model.units):
        for name, p in unit.named_parameters(remove_duplicate=False):
            if i == n - 1 and name == "lm_head.weight" and model.cfg.tied:
                continue
            out[hf_name(model.cfg, i, name, n)] = p
    return out


def trainable_params(spec: ModelSpec, lora: dict | None) -> int:
    """Parameters a run trains: all of them, or under LoRA the adapters alone, counted on a model
    built without memory (the meta device); finetune.lora raises on targets or ranks it cannot take."""
    if not lora:
        return spec.params()
    from smoltrain.finetune.lora import LoraConfig, apply
    from smoltrain.models.hf import read_config

    with torch.device("meta"):
        model = CausalLM(read_config(spec.source), spec)
    apply(model, LoraConfig.from_dict(lora), spec.arch, 0)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def build(spec: ModelSpec, quantize: str | None = None) -> CausalLM:
    """The checkpoint at `spec.source` as fp32 parameters (the master weights whatever its dtype);
    with `quantize` (QLoRA) the blocks' linear layers and an untied head are held quantised and
    frozen (models.qlinear), each quantised as it is read: the base is never whole at fp32."""
    ckpt = Checkpoint(spec.source)
    ckpt.check()
    if quantize:
        from smoltrain.models.qlinear import swap_in

        with torch.device("meta"):
            model = CausalLM(ckpt.config, spec)
        quantised = swap_in(model, quantize)
        model.to_empty(device="cpu")
        if ckpt.config.tied:  # to_empty gives each use of the shared table its own storage
            model.units[-1].lm_head.weight = model.units[0].wte.weight
    else:
        model, quantised = CausalLM(ckpt.config, spec), {}
    with torch.no_grad():
        for key, p in hf_state_dict(model).items():
            t = ckpt.read(key).float()
            if ckpt.config.family == "gpt2" and key == "wpe.weight":
                t = t[: p.shape[0]]
            p.copy_(t)
        for key, layer in quantised.items():
            layer.load(ckpt.read(key))
    if quantize:
        model.requires_grad_(False)  # frozen until LoRA adds what trains
    return model
