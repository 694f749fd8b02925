"""The `kleidiai` backend's q4 product, run by an aarch64 torch under emulation, held against
float64 and against our own q4 product on this x86 machine (issue 39).

No Arm hardware was at hand, so this runs Arm's KleidiAI kernels under qemu-user: an arm64
Debian root with PyPI's aarch64 torch (scripts/arm64-root.sh, cached outside the tree), the
tree mounted at /src, and this script inside it (`--inside`). Emulation proves the arithmetic
and the backend choice, not the speed: the times kept are qemu's.

The inputs are made here: a weight and activation rows per shape, saved to a file both sides
read. Inside, the backend choice runs as a rank's would (`auto` in a root without a C
compiler, then `kleidiai` asked for), and quant.Linear multiplies through torch's
`_dyn_quant_pack_4bit_weight` / `_dyn_quant_matmul_4bit`. Back here, in float64:

- `own`: the same Q4_0 weights with bf16 scales (KleidiAI's layout) times the activations
  quantised as KleidiAI quantises them (int8 per row, asymmetric: qai8dx), written here from
  its reference's description. The kernel should equal it to fp32 rounding (bar: 1e-4 of the
  output's largest magnitude).
- `exact`: Q4_0 weights (fp32 scales) times the activations unquantised, the product both
  engines approximate; and `q8_0`: the same with activations per 32 as Q8_0 (what our native
  product computes). KleidiAI's error against `exact` is held beside ours (bar: at most 2x
  ours in RMS), and their difference is reported.
- torch's portable path of the same operator on x86 (torch's, not Arm's, kernel): reported.

Then decode on a small random Llama (bench/llama_checkpoint.py: hidden 256, 2 layers),
teacher-forced on fp32's greedy tokens, so one flipped near-tie does not derail the rest:
the kleidiai q4 logits (inside) and our native q4 logits (here), each against fp32's (bar:
KleidiAI's RMS error at most 2x ours). `smoltrain generate --kernels kleidiai` also runs end
to end inside; its tokens and report are kept. QEMU_CPU models run: `max` (dotprod and
i8mm) and `cortex-a76` (a Pi 5's: dotprod, no i8mm). Bars also: `auto` picks `kleidiai`
there, and Arm's kernels ran (torch packs the weight in KleidiAI's layout, uint8, only where
the CPU has dotprod; its portable path keeps floats).

    .venv/bin/python bench/bench_kleidiai.py     # as root: builds the root once (~6 min); ~3 min
    .venv/bin/python bench/bench_kleidiai.py --cpus max --tokens 4 --shapes 1x1024x2816
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SHAPES = "1x1024x2816,1x2816x1024,4x1024x1024,1x4096x512"  # rows x in x out: a 1024-wide Llama's decode
CPUS = "max,cortex-a76"
PROMPT = "3,5,7,9,11"
OWN_BAR, EXACT_RATIO_BAR = 1e-4, 2.0


def shapes(text: str) -> list[tuple[int, int, int]]:
    """`1x1024x2816,...` -> [(rows, in, out)]; ValueError naming the one that is not."""
    out = []
    for s in text.split(","):
        try:
            m, k, n = (int(v) for v in s.split("x"))
        except ValueError:
            m = k = n = 0
        if k % 32 or min(m, k, n) < 1:
            raise ValueError(f"--shapes {s}: rows x in x out, positive, in a multiple of 32")
        out.append((m, k, n))
    return out


# --- inside the emulated root ---
def inside(work: Path) -> None:
    """Run the backend choice and the products in the emulated aarch64 Python; write kai.npz and kai.json."""
    import platform

    import torch

    from smoltrain.models import backends, quant

    auto, passed = backends.choose("auto")
    doc = {"machine": platform.machine(), "torch": torch.__version__, "auto": auto.name, "passed_over": passed}
    doc["qemu_cpu"] = os.environ.get("QEMU_CPU")
    kai = getattr(torch.backends, "kleidiai", None)
    doc["kleidiai_available"] = bool(kai and kai.is_available())
    backends.select("kleidiai")  # a one-line UsageError where this torch cannot run it
    doc["kernels"] = backends.report()
    inputs, outs, times, packed = np.load(work / "inputs.npz"), {}, {}, {}
    for name in sorted({f.split(".")[0] for f in inputs.files}):
        w, x = torch.from_numpy(inputs[f"{name}.w"]), torch.from_numpy(inputs[f"{name}.x"])
        t = time.perf_counter()
        lin = quant.Linear(w, None, torch.float32, "q4")
        assert lin.kernel == "kleidiai", lin.kernel
        packed[name] = "kleidiai" if lin.q.dtype == torch.uint8 else "torch reference"  # its float layout
        outs[name] = lin(x).numpy()
        times[name] = round(time.perf_counter() - t, 3)
    doc["emulated_s"], doc["packed"] = times, packed
    if (work / "ids.json").exists():  # the decode's logits, teacher-forced on fp32's greedy tokens
        t = time.perf_counter()
        outs["logits"] = forced_logits(str(work / "llama"), "q4", json.loads((work / "ids.json").read_text()))
        doc["emulated_s"]["decode"] = round(time.perf_counter() - t, 3)
    np.savez(work / "kai.npz", **outs)
    (work / "kai.json").write_text(json.dumps(doc, indent=1))


def forced_logits(model: str, quantize: str | None, ids: list[int]) -> np.ndarray:
    """Each decode step's logits [steps, vocab]: the prompt's prefill, then one token at a time from
    `ids` (the same tokens for every engine, so one flipped near-tie does not derail the rest),
    on this process's backend, as `generate` builds its stage."""
    import torch

    from smoltrain.models.hf import Checkpoint
    from smoltrain.models.stage import Stage

    prompt = [int(v) for v in PROMPT.split(",")]
    ck = Checkpoint(model)
    st = Stage(ck, 0, ck.config.layers, True, True, quantize=quantize, batched=False)
    st.open(0, len(prompt) + len(ids))
    rows = [st(torch.tensor([prompt]), [0])[0]]
    for t in ids[:-1]:
        rows.append(st(torch.tensor([[t]]), [0])[0])
    return torch.stack(rows).float().numpy()


# --- float64 references (this side) ---
def qai8dx(x: np.ndarray) -> np.ndarray:
    """Activations as KleidiAI's lhs_quant_pack_qai8dxp_f32 quantises them, dequantised: int8 per
    row, asymmetric, the range widened to hold 0, the scale and zero point in fp32."""
    x = x.astype(np.float32)
    out = np.empty(x.shape, np.float64)
    lo, hi = np.float32(-128), np.float32(127)
    for i, row in enumerate(x):
        rmin, rmax = min(np.float32(0), row.min()), max(np.float32(0), row.max())
        scale = np.float32(1) if rmin == rmax else np.float32((hi - lo) / (rmax - rmin))
        recip = np.float32(1 / scale) if scale else np.float32(0)
        dmin, dmax = np.float32(rmin * scale), np.float32(rmax * scale)
        zp = lo - dmin if (lo + dmin) + (hi + dmax) > 0 else hi - dmax
        zp = np.rint(np.clip(zp, lo, hi))
        q = np.clip(np.rint(row * scale) + zp, lo, hi)
        out[i] = (q.astype(np.float64) - zp) * np.float64(recip)
    return out


def q8_0(x: np.ndarray) -> np.ndarray:
    """Activations per 32 as Q8_0 (our native product's), dequantised."""
    import torch

    from smoltrain.models import quant

    q, d = quant.quantize_q8_0(torch.from_numpy(x))
    return quant.dequantize_q8_0(q, d).double().numpy()


def errors(got: np.ndarray, ref: np.ndarray) -> dict:
    peak = float(np.abs(ref).max())
    diff = got.astype(np.float64) - ref
    return {
        "max_abs": float(np.abs(diff).max()),
        "max_rel": float(np.abs(diff).max() / peak),  # of the output's largest magnitude
        "rms_rel": float(np.sqrt((diff**2).mean() / (ref**2).mean())),
    }


def x86_products(cases: dict) -> dict:
    """Our native q4 product and torch's portable `_dyn_quant_matmul_4bit` on this machine."""
    import torch

    from smoltrain.models import backends, quant

    class PortableKleidiAI(backends.KleidiAI):  # torch's reference path of the same operator
        def unavailable(self):
            return None

    out = {}
    for name, (w, x) in cases.items():
        with backends.using("native"):
            ours = quant.Linear(torch.from_numpy(w), None, torch.float32, "q4")
            assert ours.kernel == "q4_0", ours.kernel
            y_ours = ours(torch.from_numpy(x)).numpy()
        saved, backends._chosen = backends._chosen, (PortableKleidiAI(), {})
        try:
            ref = quant.Linear(torch.from_numpy(w), None, torch.float32, "q4")
        finally:
            backends._chosen = saved
        out[name] = {"ours": y_ours, "portable": ref(torch.from_numpy(x)).numpy()}
    return out


def references(w: np.ndarray, x: np.ndarray) -> dict:
    import torch

    from smoltrain.models import quant

    q, d = quant.quantize_q4(torch.from_numpy(w))
    w32 = quant.dequantize_q4(q, d).double().numpy()
    wbf = quant.dequantize_q4(q, d.bfloat16().float()).double().numpy()
    return {"own": qai8dx(x) @ wbf.T, "exact": x.astype(np.float64) @ w32.T, "q8_0": q8_0(x) @ w32.T}


# --- the bench ---
def emulated(work: Path, argv: list[str], cpu: str) -> float:
    """Run argv in the emulated root as QEMU_CPU `cpu`; its wall time in seconds."""
    from common import ROOT, sh

    t = time.perf_counter()
    os.environ["QEMU_CPU"] = cpu
    try:
        sh([ROOT / "scripts/arm64-root.sh", "exec", work, *argv], timeout=1800)
    finally:
        os.environ.pop("QEMU_CPU")
    return round(time.perf_counter() - t, 1)


def generate(model: str, out: Path, *extra: str) -> list[int]:
    from common import PY, sh

    sh([PY, "-m", "smoltrain", "generate", "--strategy", "local", "--model", model, "--prompt-ids", PROMPT]
       + ["--threads", "1", "--ignore-eos", "--json", out, *extra])  # fmt: skip
    return json.loads(out.read_text())["output_ids"]


def compare(cases: dict, refs: dict, x86: dict, kai, doc: dict) -> dict:
    """One CPU model's products against the references and ours, per shape."""
    per = {}
    for name in cases:
        r, y = refs[name], kai[name]
        e = {
            "packed": doc["packed"][name],
            "kleidiai_vs_own": errors(y, r["own"]),
            "kleidiai_vs_exact": errors(y, r["exact"]),
            "ours_vs_exact": errors(x86[name]["ours"], r["exact"]),
            "ours_vs_q8_0": errors(x86[name]["ours"], r["q8_0"]),
            "kleidiai_vs_ours": errors(y, x86[name]["ours"].astype(np.float64)),
            "kleidiai_vs_portable_x86": errors(y, x86[name]["portable"].astype(np.float64)),
            "emulated_s": doc["emulated_s"][name],
        }
        e["exact_rms_ratio"] = e["kleidiai_vs_exact"]["rms_rel"] / e["ours_vs_exact"]["rms_rel"]
        per[name] = e
    return per


def logit_errors(kai: np.ndarray, ours: np.ndarray, fp32: np.ndarray) -> dict:
    """Teacher-forced decode logits: each q4 engine's RMS error against fp32, and top-1 agreement."""
    rms = lambda a, b: float(np.sqrt(((a - b) ** 2).mean()))  # noqa: E731
    kai_err, ours_err = rms(kai, fp32), rms(ours, fp32)
    return {
        "kleidiai_rms": kai_err,
        "ours_rms": ours_err,
        "ratio": kai_err / ours_err,
        "kleidiai_vs_ours_rms": rms(kai, ours),
        "fp32_logit_rms": float(np.sqrt((fp32**2).mean())),
        "top1_kleidiai_same_as_ours": int((kai.argmax(1) == ours.argmax(1)).sum()),
        "top1_same_as_fp32": {
            "kleidiai": int((kai.argmax(1) == fp32.argmax(1)).sum()),
            "ours": int((ours.argmax(1) == fp32.argmax(1)).sum()),
            "of": len(fp32),
        },  # fmt: skip
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=SHAPES, help="rows x in x out, comma-separated")
    ap.add_argument("--cpus", default=CPUS, help="QEMU_CPU models, comma-separated")
    ap.add_argument("--tokens", type=int, default=8, help="decode steps to compare (0: none)")
    ap.add_argument("--inside", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.inside:
        inside(a.inside)
        return 0
    from common import ROOT, sh

    from smoltrain.models import backends

    try:
        cases_shape = shapes(a.shapes)
    except ValueError as e:
        ap.error(str(e))  # one line, exit 2
    cpus = [c for c in a.cpus.split(",") if c]
    if not cpus or a.tokens < 0:
        ap.error("--cpus names at least one QEMU_CPU model; --tokens is 0 or more")
    t = time.perf_counter()
    root = sh([ROOT / "scripts/arm64-root.sh", "build"], timeout=1800).stdout.strip()
    data = {"root": root, "root_build_s": round(time.perf_counter() - t, 1), "cpus": {}}
    rng = np.random.default_rng(39)
    cases = {
        f"{m}x{k}x{n}": (rng.standard_normal((n, k), np.float32) * 0.02, rng.standard_normal((m, k), np.float32))
        for m, k, n in cases_shape
    }
    with tempfile.TemporaryDirectory(prefix="smol-kai-") as tmp:
        work = Path(tmp)
        np.savez(work / "inputs.npz", **{f"{n}.{p}": v for n, (w, x) in cases.items() for p, v in (("w", w), ("x", x))})
        x86 = x86_products(cases)
        refs = {name: references(w, x) for name, (w, x) in cases.items()}
        if a.tokens:
            import llama_checkpoint

            model = llama_checkpoint.build(
                str(work / "llama"), hidden=256, layers=2, vocab=512, ctx=64, tokenizer=False
            )
            fp32_ids = generate(model, work / "fp32.json", "--max-new-tokens", str(a.tokens), "--kernels", "native")
            (work / "ids.json").write_text(json.dumps(fp32_ids))
            with backends.using("native"):
                fp32, ours = forced_logits(model, None, fp32_ids), forced_logits(model, "q4", fp32_ids)
        for cpu in cpus:
            took = emulated(work, ["python", "/src/bench/bench_kleidiai.py", "--inside", "/work"], cpu)
            doc, kai = json.loads((work / "kai.json").read_text()), np.load(work / "kai.npz")
            data["cpus"][cpu] = {k: doc[k] for k in ("machine", "torch", "kleidiai_available", "auto", "passed_over")}
            data["cpus"][cpu].update(kernels=doc["kernels"], wall_s=took, shapes=compare(cases, refs, x86, kai, doc))
            if a.tokens:
                data["cpus"][cpu]["decode"] = logit_errors(kai["logits"], ours, fp32)
                data["cpus"][cpu]["decode"]["emulated_s"] = doc["emulated_s"]["decode"]
        if a.tokens:  # the whole command, end to end, on the first CPU model: its tokens and report
            argv = ["python", "-m", "smoltrain", "generate", "--strategy", "local", "--model", "/work/llama"]
            argv += ["--prompt-ids", PROMPT, "--threads", "1", "--ignore-eos", "--max-new-tokens", str(a.tokens)]
            took = emulated(
                work, [*argv, "--quantize", "q4", "--kernels", "kleidiai", "--json", "/work/g.json"], cpus[0]
            )
            gen = json.loads((work / "g.json").read_text())
            q4_ids = generate(model, work / "q4.json", "--max-new-tokens", str(a.tokens), "--kernels", "native",
                              "--quantize", "q4")  # fmt: skip
            data["generate"] = {"qemu_cpu": cpus[0], "prompt": PROMPT, "fp32_x86": fp32_ids, "q4_native_x86": q4_ids,
                                "q4_kleidiai_emulated": gen["output_ids"], "kernels": gen["kernels"], "wall_s": took}  # fmt: skip
    return finish(data, cpus)


def finish(data: dict, cpus: list[str]) -> int:
    """Judge the bars, write the result, print the headline; the exit status."""
    from common import exit_code, write_result

    runs = list(data["cpus"].values())
    shapes_ = [s for c in runs for s in c["shapes"].values()]
    decode = [c["decode"] for c in runs if "decode" in c]
    data["bars"] = {
        "auto_picks_kleidiai": all(c["auto"] == "kleidiai" and c["kleidiai_available"] for c in runs),
        "arm_kernels_ran": all(s["packed"] == "kleidiai" for s in shapes_),
        "equals_own_reference": all(s["kleidiai_vs_own"]["max_rel"] <= OWN_BAR for s in shapes_),
        "product_error_within_2x_ours": all(s["exact_rms_ratio"] <= EXACT_RATIO_BAR for s in shapes_),
        "logit_error_within_2x_ours": all(d["ratio"] <= EXACT_RATIO_BAR for d in decode),
    }
    met = all(data["bars"].values())
    own = max(s["kleidiai_vs_own"]["max_rel"] for s in shapes_)
    ratios = [s["exact_rms_ratio"] for s in shapes_]
    headline = (
        f"emulated aarch64 torch {runs[0]['torch']} ({', '.join(cpus)}): auto picks kleidiai "
        f"{'yes' if data['bars']['auto_picks_kleidiai'] else 'NO'}; = its float64 reference to {own:.1e} of the peak; "
        f"product error {min(ratios):.2f}-{max(ratios):.2f}x our x86 q4's"
    )
    if decode:
        headline += (
            f"; decode logit error {min(d['ratio'] for d in decode):.2f}-{max(d['ratio'] for d in decode):.2f}x ours"
        )
    bar = "q4 on kleidiai (emulated aarch64): Arm's kernels chosen and run, = float64 within 1e-4, error <= 2x our q4's"
    path = write_result("kleidiai", bar, met, headline, data)
    print(json.dumps(data["bars"]), headline, f"-> {path}", sep="\n")
    return exit_code(met)


if __name__ == "__main__":
    sys.exit(main())
