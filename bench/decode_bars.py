"""The bar bench/bench_decode.py is judged on, and its verdict from one thread count's figures
(kept beside the bench so its own edits stay apart from the bar's). The bars are issue 39's:
the decode kernels against the memory bound and against llama.cpp at the same width, and int8's
fidelity against llama.cpp's Q8_0 on the same model."""

from __future__ import annotations

BAR = (
    "fp32 decode >= 0.78 of the bandwidth bound; q4 >= 0.8x llama.cpp Q4_0, int8 >= 0.95x Q8_0; "
    "int8 logit error <= 1.1x Q8_0's"
)


def verdict(d: dict) -> tuple[bool, str]:
    """Whether the run `d` (bench_decode.bench's result) met the bar, and the headline. Without
    llama.cpp (--no-llama) the bar cannot be judged whole: a miss, said as one."""
    t, rf = d["tokens_per_s"], d["roofline_tokens_per_s"]
    share = t["fp32"] / rf["fp32"]
    line = f"{d['threads']} thread(s): fp32 {share:.2f} of the bound"
    if d.get("bound_source"):  # the highest of the bench's bandwidths (bench_decode.BOUNDS)
        line += f" ({d['bound_source']})"
    if "llama.cpp Q8_0" not in t:
        return False, line + "; llama.cpp left out (not judged)"
    l8, l4 = t["int8"] / t["llama.cpp Q8_0"], t["q4"] / t["llama.cpp Q4_0"]
    err = d["logit_rms_error_vs_fp32"]
    e8 = err["int8"] / err["llama.cpp Q8_0"]
    met = share >= 0.78 and l4 >= 0.8 and l8 >= 0.95 and e8 <= 1.1
    line += f"; q4 {l4:.2f}x llama.cpp Q4_0, int8 {l8:.2f}x Q8_0; int8 logit error {e8:.2f}x Q8_0's"
    return met, line
