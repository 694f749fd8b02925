"""The decode kernels' edges (issues 39 and 41): every wrapper refuses a bad argument before a
pointer reaches C; the kernel cache is private and a planted library is never loaded; a failed
build is cached and said once; a compiler without OpenMP still builds; the backend is chosen
once, named, and a backend the host cannot run is refused."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from need import native_expected, need_native, need_tool

from smolnet.errors import UsageError
from smoltrain.models import backends, native, native_build, quant

F32 = torch.float32


def _q4(n=8, k=64):
    q, d = quant.quantize_q4(torch.randn(n, k))
    return native.pack(q), d.contiguous()


def test_product_wrappers_refuse_bad_arguments_before_c():
    need_native()
    qs, d = _q4()
    x = torch.randn(2, 64)
    assert native.q4_mm(x, qs, d).shape == (2, 8)
    cases = [
        (
            (torch.randn(2, 48), torch.zeros(8, 24, dtype=torch.uint8), torch.zeros(8, 1)),
            "k = 48 is not a multiple of 32",
        ),
        ((torch.randn(64), qs, d), r"x: fp32 rows \[M, K\]"),
        ((x, qs.to(torch.int16), d), "qs: a torch.uint8"),
        ((x, qs[:, :16].contiguous(), d), r"qs: shape \[8, 16\], expected \[\*, 32\]"),
        ((x, qs, d[:5]), r"d: shape \[5, 2\], expected \[8, 2\]"),
        ((x, qs, d.double()), "d: a torch.float32"),
        ((x, qs, d.t().contiguous().t()), "d: not contiguous"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            native.q4_mm(*args)
    odd = torch.frombuffer(bytearray(8 * 2 * 4 + 4), dtype=F32, offset=1, count=8 * 2)  # one byte off
    with pytest.raises(ValueError, match="d: not aligned to its 4-byte elements"):
        native.q4_mm(x, qs, odd.view(8, 2))
    q8, d8 = quant.quantize_q8_0(torch.randn(8, 64))
    with pytest.raises(ValueError, match="d: a torch.float16"):
        native.q8_mm(x, q8, d8.float())
    with pytest.raises(ValueError, match="k = 40 is not a multiple of 32"):
        native.q8_mm(torch.randn(1, 40), q8, d8)
    with pytest.raises(ValueError, match="x: 63 values for a"):
        native.gemv(torch.randn(63), torch.randn(8, 64))


def test_row_wrappers_refuse_bad_heads_and_shapes():
    need_native()
    hd, max_len = 8, 4
    rope = (torch.ones(max_len, hd), torch.zeros(max_len, hd))

    def cache(kv):
        return torch.zeros(1, kv, max_len, hd), torch.zeros(1, kv, max_len, hd)

    k, v = cache(4)
    for heads, kv in ((6, 4), (2, 4), (0, 1), (4, 0)):  # a heap over-read, SIGFPE and a division by zero in C
        kk, vv = cache(max(kv, 1))
        with pytest.raises(ValueError, match=f"heads {heads} / kv_heads {kv}"):
            native.attend(torch.randn(1, 1, (heads + 2 * kv) * hd), heads, kv, kk, vv, rope, 0)
    with pytest.raises(ValueError, match=r"qkv: 40 values, expected"):
        native.attend(torch.randn(1, 1, 40), 4, 4, k, v, rope, 0)
    with pytest.raises(ValueError, match=r"v: shape \[1, 2, 4, 8\]"):
        native.attend(torch.randn(1, 1, 12 * hd), 4, 4, k, cache(2)[1], rope, 0)
    with pytest.raises(ValueError, match="qkv: one row"):
        native.attend(torch.randn(2, 1, 12 * hd), 4, 4, k, v, rope, 0)
    with pytest.raises(ValueError, match="cos: a torch.float32"):
        native.attend(torch.randn(1, 1, 12 * hd), 4, 4, k, v, (rope[0].double(), rope[1]), 0)
    with pytest.raises(ValueError, match=r"w: shape \[95\], expected \[96\]"):
        native.rms_norm(torch.randn(1, 1, 96), torch.randn(95), 1e-5)
    with pytest.raises(ValueError, match="x: a torch.float32"):
        native.layer_norm(torch.randn(96).half(), torch.randn(96), torch.randn(96), 1e-5)
    with pytest.raises(ValueError, match="gu: 81 values"):
        native.swiglu(torch.randn(1, 1, 81))
    # the C kernel refuses the same heads itself: a second guard, not the first
    so = native_build.library()
    out = torch.empty(6 * hd)
    qkv = torch.randn((6 + 8) * hd)
    rc = so.attend_row(qkv.data_ptr(), 6, 4, hd, None, None, k.data_ptr(), v.data_ptr(), max_len, 0, out.data_ptr(), 1)
    assert rc == -1


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty kernel cache of this test's own (XDG_CACHE_HOME), status() recomputed. The
    process's own status() is settled first, so need_native() does not build into it."""
    native_build.status()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("SMOL_NATIVE", raising=False)
    yield tmp_path / "xdg" / "smolcluster"


def _status():
    return native_build.status.__wrapped__()


def test_cache_is_private_and_a_planted_library_is_not_loaded(cache, tmp_path):
    need_native()
    so, why = _status()
    assert so is not None and why is None
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700 and os.stat(cache).st_uid == os.getuid()
    (lib,) = cache.glob("kernels-*.so")
    assert native_build.trusted(lib) is None
    # a library planted in its place (here: one that would answer simd() == 99) is never loaded
    planted = tmp_path / "evil.c"
    planted.write_text("int simd(void) { return 99; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", str(planted), "-o", str(lib)], check=True)
    assert "does not hash to what its build wrote" in native_build.trusted(lib)
    with pytest.raises(OSError, match="does not hash"):
        native_build.load(lib)
    so, why = _status()  # rebuilt over it
    assert why is None and so.simd() in (1, 2, 3, 4) and native_build.trusted(lib) is None
    os.chmod(lib, 0o777)  # writable by others: refused even with the right hash
    assert "only this user may write" in native_build.trusted(lib)
    os.chmod(cache, 0o777)  # an open cache directory is narrowed back to its owner
    native_build.private(cache)
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700
    if os.getuid() == 0:  # another user's directory is refused, not used
        os.chown(cache, 12345, 12345)
        so, why = _status()
        assert so is None and "belongs to uid 12345" in why


def _fake_cc(tmp_path, body: str):
    cc = tmp_path / "fakecc"
    cc.write_text(f"#!/bin/sh\n{body}\n")
    cc.chmod(0o755)
    return cc


def test_a_failed_build_is_cached_with_its_reason_and_said_once(cache, tmp_path, monkeypatch, capfd):
    calls = tmp_path / "calls"
    cc = _fake_cc(tmp_path, f'echo x >> {calls}; echo "fakecc: error: this compiler is broken" >&2; exit 1')
    monkeypatch.setenv("CC", str(cc))
    so, why = _status()
    assert so is None and "this compiler is broken" in why
    assert "did not build" in capfd.readouterr().err
    tried = len(calls.read_text().splitlines())
    so, why = _status()  # the next process: the cached reason, no compiler run, nothing printed
    assert so is None and "build failed earlier" in why and "this compiler is broken" in why
    assert len(calls.read_text().splitlines()) == tried and capfd.readouterr().err == ""


def test_a_compiler_without_openmp_still_builds(cache, tmp_path, monkeypatch):
    """Apple's clang rejects -fopenmp: the kernels build with -fopenmp-simd and run one thread."""
    need_native()
    refuse = '[ "$a" = -fopenmp ] && { echo "clang: error: unsupported option -fopenmp" >&2; exit 1; }'
    body = f'for a in "$@"; do {refuse}; done\nexec gcc "$@"'
    monkeypatch.setenv("CC", str(_fake_cc(tmp_path, body)))
    so, why = _status()
    assert why is None and so.openmp() == 0 and so.simd() > 0
    qs, d = _q4()
    x = torch.randn(3, 64)
    assert torch.allclose(native.q4_mm(x, qs, d, so), native.q4_mm(x, qs, d), atol=1e-5)


def test_clang_builds_the_kernels(cache, monkeypatch):
    """A real clang (Debian's, without libomp: -fopenmp fails at link, as on a Mac) builds them too."""
    need_native()
    need_tool("clang")  # scripts/system-deps.sh installs it
    monkeypatch.setenv("CC", "clang")
    so, why = _status()
    assert why is None and so.simd() == native_build.library().simd()
    qs, d = _q4()
    x = torch.randn(3, 64)
    assert torch.allclose(native.q4_mm(x, qs, d, so), native.q4_mm(x, qs, d), atol=1e-5)


def test_backend_choice_and_refusals(monkeypatch):
    b, passed = backends.choose("auto")
    if native_expected():
        assert b.name == "native" and passed == {}
    if not native_build.arm():
        with pytest.raises(UsageError, match="--kernels kleidiai: this host cannot run it .not an Arm host"):
            backends.choose("kleidiai")
    with pytest.raises(UsageError, match="choose from auto, native, kleidiai, torch"):
        backends.choose("mkl")
    assert backends.choose("torch")[0].name == "torch"
    with backends.using("torch"):
        assert backends.current().name == "torch" and os.environ["SMOL_KERNELS"] == "torch"
        assert backends.report()["backend"] == "torch"
    monkeypatch.setattr(native_build, "status", lambda: (None, "no C compiler (CC='/nope' not found)"))
    b, passed = backends.choose("auto")
    assert b.name == "torch" and "no C compiler" in passed["native"]
    with pytest.raises(UsageError, match="--kernels native: this host cannot run it .no C compiler"):
        backends.choose("native")


def test_kleidiai_q4_layout_is_q4_0():
    """The KleidiAI layer's arithmetic, through torch's reference path on x86 (the Arm kernels
    themselves need an Arm host): Q4_0's nibbles, bf16 scales, int8 activations per row."""
    g = torch.Generator().manual_seed(9)
    w, x = torch.randn(32, 128, generator=g), torch.randn(2, 128, generator=g)

    class Kai(backends.KleidiAI):
        def unavailable(self):
            return None

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(backends, "_chosen", (Kai(), {}))
    try:
        lin = quant.Linear(w, None, F32, "q4")
    finally:
        monkeypatch.undo()
    assert lin.kernel == "kleidiai"
    q, d = quant.quantize_q4(w)
    want = quant.dequantize_q4(q, d.bfloat16().float())
    assert torch.allclose(lin.dequantized(), want, atol=1e-6)
    ref = x @ want.t()
    assert (lin(x) - ref).abs().max() < 0.02 * ref.abs().max()


def test_no_compiler_is_named_in_the_generate_report(tmp_path):
    """No silent fallback: with the compiler gone (CC names a missing binary, an empty cache),
    generate runs torch's kernels and its report says so and why; --kernels native is refused."""
    from infer_models import make_checkpoint

    model = make_checkpoint(str(tmp_path / "m"), "llama", layers=1)
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    env.pop("SMOL_KERNELS", None)
    cmd = [sys.executable, "-m", "smoltrain", "generate", "--strategy", "local", "--model", model]
    cmd += ["--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--quantize", "q4", "--json", str(tmp_path / "g.json")]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    import json

    (k,) = json.loads((tmp_path / "g.json").read_text())["kernels"].values()
    assert (
        k["backend"] == "torch"
        and "no C compiler" in k["passed_over"]["native"]
        and "no-such-cc" in k["passed_over"]["native"]
    )
    run = subprocess.run([*cmd, "--kernels", "native"], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.strip().count("\n") == 0
    assert "--kernels native: this host cannot run it (no C compiler" in run.stderr


def test_huge_page_size_is_the_kernels(tmp_path):
    """hpage_pmd_size says it (32 MB on a 16K-page arm64 kernel, the Pi 5's); 2 MB where absent or garbled."""
    from smoltrain.models import hugepages

    f = tmp_path / "hpage_pmd_size"
    f.write_text("33554432\n")
    assert hugepages.huge_size(f) == 32 << 20
    for bad in ("", "abc", "3000000", "0"):
        f.write_text(bad)
        assert hugepages.huge_size(f) == 2 << 20
    assert hugepages.huge_size(tmp_path / "none") == 2 << 20
    if hugepages.PMD_SIZE.exists():
        assert int(hugepages.PMD_SIZE.read_text()) == hugepages.HUGE


def test_run_report_names_each_ranks_kernels(tmp_path):
    """`run --kernels torch`: every rank chose it and the report says so, per rank."""
    import json

    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "smoltrain", "run", "--strategy", "dp", "--local", "2", "--steps", "1"]
    cmd += ["--threads", "1", "--kernels", "torch", "--json", str(out)]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    doc = json.loads(out.read_text())
    assert doc["config"]["kernels"] == "torch"
    assert {k["backend"] for k in doc["kernels"].values()} == {"torch"} and len(doc["kernels"]) == 2


def test_one_openmp_runtime_in_the_process():
    """Our library asks for libgomp.so.1, and torch has loaded its own copy under that soname
    first, so the loader hands ours torch's: one OpenMP runtime, one thread pool, not two
    contending for the same cores (issue 39). /proc/self/maps names every library mapped."""
    need_native()  # torch is imported above: loaded before ours, as in every rank
    assert native_build.library().openmp() == 1
    native.q4_mm(torch.randn(1, 64), *_q4())  # the pool has started
    maps = Path("/proc/self/maps").read_text().splitlines()
    paths = {line.split()[-1] for line in maps if "libgomp" in line or "libomp" in line}
    assert len(paths) == 1, paths
