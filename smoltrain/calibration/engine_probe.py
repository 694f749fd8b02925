"""What one decode step costs a rank beyond its layers' work and its messages: the engine's own.

Every rank of a pp or tp decode pays it once per step, whatever its layers: the step run
through the real one-process engine (infer.engine.Engine.issue: the CPU accounting, the
stage's row bookkeeping, the embedding, final norm and head of a small model, the token
sampled from the logits), the step's header made and read back, and the hidden state put on
and taken off the wire (infer.activations.Codec), as a pp or tp rank does each step. Timed
at one thread, in CPU seconds times the host's pace (as decode_layer_s and comm_cpu are): on
a small model this, not its layers, is much of what a stage costs a token (BENCHMARKS:
0.07-0.135 ms a rank on the laptop, with its layers at 63 us each).
"""

from __future__ import annotations

ENGINE_HIDDEN = 64  # a small stage: what is timed is the per-step work, not weights read
ENGINE_VOCAB = 256
ENGINE_STEPS = 100  # steps per timed call
ENGINE_CALLS = 5  # calls timed, the median kept


class _Weights:
    """The few tensors a layer-less stage reads (its embedding, final norm and head), handed to
    models.stage.Stage as a checkpoint folder's index would be."""

    def __init__(self, torch, cfg):
        g = torch.Generator().manual_seed(0)
        self.config = cfg
        self.t = {
            "model.embed_tokens.weight": torch.randn(cfg.vocab, cfg.hidden, generator=g) * 0.02,
            "model.norm.weight": torch.ones(cfg.hidden),
            "lm_head.weight": torch.randn(cfg.vocab, cfg.hidden, generator=g) * 0.02,
        }

    def check(self, names) -> None:
        missing = set(names) - set(self.t)
        if missing:
            raise KeyError(f"engine probe lacks {sorted(missing)}")

    def read(self, name):
        return self.t[name]


def engine_step_s(torch, pace: float) -> float:
    """Seconds per decode step of the engine's own work on one rank (one row, greedy), at one thread."""
    from smoltrain import host
    from smoltrain.calibration.decode_probe import cpu_seconds
    from smoltrain.infer.activations import Codec
    from smoltrain.infer.batching import DECODE, Item, Request, slots_of
    from smoltrain.infer.engine import Engine
    from smoltrain.models.hf import HFConfig
    from smoltrain.models.stage import Stage

    threads = torch.get_num_threads()
    host.set_threads(1)
    try:
        cfg = HFConfig("llama", ENGINE_VOCAB, ENGINE_HIDDEN, 1, 4, 2, ENGINE_HIDDEN // 4, 2 * ENGINE_HIDDEN, 4096, 1e-5)
        stage = Stage(_Weights(torch, cfg), 0, 0, True, True, batched=False)
        engine = Engine(stage)
        engine.open(0, Request([1], ENGINE_STEPS * (ENGINE_CALLS + 1) + 1))
        codec = Codec("fp32", ENGINE_HIDDEN, torch.float32)
        x = torch.randn(1, 1, ENGINE_HIDDEN)
        item = Item(DECODE, [0], [[7]])

        def step():
            h = Engine.header(item)
            slots = slots_of(h.tolist()[1])
            buf = codec.buffer(len(slots))
            buf.copy_(codec.encode(x))
            codec.decode(buf)
            engine.issue(item)
            return engine.collect(item)

        def many():
            for _ in range(ENGINE_STEPS):
                step()

        return cpu_seconds(many, ENGINE_CALLS) / ENGINE_STEPS * pace
    finally:
        host.set_threads(threads)
