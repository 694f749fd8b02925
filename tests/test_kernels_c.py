"""The C kernels without Python (tests/kernels_check.c): cross-built for aarch64 and run under
qemu-user, with the dot-product instructions and plain NEON (issue 39: three of the four
machines the project is for are Arm, and CI has none), and built with AddressSanitizer and
UBSan here. A few seconds in all."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from need import need_tool

from smoltrain.models import native_build

DRIVER = Path(__file__).with_name("kernels_check.c")
CROSS = ("aarch64-linux-gnu-gcc", "qemu-aarch64")


def _build_and_run(cc: str, flags: list[str], out: Path, runner: list[str] = (), env=None) -> str:
    exe = out / "check"
    cmd = [cc, *flags, str(DRIVER), *map(str, native_build.SOURCES), "-o", str(exe), "-lm"]
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, f"{' '.join(cmd)}\n{build.stderr}"
    run = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr
    return run.stdout


def test_cross_tools_are_installed_in_ci():
    """The tier gate: CI installs the cross compiler and qemu (scripts/system-deps.sh), so the
    Arm tests below never skip there."""
    missing = [t for t in CROSS if not shutil.which(t)]
    if os.environ.get("CI") == "true":
        assert not missing, f"{', '.join(missing)} missing in CI: scripts/system-deps.sh installs them"
    for tool in CROSS:
        need_tool(tool)


@pytest.mark.parametrize("march,simd", [("armv8.2-a+dotprod", 4), ("armv8-a", 3)])
def test_aarch64_kernels_under_qemu(tmp_path, march, simd):
    """The NEON paths (sdot, and the widening multiplies without it) against float64, batched
    rows equal to single rows, the refused shapes."""
    for tool in CROSS:
        need_tool(tool)
    flags = ["-O2", f"-march={march}", "-fopenmp-simd"]
    sysroot = "/usr/aarch64-linux-gnu"
    out = _build_and_run("aarch64-linux-gnu-gcc", flags, tmp_path, ["qemu-aarch64", "-L", sysroot])
    assert out.startswith(f"simd {simd}\n")


@pytest.mark.parametrize("march", ["native", "x86-64-v3"])
def test_kernels_are_clean_under_address_and_undefined_sanitizers(tmp_path, march):
    if native_build.arm():
        march = "native"
    need_tool("gcc")
    flags = ["-O1", "-g", f"-march={march}", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0", UBSAN_OPTIONS="print_stacktrace=1")
    _build_and_run("gcc", [*flags, "-fno-omit-frame-pointer"], tmp_path, env=env)
