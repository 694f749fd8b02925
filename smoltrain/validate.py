"""Range checks for numeric options: every bad value is one line, exit 2, before anything starts.

Why: sizes, counts, rates and probabilities used to be checked (or not) deep inside each
command, so `--seq 0` ended in a ZeroDivisionError traceback in the planner, `--lr nan` trained
silently, and one option exited 1 where its neighbour exited 2. Here each option names its
range once, as an argparse `type=`; argparse refuses zero, negatives, NaN, infinities and
absurdly large values while parsing, and `smolnet.cli_dispatch` prints that as one line
(`smoltrain run: error: argument --seq: must be an integer at least 1 and at most 1048576,
got '0'`) with exit 2. No model is loaded, no process started, no file written.

Adding an option is one line (pick the closest preset, or give a range):

    p.add_argument("--inner-steps", type=validate.count(100_000))           # 1..100000
    p.add_argument("--threads", type=validate.THREADS)                       # 1..1024
    p.add_argument("--max-batch", type=validate.count(4096), default=8)
    p.add_argument("--outer-lr", type=validate.real(0, 10, lo_open=True))   # (0, 10]
    p.add_argument("--outer-momentum", type=validate.real(0, 1, hi_open=True))
    p.add_argument("--target-comm", type=validate.PROBABILITY)               # (0, 1]
    p.add_argument("--warmup", type=validate.count(10**6, lo=0))             # 0 allowed

Choices (`--quantize int8|q4`, `--sync-dtype`) stay argparse `choices=`. Defaults are not
passed through `type=`, so keep them inside the range. Checks that relate two options or need
the model (`--seq` against the model's context, `--batch` against the world) stay where that
knowledge is (smoltrain.run.preflight.check_usage, the planner).
"""

from __future__ import annotations

import argparse
import math

__all__ = [
    "BATCH",
    "COUNT",
    "LR",
    "MICROBATCHES",
    "PORT",
    "PROBABILITY",
    "RANKS",
    "SECONDS",
    "SEED",
    "SEQ",
    "STEPS",
    "TEMPERATURE",
    "THREADS",
    "TOKENS",
    "count",
    "integer",
    "real",
    "seconds",
]


class _Check:
    """An argparse `type=`: converts the text and range-checks it, or raises ArgumentTypeError."""

    def __init__(self, convert, ok, want: str):
        self.convert, self.ok, self.want = convert, ok, want
        self.__name__ = want  # argparse names the type in some messages

    def __call__(self, text: str):
        try:
            value = self.convert(str(text).strip())
        except (TypeError, ValueError, OverflowError):
            value = None
        if value is None or not self.ok(value):
            raise argparse.ArgumentTypeError(f"must be {self.want}, got {text!r}")
        return value

    def __repr__(self) -> str:
        return f"<validate: {self.want}>"


def _int(text: str) -> int:
    return int(text, 10)


def integer(lo: int, hi: int, want: str | None = None) -> _Check:
    """An integer in lo..hi (both included)."""
    if want is None:
        want = f"an integer at least {lo} and at most {hi}" if lo != 0 else f"0 or more (an integer, at most {hi})"
    return _Check(_int, lambda v: lo <= v <= hi, want)


def count(hi: int, lo: int = 1) -> _Check:
    """How many of something: 1..hi by default (lo=0 where none is meaningful)."""
    return integer(lo, hi)


def real(lo: float, hi: float, lo_open: bool = False, hi_open: bool = False, want: str | None = None) -> _Check:
    """A finite number in the interval, ends open or closed (NaN and infinities never pass)."""

    def ok(v: float) -> bool:
        return math.isfinite(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)

    if want is None:
        if lo == 0 and lo_open:
            want = f"a positive finite number, {'below' if hi_open else 'at most'} {hi:g}"
        elif lo == 0:
            want = f"0 or more (finite, {'below' if hi_open else 'at most'} {hi:g})"
        else:
            want = f"a finite number in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    return _Check(float, ok, want)


def seconds(hi: float = 86400.0, zero: bool = False) -> _Check:
    """A duration: positive (or 0 when `zero`), finite, at most `hi` seconds."""
    if zero:
        return real(0, hi, want=f"0 or more seconds (finite, at most {hi:g})")
    return real(0, hi, lo_open=True, want=f"a positive number of seconds (finite, at most {hi:g})")


# presets: the ranges smolcluster's options share
COUNT = count(10**6)
STEPS = count(10**9)
BATCH = count(1 << 16)  # sequences
SEQ = count(1 << 20)  # tokens; the model's context is checked where the model is known
TOKENS = count(1 << 20)
MICROBATCHES = count(4096)
ROUNDS = count(1000)
RANKS = count(256)  # --local N, --world: a home cluster, not a datacenter
THREADS = count(1024)
SEED = integer(0, 2**32 - 1)
PORT = integer(0, 65535, want="0 (any free) or 1..65535")
LR = real(0, 1000, lo_open=True)
TEMPERATURE = real(0, 100)
PROBABILITY = real(0, 1, lo_open=True)  # (0, 1]: top-p, fractions of a whole
LORA_RANK = count(1 << 16)
LORA_ALPHA = real(0, 1 << 16, lo_open=True)  # the adapters' scale is alpha / rank
DROPOUT = real(0, 1, hi_open=True)  # [0, 1): a dropout of 1 drops everything
SECONDS = seconds()
