"""Quantised weights, activations on the wire, threads and the calibration probe's arithmetic
(issue 25): each kernel against a dequantised reference, each expected value derived here."""

from __future__ import annotations

import pytest
import torch
from need import need_native

from smoltrain.infer.activations import Codec
from smoltrain.models import backends, native_build, quant


def test_q4_layout_is_llama_cpp_q4_0():
    # one group of 32: the largest magnitude is -4.0, so d = -4 / -8 = 0.5 and q = round(x / 0.5) + 8:
    # -4.0 -> 0, 0 -> 8, 1.0 -> 10, 3.5 -> 15; d = 0.5 makes every one of them exact
    row = torch.zeros(32)
    row[:4] = torch.tensor([-4.0, 0.0, 1.0, 3.5])
    q, d = quant.quantize_q4(row[None])
    assert d.item() == 0.5
    assert q[0, :4].tolist() == [0, 8, 10, 15]
    assert torch.equal(quant.dequantize_q4(q, d), row[None])


def test_int8_is_symmetric_per_output_channel():
    # row 0 peaks at 2.54 -> scale 0.02, so 1.0 -> 50; row 1 peaks at 127 -> scale 1, 3 -> 3
    w = torch.tensor([[2.54, -1.0, 1.0], [127.0, 3.0, -127.0]])
    q, s = quant.quantize_int8(w)
    assert s.tolist() == pytest.approx([0.02, 1.0])
    assert q.tolist() == [[127, -50, 50], [127, 3, -127]]


@pytest.mark.parametrize("kind,native", [("int8", True), ("int8", False), ("q4", True), ("q4", False)])
def test_kernel_equals_dequantised_reference(kind, native):
    """The low-bit kernel (ours: Q8_0 / Q4_0 x Q8_0; torch's: fbgemm, int4pack) against
    F.linear with the weight it dequantises to; the activations are rounded on the way in
    (bf16 for the packed kernels, int8 scales for fbgemm and ours), so the agreement is to
    that precision."""
    if native:
        need_native()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g)
    x = torch.randn(3, 128, generator=g)
    with backends.using("native" if native else "torch"):
        lin = quant.Linear(w, None, torch.float32, kind)
    want = {("int8", True): "q8_0", ("int8", False): "fbgemm", ("q4", True): "q4_0", ("q4", False): "int4pack"}
    assert lin.kernel == want[kind, native]  # the CPU kernel runs, not the fallback
    ref = torch.nn.functional.linear(x, lin.dequantized())
    got = lin(x)
    assert got.dtype == torch.float32 and got.shape == (3, 64)
    assert (got - ref).abs().max() < 0.02 * ref.abs().max()
    assert (lin.dequantized() - w).abs().max() < (0.02 if kind == "int8" else 0.2) * w.abs().max()
    with backends.using("native" if native else "torch"):  # a transposed view (GPT-2's Conv1D weights)
        assert torch.equal(quant.Linear(w.t().contiguous().t(), None, torch.float32, kind)(x), got)


@pytest.mark.parametrize("native", [True, False])
def test_one_row_layer_is_the_same_product(native):
    """A one-row stage's fp32 layer runs our one-row product (or, under the torch backend,
    holds W transposed for numpy's BLAS); decode rows (1) and a prefill (several) both equal
    F.linear to float rounding, bias included. 83 columns: the vector loop's remainder too."""
    if native:
        need_native()
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(48, 83, generator=g), torch.randn(48, generator=g)
    with backends.using("native" if native else "torch"):
        lin = quant.Linear(w, b, torch.float32, one_row=True)
    if native:
        assert lin.kernel == "gemv" and lin.weight.shape == (48, 83)
    else:
        assert lin.kernel == "blas" and lin.weight.shape == (83, 48) and lin.weight.is_contiguous()
    assert torch.equal(lin.dequantized(), w) and lin.nbytes == (48 * 83 + 48) * 4
    for shape in ((1, 1, 83), (1, 5, 83)):
        x = torch.randn(*shape, generator=g)
        got = lin(x)
        assert got.shape == (*shape[:-1], 48) and got.dtype == torch.float32
        assert torch.allclose(got, torch.nn.functional.linear(x, w, b), atol=1e-5)
    # a batched stage's layer keeps oneDNN; a quantised one ignores the hint
    assert quant.Linear(w, b, torch.float32).kernel in ("onednn", None)
    assert quant.Linear(w, None, torch.float32, "int8", one_row=True).kind == "int8"


def test_numpys_blas_runs_at_the_rank_thread_count():
    """host.set_threads holds numpy's BLAS to the rank's count, as torch's: unheld, OpenBLAS
    starts one thread per core."""
    from threadpoolctl import threadpool_info

    from smoltrain.host import set_threads

    before = torch.get_num_threads()
    try:
        set_threads(1)
        blas = [i for i in threadpool_info() if i["user_api"] == "blas"]
        assert blas and all(i["num_threads"] == 1 for i in blas)
        assert torch.get_num_threads() == 1
    finally:
        set_threads(before)


def test_fallback_without_kernel_is_the_same_layer():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 64, generator=g)  # 40 rows: not a multiple of 16, so int4pack cannot take it
    with backends.using("torch"):
        lin = quant.Linear(w, None, torch.float32, "q4")
    assert lin.kernel is None
    x = torch.randn(2, 64, generator=g)
    q, d = quant.quantize_q4(w)
    assert torch.allclose(lin(x), x @ quant.dequantize_q4(q, d).t(), atol=1e-5)


def test_weight_bytes_match_the_planner():
    from smoltrain.planner.widths import weight_bytes

    w = torch.randn(256, 1024)
    assert quant.Linear(w, None, torch.float32).nbytes == 256 * 1024 * weight_bytes(None, "fp32")
    # int8 (ours, Q8_0): a byte a weight and an fp16 scale per 32: 1 + 2/32; under torch's fbgemm
    # a byte a weight plus 16 bytes a row (its fp64 scale and zero point), fewer
    assert quant.Linear(w, None, torch.float32, "int8").nbytes <= 256 * 1024 * weight_bytes("int8", "fp32")
    if backends.current().int8 == "q8_0":
        assert quant.Linear(w, None, torch.float32, "int8").nbytes == 256 * 1024 * 17 / 16
    # q4: 4 bits a weight and a bf16 scale and zero per 32: exactly 5/8 byte a weight
    assert quant.Linear(w, None, torch.float32, "q4").nbytes == 256 * 1024 * weight_bytes("q4", "fp32")


def test_int8_wire_per_token_absmax_and_the_stop_marker():
    codec = Codec("int8", 4, torch.float32)
    x = torch.tensor([[[1.27, -0.5, 0.0, 0.3], [0.0, 0.0, 0.0, 0.0]]])
    buf = codec.encode(x)
    # 2 tokens x (4 int8 + one fp32 scale) = 16 bytes; token 0's scale is 1.27 / 127 = 0.01
    assert buf.numel() == codec.nbytes(2) == 16
    back = codec.decode(buf)
    assert back.shape == x.shape and (back - x).abs().max() <= 0.005
    assert torch.equal(back[0, 1], torch.zeros(4))  # an all-zero token stays zero (no 0/0)
    marker = codec.decode(codec.encode(torch.full((1, 1, 4), float("nan"))))
    assert torch.isnan(marker).all()


@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_16bit_wire_keeps_nan(wire):
    codec = Codec(wire, 8, torch.float32)
    assert codec.nbytes(3) == 3 * 8 * 2
    assert torch.isnan(codec.decode(codec.encode(torch.full((1, 1, 8), float("nan"))))).all()


def test_comm_probe_counts_a_ranks_own_cpu_at_the_hosts_pace():
    from smoltrain.calibration.comm_probe import per_message

    # two ranks: one all-reduce is 2 ring steps. Rank 0 spent 4 ms of CPU on a small one:
    # 2 ms a message; on a host whose CPU second takes 3 wall seconds (a 1/3-core cap), 6 ms
    one = per_message(0.004, 0.010, big_bytes=1_000_000, ranks=2)
    capped = per_message(0.004, 0.010, big_bytes=1_000_000, ranks=2, pace=3.0)
    assert one["message_s"] == pytest.approx(0.002)
    assert capped["message_s"] == pytest.approx(0.006)
    # big buffer: 10 ms / 2 = 5 ms a step, 3 ms of it beyond the message cost, for a 500 kB
    # chunk; at a third of the pace a third of the bytes per second
    assert one["bytes_s"] == pytest.approx(500_000 / 0.003)
    assert capped["bytes_s"] == pytest.approx(500_000 / 0.009)
    # the probe's ring of three: 4 steps a rank; no division by the cores it ran on: the
    # ranks' CPU seconds are their own however many CPUs there were
    assert per_message(0.012, 0.1, big_bytes=3_000_000)["message_s"] == pytest.approx(0.003)


def test_usable_cpus_follow_the_quota():
    from smolnet.cpus import affinity_cpus, usable_cpus

    n = affinity_cpus()
    assert usable_cpus(None) == n
    assert usable_cpus((50_000, 100_000)) == 1  # half a core: still one thread
    assert usable_cpus((250_000, 100_000)) == min(n, 2)  # 2.5 cores: 2 threads, no more than there are


def test_thread_counts_refused():
    from smolnet.errors import UsageError
    from smoltrain.host import check_threads

    assert check_threads(None, cpus=4) == 4
    assert check_threads(3, cpus=4) == 3
    for bad in (0, -1, 5):
        with pytest.raises(UsageError):
            check_threads(bad, cpus=4)


def test_plan_counts_quantised_weights_and_int8_wire():
    from smoltrain.models.spec import ModelSpec
    from smoltrain.planner.plan import make_plan

    m = ModelSpec(
        "m",
        vocab=1000,
        layers=4,
        hidden=256,
        heads=4,
        kv_heads=2,
        ffn=512,
        ctx=128,
        tied_embeddings=False,
        learned_pos=False,
    )
    full = make_plan("pp", m, 2, mode="infer", seq=64)
    q4 = make_plan("pp", m, 2, mode="infer", seq=64, quantize="q4", wire_dtype="int8")
    # one hidden state per hop: 256 x 4 bytes at fp32; at int8 256 + one 4-byte scale; and the step's header
    assert full["bytes_per_token"] == 256 * 4 + 32 and q4["bytes_per_token"] == 256 + 4 + 32
    # stage 0 holds 2 layers and the embedding: the layers' matmuls at 5/8 byte, the table at 4
    lp = m.layer_params()
    assert q4["ranks"][0]["memory"]["weights"] == int(2 * lp * 5 / 8 + 1000 * 256 * 4)
    tp = make_plan("tp", m, 2, mode="infer", seq=64, wire_dtype="int8")
    # tp at int8: per all-reduce an all-gather, (N-1) x (256 + 4) bytes per rank; 2 per layer; rank 0's header
    assert tp["bytes_per_token"] == 4 * 2 * (256 + 4) + 32
    assert q4["wire_dtype"] == "int8" and q4["quantize"] == "q4"


def _q8_0(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Q8_0 of activation rows, dequantised: int8 per group of 32, scale absmax/127."""
    m, k = x.shape
    g = x.reshape(m, k // 32, 32)
    d = g.abs().amax(-1, keepdim=True) / 127
    return (torch.round(g / torch.where(d > 0, d, torch.ones_like(d))) * d).reshape(m, k)


@pytest.mark.parametrize("n,k,m", [(64, 128, 1), (48, 96, 3), (40, 2816, 9)])
def test_q4_0_kernel_is_q4_0_times_q8_0_exactly(n, k, m):
    """Our kernel is llama.cpp's product: Q4_0 weights times the activations at Q8_0, in
    float64 here, to float rounding; shapes with an odd number of groups (96: 3) take the
    one-group path, 9 rows the four-row blocks and their remainder."""
    need_native()
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    q, d = quant.quantize_q4(w)
    qs = quant.native.pack(q)
    assert qs.shape == (n, k // 2) and qs.dtype == torch.uint8
    assert torch.equal(quant.native.unpack(qs), q)
    # byte j of a group: q[j] in the low nibble, q[j + 16] in the high (llama.cpp's block_q4_0)
    assert int(qs[0, 0]) == int(q[0, 0]) | int(q[0, 16]) << 4
    got = quant.native.q4_mm(x, qs, d.contiguous())
    ref = _q8_0(x).double() @ quant.dequantize_q4(q, d).double().t()
    assert (got.double() - ref).abs().max() < 1e-5 * ref.abs().max()


def test_q4_0_kernel_answers_a_row_alike_alone_or_batched():
    """Every row is summed in the same order whatever rows share its block, so a request
    served in a batch gets the bits it gets alone (docs/serving.md)."""
    need_native()
    g = torch.Generator().manual_seed(4)
    lin = quant.Linear(torch.randn(96, 256, generator=g), None, torch.float32, "q4")
    x = torch.randn(6, 256, generator=g)
    batched = lin(x)
    for i in range(6):
        assert torch.equal(lin(x[i : i + 1]), batched[i : i + 1])


def test_calibrates_decode_product_reads_its_bytes_from_memory():
    """calibrate's decode product (decode_probe.decode_bw) streams DECODE_BYTES of weights, each
    layer its own: a one-row layer that keeps the tensor it is given must not be handed one tile
    over and over (it then read from cache, and planned fp32 decode 2x too fast)."""
    from smoltrain.calibration import decode_probe as probe

    layers = probe.decode_layers(torch, "fp32", True)
    assert layers[0].kernel in ("gemv", "blas")
    assert len({lin.weight.data_ptr() for lin in layers}) == len(layers)
    assert sum(lin.nbytes for lin in layers) >= probe.DECODE_BYTES


@pytest.mark.parametrize("march,path", [("x86-64-v3", 1), ("native", None)])
def test_each_instruction_path_is_the_same_product(tmp_path, march, path):
    """kernels.c built for AVX2 alone (x86-64-v3: the maddubs dot, 256-bit sums) and for this
    machine: Q4_0 x Q8_0 and the one-row fp32 product against their references."""
    need_native()
    native_build.build(tmp_path / "k.so", march)
    so = native_build.load(tmp_path / "k.so")
    if path is not None:
        assert so.simd() == path
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(40, 2816, generator=g), torch.randn(3, 2816, generator=g)
    q, d = quant.quantize_q4(w)
    got = quant.native.q4_mm(x, quant.native.pack(q), d.contiguous(), so)
    ref = _q8_0(x).double() @ quant.dequantize_q4(q, d).double().t()
    assert (got.double() - ref).abs().max() < 1e-5 * ref.abs().max()
    assert torch.allclose(quant.native.gemv(x[0], w, so), w @ x[0], atol=1e-3)
    q8, d8 = quant.quantize_q8_0(w)
    got = quant.native.q8_mm(x, q8, d8, so)
    ref = _q8_0(x).double() @ quant.dequantize_q8_0(q8, d8).double().t()
    assert (got.double() - ref).abs().max() < 1e-5 * ref.abs().max()


@pytest.mark.parametrize("n,k,m", [(64, 128, 1), (40, 96, 9)])
def test_q8_0_kernel_is_q8_0_times_q8_0_and_rows_alike_batched(n, k, m):
    """int8 under the native backend is llama.cpp's Q8_0 x Q8_0: weights and activations int8
    per group of 32 (the weight's scale at fp16), in float64 here to float rounding; a row gets
    the same bits alone or in a batch."""
    need_native()
    g = torch.Generator().manual_seed(8)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    q, d = quant.quantize_q8_0(w)
    assert q.dtype == torch.int8 and d.dtype == torch.float16 and int(q.abs().max()) == 127
    assert (quant.dequantize_q8_0(q, d) - w).abs().max() <= d.float().max() / 2 + 1e-3
    got = quant.native.q8_mm(x, q, d)
    ref = _q8_0(x).double() @ quant.dequantize_q8_0(q, d).double().t()
    assert (got.double() - ref).abs().max() < 1e-5 * ref.abs().max()
    for i in range(m):
        assert torch.equal(quant.native.q8_mm(x[i : i + 1], q, d), got[i : i + 1])


@pytest.mark.parametrize("heads,kv_heads,pos", [(4, 2, 0), (4, 2, 6), (8, 8, 3), (6, 1, 9)])
def test_row_kernels_are_the_torch_layer_arithmetic(heads, kv_heads, pos):
    """One fp32 decode row through models.native (RMSNorm, RoPE with the cache and attention,
    SwiGLU) against the torch operations LlamaBlock runs otherwise: the same cache contents,
    and outputs equal to float rounding, grouped kv heads (6 over 1: MQA) and the first position."""
    need_native()
    from smoltrain.models import llama

    g = torch.Generator().manual_seed(6)
    hd, max_len = 16, 12
    x, w = torch.randn(1, 1, 96, generator=g), torch.randn(96, generator=g)
    assert torch.allclose(quant.native.rms_norm(x, w, 1e-5), llama.rms_norm(x, w, 1e-5), atol=1e-6)
    gu = torch.randn(1, 1, 2 * 40, generator=g)
    g_, u = gu.chunk(2, dim=-1)
    assert torch.allclose(quant.native.swiglu(gu), torch.nn.functional.silu(g_) * u, atol=1e-6)
    b = torch.randn(96, generator=g)  # GPT-2's LayerNorm and both GELUs
    ln = torch.nn.functional.layer_norm(3 * x + 1, (96,), w, b, 1e-5)
    assert torch.allclose(quant.native.layer_norm(3 * x + 1, w, b, 1e-5), ln, atol=1e-5)
    for approx in ("tanh", "none"):
        want = torch.nn.functional.gelu(gu, approximate=approx)
        assert torch.allclose(quant.native.gelu(gu, approx), want, atol=1e-6)

    rope = llama.rope_table(500.0, hd, max_len, torch.float32)
    ours, ref = (llama.KVCache(kv_heads, hd, max_len, torch.float32) for _ in range(2))
    history = torch.randn(1, kv_heads, pos, hd, generator=g)  # positions before this one, in both caches
    for c in (ours, ref):
        c.k[:, :, :pos], c.v[:, :, :pos] = history, -history
    qkv = torch.randn(1, 1, (heads + 2 * kv_heads) * hd, generator=g)
    got = quant.native.attend(qkv, heads, kv_heads, ours.k, ours.v, rope, pos)

    t = qkv.view(1, 1, heads + 2 * kv_heads, hd)
    qk = llama.apply_rope(t[:, :, : heads + kv_heads], rope[0][pos : pos + 1, None], rope[1][pos : pos + 1, None])
    q, k, v = qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:].transpose(1, 2), t[:, :, heads + kv_heads :]
    kk, vv = ref.update(k, v.transpose(1, 2), pos)
    want = llama.attend(q, kk, vv, heads, kv_heads, causal=False).transpose(1, 2).reshape(1, 1, heads * hd)
    assert torch.allclose(ours.k, ref.k, atol=1e-6) and torch.equal(ours.v, ref.v)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
    with pytest.raises(IndexError, match="outside a KV cache of 12"):  # never written past the cache
        quant.native.attend(qkv, heads, kv_heads, ours.k, ours.v, rope, max_len)
    # no RoPE (GPT-2): the keys go into the cache as they came
    plain = quant.native.attend(qkv, heads, kv_heads, ours.k, ours.v, None, pos)
    kk, vv = ref.update(t[:, :, heads : heads + kv_heads].transpose(1, 2), v.transpose(1, 2), pos)
    q = t[:, :, :heads].transpose(1, 2)
    want = llama.attend(q, kk, vv, heads, kv_heads, causal=False).transpose(1, 2).reshape(1, 1, heads * hd)
    assert torch.allclose(ours.k, ref.k, atol=1e-6) and torch.allclose(plain, want, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_one_token_decode_takes_the_row_kernels_and_keeps_the_logits(arch, tmp_path, monkeypatch):
    """A `generate` stage (batched=False) at fp32 runs each decode step's layers through the row
    kernels and its prefill through torch; logits of a 12-step decode equal the all-torch
    stage's to float rounding, and the greedy tokens are the same."""
    need_native()
    from infer_models import make_checkpoint

    from smoltrain.models import native
    from smoltrain.models.hf import Checkpoint
    from smoltrain.models.stage import Stage

    ck = Checkpoint(make_checkpoint(str(tmp_path / "m"), arch, layers=3))
    calls = []
    attend = native.attend
    monkeypatch.setattr(native, "attend", lambda *a: calls.append(a[-1]) or attend(*a))

    def decode(stage):
        stage.open(0, 20)
        logits = [stage(torch.tensor([[1, 5, 9, 3]]), [0])[0]]
        for _ in range(12):
            logits.append(stage(torch.tensor([[int(logits[-1].argmax())]]), [0])[0])
        return torch.stack(logits)

    fast = Stage(ck, 0, 3, True, True, batched=False)
    assert all(b.row_kernels for b in fast.blocks)
    got = decode(fast)
    assert calls == [p for p in range(4, 16) for _ in range(3)]  # every decode step, every layer; no prefill
    slow = Stage(ck, 0, 3, True, True, batched=False)
    for b in slow.blocks:
        b.row_kernels = False
    want = decode(slow)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert torch.allclose(got, want, atol=1e-5 * want.abs().max())
    # batched stages (serve) and other dtypes keep torch's operations
    assert not any(b.row_kernels for b in Stage(ck, 0, 3, True, True).blocks)
    assert not any(b.row_kernels for b in Stage(ck, 0, 3, True, True, dtype="bf16", batched=False).blocks)


def _smaps(ptr: int) -> dict:
    """/proc/self/smaps of the mapping (VMA) of this process that holds address `ptr`: {field: text}."""
    from pathlib import Path

    out, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head, _, rest = line.partition(" ")
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(a, 16) for a in head.split("-"))
            if inside:
                break
            inside = lo <= ptr < hi
        elif inside:
            out[head.rstrip(":")] = rest.strip()
    return out


def _huge_kb(ptr: int) -> int:
    return int(_smaps(ptr)["AnonHugePages"].split()[0])


def test_decode_weights_are_held_in_huge_pages(monkeypatch):
    """A one-row layer's fp32 weight and a q4 layer's bytes sit in memory Linux backs with 2 MB
    pages (/proc/self/smaps says so): the same values, 2 MB aligned. Under one huge page, or
    with SMOL_HUGEPAGES=0, torch's own memory is kept."""
    need_native()
    from smoltrain.models import hugepages

    assert hugepages.available(), f"no transparent huge pages here ({hugepages.THP}: `madvise` is Debian's default)"
    g = torch.Generator().manual_seed(7)
    w = torch.randn(1024, 2048, generator=g)  # 8 MB at fp32
    lin = quant.Linear(w, None, torch.float32, one_row=True)
    assert lin.kernel == "gemv" and torch.equal(lin.weight, w) and lin.weight.data_ptr() % hugepages.HUGE == 0
    assert _huge_kb(lin.weight.data_ptr()) >= 2048
    x = torch.randn(2048, generator=g)
    assert torch.allclose(lin(x), w @ x, atol=1e-3)
    q4 = quant.Linear(torch.randn(4096, 2048, generator=g), None, torch.float32, "q4")  # 4 MB of nibbles
    assert q4.q.data_ptr() % hugepages.HUGE == 0 and _huge_kb(q4.q.data_ptr()) >= 2048
    small = torch.randn(64, 64)
    assert hugepages.hold(small) is small
    # a tail short of a huge page is never advised: 3 MB and a bit get one huge page, not two
    odd = hugepages.hold(torch.randn((3 << 20) // 4 + 1000, generator=g))
    last = odd.data_ptr() + odd.numel() * 4 - 1
    assert _huge_kb(odd.data_ptr()) == 2048 and "hg" in _smaps(odd.data_ptr())["VmFlags"].split()
    assert "hg" not in _smaps(last)["VmFlags"].split() and _huge_kb(last) == 0
    monkeypatch.setenv("SMOL_HUGEPAGES", "0")
    hugepages.available.cache_clear()
    try:
        assert hugepages.hold(w) is w
    finally:
        monkeypatch.delenv("SMOL_HUGEPAGES")
        hugepages.available.cache_clear()
