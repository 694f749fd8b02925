"""Which decode kernels a process runs: one backend, chosen once, named in every report.

Three of the four machines this project is built for are Arm, so which kernels run is not
obvious from the outside, and a silent fallback to torch's operations cost 1.4-2x on a
decode step. Each backend says what it runs for each product (quant.Linear asks it) and
why the host cannot run it, if it cannot:

- `native` (x86: AVX512-VNNI or AVX2; Arm: NEON, with the dot-product instructions where
  the CPU has them): our C kernels, models.native, for q4 (Q4_0 x Q8_0), int8 (Q8_0 x Q8_0),
  the one-row fp32 product and the rest of a one-row fp32 step.
- `kleidiai` (aarch64 torch built with Arm's KleidiAI): q4 through torch's
  `_dyn_quant_matmul_4bit` (4-bit weights, int8 activations per row); the rest torch's.
- `torch`: torch's own kernels (fbgemm int8, int4pack q4) and numpy's BLAS at one row.

`auto` takes the first of those the host runs. `--kernels` (generate, serve, run,
calibrate) or SMOL_KERNELS asks for one; a backend the host cannot run is a one-line error.
The report's `kernels` names the backend each rank used and why any before it was passed over.
"""

from __future__ import annotations

import contextlib
import os

import torch

from smolnet.errors import UsageError
from smoltrain.models import native_build

CHOICES = ("auto", "native", "kleidiai", "torch")


class Backend:
    name = "torch"
    q4 = "int4pack"  # quant.Linear's kernel for each product
    int8 = "fbgemm"
    fp32_row = "blas"
    row_kernels = False  # the one-row fp32 step's norms, attention and activations in C

    def unavailable(self) -> str | None:
        """Why this host cannot run this backend, or None."""
        return None

    def describe(self) -> dict:
        return {"backend": self.name, "q4": self.q4, "int8": self.int8, "fp32_row": self.fp32_row}


class Torch(Backend):
    """torch's generic kernels: fbgemm's int8 (where built), int4pack q4, numpy's BLAS at one row."""

    def __init__(self):
        self.int8 = "fbgemm" if "fbgemm" in torch.backends.quantized.supported_engines else "int8pack"


class Native(Backend):
    name, q4, int8, fp32_row, row_kernels = "native", "q4_0", "q8_0", "gemv", True
    arm = False

    def unavailable(self) -> str | None:
        if native_build.arm() != self.arm:
            return "not an Arm host" if self.arm else "not an x86 host"
        return native_build.status()[1]

    def describe(self) -> dict:
        so = native_build.library()
        return {**super().describe(), "isa": native_build.isa(so), "openmp": bool(so.openmp())}


class NativeX86(Native):
    """Ours with AVX512-VNNI or AVX2."""


class NativeArm(Native):
    """Ours with NEON (dotprod where present)."""

    arm = True


class KleidiAI(Torch):
    """Arm's KleidiAI int4 kernels in an aarch64 torch for q4; torch's for the rest."""

    name, q4 = "kleidiai", "kleidiai"

    def unavailable(self) -> str | None:
        if not native_build.arm():
            return "not an Arm host"
        kai = getattr(torch.backends, "kleidiai", None)
        if kai is None or not kai.is_available():
            return f"torch {torch.__version__} was built without KleidiAI"
        return None


def candidates() -> list[Backend]:
    """This host's backends, fastest first."""
    return [NativeArm() if native_build.arm() else NativeX86(), KleidiAI(), Torch()]


def choose(want: str = "auto") -> tuple[Backend, dict]:
    """(the backend, {name: why it was passed over}); UsageError where `want` cannot run here."""
    if want not in CHOICES:
        raise UsageError(f"--kernels {want}: choose from {', '.join(CHOICES)}")
    passed = {}
    for b in candidates():
        why = b.unavailable()
        if want == b.name and why:
            raise UsageError(f"--kernels {want}: this host cannot run it ({why})")
        if want in ("auto", b.name) and not why:
            return b, passed
        if want == "auto":
            passed[b.name] = why
    raise UsageError(f"--kernels {want}: no backend for it on this host")  # torch always runs: unreachable


_chosen: tuple[Backend, dict] | None = None


def select(want: str | None = None) -> Backend:
    """Choose this process's backend: `want`, else SMOL_KERNELS, else auto. The choice goes
    into the environment, so ranks started from here on this machine make the same one."""
    global _chosen
    want = want or os.environ.get("SMOL_KERNELS") or "auto"
    _chosen = choose(want)
    os.environ["SMOL_KERNELS"] = want
    return _chosen[0]


def current() -> Backend:
    """This process's backend (chosen on first use where nothing chose it yet)."""
    if _chosen is None:
        select()
    return _chosen[0]


def report() -> dict:
    """What a report says of this process: the backend, what it runs and what was passed over."""
    b = current()
    return {**b.describe(), "passed_over": dict(_chosen[1])}


@contextlib.contextmanager
def using(want: str):
    """Run with another backend for a while (the tests' and benchmarks' A/Bs)."""
    global _chosen
    saved, env = _chosen, os.environ.get("SMOL_KERNELS")
    try:
        select(want)
        yield current()
    finally:
        _chosen = saved
        if env is None:
            os.environ.pop("SMOL_KERNELS", None)
        else:
            os.environ["SMOL_KERNELS"] = env
