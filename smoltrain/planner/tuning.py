"""What a fine-tuning run trains and holds, as the planner counts it (CONTRACT 11).

Full training trains every parameter. Under LoRA only the adapters train: they alone carry
gradients and AdamW state, cross the wire (dp's all-reduce, diloco's outer step) and, under
tp, the uncut factor of each adapter (A of a column-parallel layer, B of a row-parallel one)
has a partial-sum gradient that tp all-reduces. The frozen base may sit at a narrower width
(`quantize`, QLoRA-style: the blocks' linear weights and an untied head int8 or q4 as
models.qlinear holds them, norms, biases and embeddings at the dtype; tp cannot cut such a
layer, so it is dp, mp, pp or diloco), and activation checkpointing keeps each layer's input
only and reruns its forward in backward.

A Tuning is torch-free: `smoltrain.finetune.tuning.describe` builds it from the checkpoint's
own layers (the model on the meta device with finetune.lora applied), so names, shapes and
counts are those the run trains.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from smolnet.errors import UsageError
from smoltrain import registry

LORA_STRATEGIES = registry.with_trait("adapters")  # the others move every parameter, frozen or not
# a quantised base keeps each layer whole: not tp, which cuts a layer's full-width weight by heads
QUANTIZED_STRATEGIES = tuple(s for s in LORA_STRATEGIES if registry.get(s).splits != "heads")


@dataclass(frozen=True)
class Adapter:
    """One adapted linear layer: lora_A (rank x fin) and lora_B (fout x rank)."""

    unit: int  # 0 the embeddings, 1..layers the blocks, layers + 1 the head
    name: str  # Hugging Face module name
    fin: int
    fout: int
    rank: int
    cut: str = ""  # tp: "col" (B cut by rows, A whole), "row" (A cut by columns, B whole), "" replicated
    pos: int = 0  # where the layer sits in the forward: 2i block i's attention, 2i + 1 its MLP, 2L the head

    @property
    def params(self) -> int:
        return self.rank * (self.fin + self.fout)

    @property
    def uncut(self) -> int:
        """tp: elements of the factor every rank holds whole, whose gradient is a partial sum."""
        return self.rank * self.fin if self.cut == "col" else self.fout * self.rank if self.cut == "row" else 0

    def held(self, share: float) -> float:
        """Elements a tp rank holding `share` of the layer keeps (the uncut factor whole)."""
        if not self.cut:
            return float(self.params)
        return self.uncut + (self.params - self.uncut) * share


@dataclass(frozen=True)
class Tuning:
    lora: dict | None = None  # finetune.lora.LoraConfig.to_dict(); None: full training
    adapters: tuple[Adapter, ...] = ()
    quantize: str | None = None  # the frozen base's format (int8, q4), LoRA only
    checkpoint_activations: bool = False

    def __post_init__(self):
        if self.quantize and not self.lora:
            raise UsageError(f"--quantize {self.quantize} in training quantises a frozen base: it needs --lora-rank")

    def trainable(self, model) -> int:
        """Parameters that train (and whose gradients are synchronised)."""
        return sum(a.params for a in self.adapters) if self.lora else model.params()

    def partial(self) -> int:
        """tp under LoRA: elements of the uncut factors, all-reduced once per step."""
        return sum(a.uncut for a in self.adapters) if self.lora else 0

    def backward_enters(self, layers: int) -> int:
        """tp: the all-reduces of input gradients in backward (one per attention and per MLP, where
        the cut layers' input gradient is a partial sum): every one under full training; under LoRA
        only those after the first adapted part, since nothing before it needs a gradient."""
        if not self.lora:
            return 2 * layers
        first = min((a.pos for a in self.adapters), default=2 * layers)
        return max(0, 2 * layers - 1 - first)

    def recompute_leaves(self, layers: int) -> int:
        """tp with checkpointing: forward all-reduces rerun in backward. A block's rerun stops once
        what backward needs is back (torch's early stop), so it redoes the attention's output
        all-reduce (the MLP norm's input) and not the MLP's; under LoRA only the blocks from the
        first adapted one on run backward at all."""
        if not self.checkpoint_activations:
            return 0
        if not self.lora:
            return layers
        return max(0, layers - min((a.pos for a in self.adapters), default=2 * layers) // 2)

    def check(self, strategy: str) -> None:
        if self.lora and strategy not in LORA_STRATEGIES:
            raise UsageError(f"LoRA trains with {', '.join(LORA_STRATEGIES)}, not {strategy}")
        if self.quantize and strategy not in QUANTIZED_STRATEGIES:
            raise UsageError(f"a quantised base trains with {', '.join(QUANTIZED_STRATEGIES)}, not {strategy}")

    def work(self, w, model):
        """The RankWork `w` (planner.capacity) as this tuning trains it: under LoRA the rank owns
        and trains only its adapters (every block has the same ones; the head's on the rank that
        computes the logits), its base has no weight gradients (backward computes the inputs'
        gradients only) and may be quantised; with checkpointing the activations kept are each
        layer's input and the forward runs twice."""
        ckpt = self.checkpoint_activations
        if ckpt:
            w = replace(w, recompute=True, saved_only=True)
        if not self.lora:
            return w
        blocks = sum(a.held(w.attn_share) for a in self.adapters if 1 <= a.unit <= model.layers)
        t = blocks * w.layers / model.layers
        t += sum(a.params for a in self.adapters if a.unit > model.layers) if w.logits else 0.0
        w = replace(w, params_owned=t, trainable=t, quantized_base=self.quantize)
        if self.quantize:  # quantised are the linear weights alone: a layer's norms and biases stay at the dtype
            w = replace(w, matmul_params=w.matmul_params - w.layers * (model.layer_params() - linear_weights(model)))
        return w

    def to_dict(self, model) -> dict:
        return {
            "lora": self.lora,
            "trainable_params": self.trainable(model),
            "quantize": self.quantize,
            "checkpoint_activations": self.checkpoint_activations,
        }


def linear_weights(model) -> int:
    """A layer's linear weights (q, k, v, o and the MLP's), without its norms and biases."""
    h = model.hidden
    return 2 * h * (model.q_dim + model.kv_dim) + (3 if model.gated_mlp else 2) * h * model.ffn * model.experts
