"""The bar bench/bench_decode.py is judged on, and its verdict from one thread count's figures
(kept beside the bench so its own edits stay apart from the bar's)."""

from __future__ import annotations

BAR = "fp32 decode >= 0.60 of the bandwidth bound; int8 >= 1.8x, q4 >= 2.5x fp32; >= 0.5x llama.cpp"


def verdict(d: dict) -> tuple[bool, str]:
    """Whether the run `d` (bench_decode.bench's result) met the bar, and the headline. Without
    llama.cpp (--no-llama) the bar cannot be judged whole: a miss, said as one."""
    t, rf = d["tokens_per_s"], d["roofline_tokens_per_s"]
    share, i8, q4 = t["fp32"] / rf["fp32"], t["int8"] / t["fp32"], t["q4"] / t["fp32"]
    met = share >= 0.60 and i8 >= 1.8 and q4 >= 2.5
    line = f"{d['threads']} thread(s): fp32 {share:.2f} of the bound; int8 {i8:.2f}x, q4 {q4:.2f}x fp32"
    if "llama.cpp Q8_0" in t:
        l8, l4 = t["int8"] / t["llama.cpp Q8_0"], t["q4"] / t["llama.cpp Q4_0"]
        met = met and l8 >= 0.5 and l4 >= 0.5
        line += f"; {l8:.2f}x / {l4:.2f}x llama.cpp Q8_0 / Q4_0"
    else:
        met, line = False, line + "; llama.cpp left out (not judged)"
    return met, line
