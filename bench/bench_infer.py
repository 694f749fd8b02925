"""Inference: decode tokens/s of pp over 2 loopback ranks vs the one-process reference, and measured
decode bytes per token vs the `--mode infer` plan, for pp and tp.

The model is a random-weight Llama (made with transformers) big enough that compute
dominates a decode step (default hidden 1024, 8 layers: ~130M parameters, ~0.5 GB
fp32), so the question is what the transport adds. Every rank and the reference run
one torch thread (--threads 1): pp stages run one after another in decode, so
at best pp matches the reference. Rounds alternate the setups so machine noise hits
all alike; each figure is the median over rounds.

    flock /tmp/smol-bench.lock .venv/bin/python bench/bench_infer.py --rounds 3 --json bench/out/infer.json
    flock /tmp/smol-bench.lock .venv/bin/python bench/bench_infer.py --rounds 1 --sim   # + shaped sim links (root)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from common import ROOT, exit_code, write_result

BAR = (
    "pp and tp 2: the tokens of --local 1 and decode bytes per token within 2% of the plan; with --sim, decode "
    "tokens/s within 25% of the plan on shaped links (pp 2 against --local 1 reported)"
)


def make_model(path: str, hidden: int, layers: int) -> None:
    from llama_checkpoint import build

    build(path, hidden, layers, vocab=1024, ctx=512, tokenizer=False)


def generate(model: str, strategy: str, world: int, new: int, out: str, inventory: str | None = None) -> dict:
    env = dict(os.environ)
    where = ["-i", inventory] if inventory else ["--local", str(world), "--threads", "1"]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "smoltrain",
            "generate",
            "--strategy",
            strategy,
            *where,
            "--model",
            model,
            "--prompt-ids",
            ",".join(str(i) for i in range(1, 33)),
            "--max-new-tokens",
            str(new),
            "--ignore-eos",
            "--json",
            out,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=900,
    )
    if r.returncode:
        raise SystemExit(f"{strategy} {world}: {r.stderr.strip()}")
    return json.load(open(out))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--new", type=int, default=64, help="tokens to generate per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sim", action="store_true", help="also pp and tp across a 2-host `uniform` sim (shaped links)")
    ap.add_argument("--json")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-infer-")
    model = os.path.join(tmp, "llama")
    make_model(model, a.hidden, a.layers)
    setups = [("local", 1), ("pp", 2), ("tp", 2)]
    runs: dict[str, list[dict]] = {f"{s}{w}": [] for s, w in setups}
    for rnd in range(a.rounds):
        order = setups if rnd % 2 == 0 else setups[::-1]
        for s, w in order:
            doc = generate(model, s, w, a.new, os.path.join(tmp, f"{s}{w}.json"))
            runs[f"{s}{w}"].append(doc)
            print(
                f"round {rnd} {s}{w}: decode {doc['decode']['tokens_per_s']:.2f} tok/s, "
                f"{doc['decode']['bytes_per_token']:.0f} B/token",
                flush=True,
            )
    ref = statistics.median(d["decode"]["tokens_per_s"] for d in runs["local1"])
    ref_best = max(d["decode"]["tokens_per_s"] for d in runs["local1"])
    rows = []
    for key, docs in runs.items():
        d = docs[-1]
        tps = statistics.median(x["decode"]["tokens_per_s"] for x in docs)
        bpt, plan_bpt = d["decode"]["bytes_per_token"], (d["plan"] or {}).get("bytes_per_token")
        best = max(x["decode"]["tokens_per_s"] for x in docs)
        cpu = statistics.median(x["decode"]["cpu_s"] / x["decode"]["tokens"] for x in docs)
        rows.append(
            {
                "setup": key,
                "decode_tokens_per_s": tps,
                "vs_local1": tps / ref,
                "best_tokens_per_s": best,
                "best_vs_local1": best / ref_best,
                "cpu_s_per_token": cpu,
                "ttft_s": statistics.median(x["ttft_s"] for x in docs),
                "bytes_per_token": bpt,
                "plan_bytes_per_token": plan_bpt,
                "bytes_vs_plan": (bpt / plan_bpt) if plan_bpt else None,
                "plan_tokens_per_s": (d["plan"] or {}).get("tokens_per_s"),
                "same_tokens_as_local1": d["output_ids"] == runs["local1"][-1]["output_ids"],
            }
        )
    print(
        f"\nmodel: Llama hidden {a.hidden}, {a.layers} layers, {a.new} new tokens, median and best of {a.rounds} rounds"
    )
    cpu_ref = next(r["cpu_s_per_token"] for r in rows if r["setup"] == "local1")
    print(
        "| setup | decode tok/s (median) | vs local 1 | best tok/s | best vs best local 1 | CPU s/token (all ranks) "
        "| local 1 CPU / this CPU | ttft s | B/token | plan B/token | measured/plan | same tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['setup']} | {r['decode_tokens_per_s']:.2f} | {r['vs_local1']:.2f}x | {r['best_tokens_per_s']:.2f} | "
            f"{r['best_vs_local1']:.2f}x | {r['cpu_s_per_token']:.4f} | {cpu_ref / r['cpu_s_per_token']:.2f}x | "
            f"{r['ttft_s']:.3f} | "
            f"{r['bytes_per_token']:.0f} | {r['plan_bytes_per_token'] or 0:.0f} | "
            f"{(r['bytes_vs_plan'] or 0):.3f} | {r['same_tokens_as_local1']} |"
        )
    sim_rows = run_sim(model, a.new, tmp) if a.sim else []
    doc = {"model": {"hidden": a.hidden, "layers": a.layers}, "new": a.new, "rows": rows, "sim": sim_rows}
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return verdict(doc)


def verdict(doc: dict) -> int:
    """Keep the result (bench/results/infer.json) and exit by the bar."""
    split = [r for r in doc["rows"] if r["setup"] != "local1"]
    exact = all(r["same_tokens_as_local1"] and abs((r["bytes_vs_plan"] or 0) - 1) <= 0.02 for r in split)
    sim = [r["decode_tokens_per_s"] / r["plan_tokens_per_s"] for r in doc["sim"] if r["plan_tokens_per_s"]]
    met = exact and len(sim) == len(doc["sim"]) and all(0.75 <= q <= 1.25 for q in sim)
    pp = next(r for r in doc["rows"] if r["setup"] == "pp2")
    headline = f"pp 2 {pp['vs_local1']:.2f}x --local 1; tokens and bytes {'as planned' if exact else 'NOT as planned'}"
    headline += "; sim " + ", ".join(f"{r['setup']} {q:.2f}" for r, q in zip(doc["sim"], sim)) if doc["sim"] else ""
    kept = write_result("infer", BAR, met, headline, doc)
    print(f"{headline}: {'met' if met else 'MISSED'} ({kept})")
    return exit_code(met)


def run_sim(model: str, new: int, tmp: str) -> list[dict]:
    """pp and tp across two namespaced hosts on tc-shaped links: decode tokens/s and bytes vs the plan."""
    from smolnet.sim import cluster as sim

    inv = os.path.join(tmp, "i2.yml")
    sim.up(name="i2", scenario="uniform", hosts=2, subnet="10.44.1.0/24", inventory=inv)
    rows = []
    try:
        for s in ("pp", "tp"):
            d = generate(model, s, 2, new, os.path.join(tmp, f"sim-{s}.json"), inventory=inv)
            p = d["plan"] or {}
            rows.append(
                {
                    "setup": f"{s}2-sim",
                    "decode_tokens_per_s": d["decode"]["tokens_per_s"],
                    "plan_tokens_per_s": p.get("tokens_per_s"),
                    "bytes_per_token": d["decode"]["bytes_per_token"],
                    "plan_bytes_per_token": p.get("bytes_per_token"),
                    "plan_bottleneck": p.get("bottleneck"),
                }
            )
    finally:
        sim.down(name="i2")
    print("\n| sim setup | decode tok/s | plan tok/s | measured/plan | B/token | plan B/token | plan bottleneck |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['setup']} | {r['decode_tokens_per_s']:.2f} | {r['plan_tokens_per_s'] or 0:.2f} | "
            f"{r['decode_tokens_per_s'] / (r['plan_tokens_per_s'] or 1):.2f} | {r['bytes_per_token']:.0f} | "
            f"{r['plan_bytes_per_token'] or 0:.0f} | {r['plan_bottleneck']} |"
        )
    return rows


if __name__ == "__main__":
    sys.exit(main())
