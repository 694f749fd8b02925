"""Bytes per element of what inference reads and sends: weights (full width or quantised) and
activations on the wire. Shared by the planner and the ranks, so plan and run count alike.
"""

from __future__ import annotations

from smolnet.errors import UsageError

DTYPES = ("fp32", "bf16", "fp16")
QUANTIZE = ("int8", "q4")
WIRE_DTYPES = ("fp32", "bf16", "fp16", "int8")
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}
SCALE_BYTES = 4  # int8 on the wire: one fp32 absmax scale per token (llama.cpp's Q8_0 keeps one per 32)


def weight_bytes(quantize: str | None, dtype: str) -> float:
    """Bytes a matmul layer reads per weight, scales included (models.quant.Linear.nbytes).

    int8: Q8_0's byte per weight and an fp16 scale per group of 32 (models.native; torch's
    fbgemm, the fallback, holds one scale per row): 1 + 2/32. q4: Q4_0's nibble per
    weight and an fp32 scale per group of 32 (models.native; torch's packed kernel, the
    fallback, holds a bf16 scale and a bf16 zero point instead): 4 + 32/32 = 5 bits read."""
    if quantize is None:
        return float(ELEMENT_BYTES[dtype])
    if quantize == "int8":
        return 17 / 16
    if quantize == "q4":
        return 5 / 8
    raise UsageError(f"--quantize {quantize}: choose from {', '.join(QUANTIZE)}")


def wire_bytes(hidden: int, wire: str) -> int:
    """Bytes of one token's activation vector of `hidden` values on the wire."""
    if wire not in WIRE_DTYPES:
        raise UsageError(f"--wire-dtype {wire}: choose from {', '.join(WIRE_DTYPES)}")
    return hidden * ELEMENT_BYTES[wire] + (SCALE_BYTES if wire == "int8" else 0)
