"""Fine-tuning setups for `smoltrain plan --model HF_DIR`: is the asked layout within every host's
memory (else it is refused: one line naming the host and the shortfall), and which setup, over the
strategies asked and full training or LoRA, is fastest among those that fit, against the best
single host alone (verdict.setups: the record; verdict.setups_sentence: the words).
"""

from __future__ import annotations

from dataclasses import replace

from smolnet.errors import UsageError
from smoltrain.planner import verdict
from smoltrain.planner.tuning import Tuning


def applies(req) -> bool:
    """A Hugging Face checkpoint, or any LoRA / quantised-base / checkpointing request, in train mode."""
    return req.mode == "train" and (bool(getattr(req.model, "source", "")) or req.tuning is not None)


def variants(tuning: Tuning | None) -> list[Tuning | None]:
    """The asked tuning and, under LoRA, full training with the same activation checkpointing."""
    if tuning is None or not tuning.lora:
        return [tuning]
    full = Tuning(checkpoint_activations=True) if tuning.checkpoint_activations else None
    return [tuning, full]


def review(doc: dict, req, setting) -> str:
    """Check and compare, in place: a single plan (`doc`) that does not fit is refused (UsageError,
    exit 2); `--strategy all` (`doc["plans"]`) is refused only when no plan fits. Adds
    doc["setups"] (verdict.setups) and returns its sentence."""
    from smoltrain.planner.request import build_plan

    plans = doc.get("plans") or [doc]
    if "plans" not in doc:
        short = verdict.shortfall(doc)
        if short:
            raise UsageError(verdict.refusal(doc, short))
    elif all(verdict.shortfall(p) for p in plans):
        p = min(plans, key=lambda p: verdict.shortfall(p)["short"])
        raise UsageError(verdict.refusal(p, verdict.shortfall(p)) + " (no strategy fits)")
    others = []
    for p in plans:
        for t in variants(req.tuning)[1:]:
            try:
                others.append(build_plan(replace(req, strategy=p["strategy"], tuning=t), setting))
            except UsageError:
                continue  # a strategy that cannot train this way
    doc["setups"] = verdict.setups(plans + others)
    return verdict.setups_sentence(doc["setups"])
