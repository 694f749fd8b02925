"""Serving for throughput, side by side in one run: continuous batching (8 concurrent clients vs one,
on the same ranks) for the one-process server and for pp over 2 sim hosts; then replicas vs one
split on a 4-host sim of unequal CPU caps, each measured against `plan --mode serve`; time to first
token (p50, p99) under that load; then `generate` (batch-1 decode) with pp and tp over the same 4
hosts against its plan, for this Llama and a GPT-2 of the demo's tiny8 shape. Every plan is shown
beside the same plan on the compute report less its timed decode products (`decode_bw_bytes_s`):
weights read at the copy bandwidth, as before calibrate timed them.

The model is a random-weight Llama (made with transformers) big enough that a decode step is
bound by reading the weights (hidden 1024, 8 layers: ~130M parameters, ~0.5 GB fp32), which is
why a batch of 8 costs about what 1 costs. Every rank runs one torch thread. Clients stream
(`/v1/completions`, greedy, ignore_eos) and time each token as it arrives. Steady decode tokens/s
of a run: the tokens that arrived while every client was past its first token and none had
finished, over that window (one client: its first to last token). The plan is `smoltrain plan
--mode serve` on the sim's measured compute (`calibrate -i`) and links (`smolnet matrix`).

    flock /tmp/smol-sim.lock .venv/bin/python bench/bench_serve.py --json bench/out/serve.json
    flock /tmp/smol-sim.lock .venv/bin/python bench/bench_serve.py --parts local   # no sim (no root)
    flock /tmp/smol-sim.lock .venv/bin/python bench/bench_serve.py --parts replicas-sim,decode-sim
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from common import ROOT, exit_code, write_result

CAPS = "0.15,0.25,0.45,0.65"  # the home scenario's Pi 5, Jetson, Mac mini, laptop


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """`smoltrain serve` as a user runs it, until the block ends."""

    def __init__(self, *argv: str):
        self.port = free_port()
        cmd = [sys.executable, "-m", "smoltrain", "serve", *argv, "--port", str(self.port), "--timeout", "300"]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        self.lines: list[str] = []
        ready = threading.Event()

        def read():
            for ln in self.proc.stderr:
                self.lines.append(ln)
                if "/v1" in ln and "serving" in ln:
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(600)
        if self.proc.poll() is not None or not any("serving" in ln for ln in self.lines):
            raise SystemExit(f"serve {' '.join(argv)} did not start: {''.join(self.lines[-5:])}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(60)


def stream(port: int, prompt: list[int], new: int, barrier=None) -> dict:
    """One streamed completion: when it was sent and when each token arrived."""
    body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True, "stream": True}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    if barrier is not None:
        barrier.wait()
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise SystemExit(f"request failed: {r.status} {r.read()[:200]}")
    times = []
    while True:
        ln = r.fp.readline()
        if not ln or ln.startswith(b"data: [DONE]"):
            break
        if ln.startswith(b"data: "):
            ch = json.loads(ln[6:])
            if ch["choices"] and ch["choices"][0]["text"]:
                times.append(time.perf_counter())
    c.close()
    return {"t0": t0, "times": times}


def clients(port: int, n: int, new: int, prompt_len: int) -> list[dict]:
    out: list = [None] * n
    barrier = threading.Barrier(n)

    def one(i):
        prompt = [(7 * i + k) % 997 + 1 for k in range(prompt_len)]
        out[i] = stream(port, prompt, new, barrier)

    ts = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(p / 100 * len(xs) + 0.5)) - 1))]


def summary(runs: list[dict]) -> dict:
    """Steady decode tokens/s (the window where every client decodes) and time to first token."""
    firsts = [r["times"][0] for r in runs]
    lasts = [r["times"][-1] for r in runs]
    start, end = max(firsts), min(lasts)
    if len(runs) == 1:
        steady = (len(runs[0]["times"]) - 1) / (end - start)
    else:
        inside = sum(1 for r in runs for t in r["times"] if start < t <= end)
        steady = inside / (end - start) if end > start else float("nan")
    ttft = [r["times"][0] - r["t0"] for r in runs]
    total = sum(len(r["times"]) for r in runs)
    return {
        "clients": len(runs),
        "tokens": total,
        "steady_tokens_per_s": steady,
        "overall_tokens_per_s": total / (max(lasts) - min(r["t0"] for r in runs)),
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": pct(ttft, 99),
    }


def batching(args, where: list[str], label: str) -> dict:
    """One client, then `--clients` at once, on the same server."""
    with Served(*where, "--max-batch", str(args.clients)) as s:  # one thread per rank: --threads 1 / the sim's caps
        clients(s.port, 1, 4, args.prompt)  # warm up: first touches of the weights
        one = [summary(clients(s.port, 1, args.new, args.prompt)) for _ in range(2)]
        one = max(one, key=lambda x: x["steady_tokens_per_s"])
        many = summary(clients(s.port, args.clients, args.new, args.prompt))
    row = {
        "setup": label,
        "one_client_tokens_per_s": one["steady_tokens_per_s"],
        "clients": args.clients,
        "many_tokens_per_s": many["steady_tokens_per_s"],
        "ratio": many["steady_tokens_per_s"] / one["steady_tokens_per_s"],
        "ttft_one_s": one["ttft_p50_s"],
        "ttft_p50_s": many["ttft_p50_s"],
        "ttft_p99_s": many["ttft_p99_s"],
    }
    print(
        f"{label}: 1 client {row['one_client_tokens_per_s']:.2f} tok/s, {args.clients} clients "
        f"{row['many_tokens_per_s']:.2f} tok/s ({row['ratio']:.2f}x), TTFT p50 {row['ttft_p50_s']:.2f} s",
        flush=True,
    )
    return row


def sim_up(name: str, hosts: int, subnet: str, inv: str, caps: str | None):
    from smolnet.sim import cluster as sim

    return sim.up(name=name, scenario="uniform", hosts=hosts, subnet=subnet, inventory=inv, cpu_limit=caps)


def run(cmd: list[str], tmp: str) -> None:
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])}: {r.stderr.strip()[-500:]}")


def replicas(args, model: str, tmp: str) -> dict:
    """The 4-host sim: split (pp over 4), 2 replicas of pp over 2, 4 single-host replicas, vs the plan."""
    from smolnet.sim import cluster as sim

    inv = os.path.join(tmp, "sv2.yml")
    sim_up("sv2", 4, "10.64.2.0/24", inv, args.caps)
    try:
        compute, links, plan = (os.path.join(tmp, f) for f in ("compute.json", "links.json", "plan.json"))
        py = sys.executable
        run([py, "-m", "smoltrain", "calibrate", "-i", inv, "--out", compute, "--model", args.calibrate_model], tmp)
        run([py, "-m", "smolnet", "matrix", "-i", inv, "--duration", "1", "--out", tmp, "--json", links], tmp)
        seq = str(args.prompt + args.new // 2)  # the KV cache a step reads, on average
        from dataclasses import asdict

        from smoltrain.models.hf import read_config

        shape = os.path.join(tmp, "shape.json")  # the checkpoint's shape, for the plan
        with open(shape, "w") as f:
            json.dump(asdict(read_config(model).spec()), f)
        copy_only = without_decode_rates(compute, tmp)
        docs = []
        for report in (compute, copy_only):
            run(
                [py, "-m", "smoltrain", "plan", "--mode", "serve", "-i", inv, "--links", links, "--compute", report]
                + ["--model", shape, "--concurrency", str(args.clients), "--seq", seq]
                + ["--max-batch", str(args.clients), "--json", plan],
                tmp,
            )
            with open(plan) as f:
                docs.append(json.load(f))
        doc, old = docs
        out = {"plan_best": doc["best"], "plan": doc, "rows": [], "decode": []}
        rows = out["rows"]
        setups = [("1", "split"), ("2", "2 replicas"), ("4", "4 replicas")]
        if doc["best"] not in {name for _, name in setups}:
            setups.append(("auto", doc["best"]))  # serve's default runs the plan's best
        for r, name in setups if "replicas-sim" in args.parts.split(",") else ():
            pred = next(c for c in doc["candidates"] if c["name"] == name)
            before = next(c for c in old["candidates"] if c["name"] == name)
            where = ["-i", inv, "--model", model, "--strategy", "pp", "--replicas", r]
            with Served(*where, "--compute", compute, "--links", links, "--max-batch", str(args.clients)) as s:
                clients(s.port, args.clients, 4, args.prompt)  # warm up
                m = summary(clients(s.port, args.clients, args.new, args.prompt))
            row = {
                "setup": name,
                "groups": pred["groups"],
                "measured_tokens_per_s": m["steady_tokens_per_s"],
                "plan_tokens_per_s": pred["tokens_per_s"],
                "measured_vs_plan": m["steady_tokens_per_s"] / pred["tokens_per_s"],
                "plan_source": doc.get("decode_source"),
                # the same plan with the weights read at the copy bandwidth (the report less its decode rates)
                "copy_plan_tokens_per_s": before["tokens_per_s"],
                "measured_vs_copy_plan": m["steady_tokens_per_s"] / before["tokens_per_s"],
                "ttft_p50_s": m["ttft_p50_s"],
                "ttft_p99_s": m["ttft_p99_s"],
                "plan_ttft_s": pred["ttft_s"],
            }
            rows.append(row)
            print(
                f"{name}: {row['measured_tokens_per_s']:.2f} tok/s, plan {row['plan_tokens_per_s']:.2f} "
                f"({row['measured_vs_plan']:.2f}; copy-bandwidth plan {row['measured_vs_copy_plan']:.2f}), "
                f"TTFT p50 {row['ttft_p50_s']:.2f} s p99 {row['ttft_p99_s']:.2f} s",
                flush=True,
            )
        if "decode-sim" in args.parts.split(","):
            out["decode"] = decode_vs_plan(args, inv, compute, copy_only, links, model, tmp)
        return out
    finally:
        sim.down(name="sv2")


def without_decode_rates(compute: str, tmp: str) -> str:
    """The compute report less its timed decode products: a plan on it reads weights at the copy bandwidth."""
    with open(compute) as f:
        doc = json.load(f)
    for h in doc["hosts"]:
        h.pop("decode_bw_bytes_s", None)
    path = os.path.join(tmp, "compute-copy.json")
    with open(path, "w") as f:
        json.dump(doc, f)
    return path


def small_gpt2(path: str) -> str:
    """A random GPT-2 of the demo's tiny8 shape (what its export writes): a decode step of it is
    per-operation cost, its 3.5 MB of weights stay in cache."""
    import transformers

    from smoltrain.models.spec import get_model

    m = get_model("tiny8")
    cfg = transformers.GPT2Config(
        vocab_size=m.vocab, n_positions=m.ctx, n_embd=m.hidden, n_layer=m.layers, n_head=m.heads, n_inner=m.ffn
    )
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
    return path


def decode_vs_plan(args, inv: str, compute: str, copy_only: str, links: str, model: str, tmp: str) -> list[dict]:
    """`generate` pp and tp over the 4 capped hosts (placed auto on the reports, as the demo does),
    decode tokens/s against the plan generate made, and against the same request planned on the
    report less its decode rates (weights at the copy bandwidth)."""
    from smolnet.inventory import load_inventory
    from smoltrain.planner.links import read_report
    from smoltrain.planner.request import PlanRequest, build_plan

    rows = []
    hosts = load_inventory(inv).hosts
    for label, path, new in (("llama", model, args.new), ("tiny8 gpt2", small_gpt2(os.path.join(tmp, "tiny8")), 32)):
        for strat in ("pp", "tp"):
            out = os.path.join(tmp, f"gen-{strat}.json")
            ids = ",".join(str(i) for i in range(1, 13))
            argv = ["generate", "--strategy", strat, "-i", inv, "--model", path, "--prompt-ids", ids]
            argv += ["--max-new-tokens", str(new), "--ignore-eos", "--links", links, "--compute", compute]
            try:
                run([sys.executable, "-m", "smoltrain", *argv, "--json", out], tmp)
            except SystemExit as e:  # one failed split must not lose the others
                print(f"decode {label} {strat}: failed: {e}", flush=True)
                rows.append({"model": label, "strategy": strat, "error": str(e)})
                continue
            with open(out) as f:
                g = json.load(f)
            p = g["plan"]
            req = PlanRequest(strat, _spec(path), mode="infer", world=len(hosts))
            req.batch, req.seq, req.placement, req.hosts = 1, p["seq"], p["placement"], hosts
            req.links, req.compute, req.strict, req.dtype = read_report(links), copy_only, True, p["dtype"]
            old = build_plan(req)
            row = {
                "model": label,
                "strategy": strat,
                "order": g["placement"]["order"],
                "measured_tokens_per_s": g["decode"]["tokens_per_s"],
                "plan_tokens_per_s": p["tokens_per_s"],
                "plan_source": p.get("decode_source"),
                "measured_vs_plan": g["decode"]["tokens_per_s"] / p["tokens_per_s"],
                "copy_plan_tokens_per_s": old["tokens_per_s"],
                "measured_vs_copy_plan": g["decode"]["tokens_per_s"] / old["tokens_per_s"],
            }
            rows.append(row)
            print(
                f"decode {label} {strat}: {row['measured_tokens_per_s']:.2f} tok/s, plan {row['plan_tokens_per_s']:.2f} "
                f"({row['measured_vs_plan']:.2f}), copy-bandwidth plan {row['copy_plan_tokens_per_s']:.2f} "
                f"({row['measured_vs_copy_plan']:.2f})",
                flush=True,
            )
    return rows


def _spec(path: str):
    from smoltrain.models.hf import read_config

    return read_config(path).spec()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--new", type=int, default=48, help="tokens each client asks for")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--parts", default="local,pp-sim,replicas-sim,decode-sim")
    ap.add_argument(
        "--calibrate-model",
        default="none",
        help="calibrate's --model: tiny8 times a one-token forward (decode's fixed cost)",
    )
    ap.add_argument("--caps", default=CAPS, help="the 4-host sim's CPU caps, cores per host")
    ap.add_argument("--json")
    a = ap.parse_args()
    parts = a.parts.split(",")
    from bench_infer import make_model

    tmp = tempfile.mkdtemp(prefix="bench-serve-")
    model = os.path.join(tmp, "llama")
    make_model(model, a.hidden, a.layers)
    out: dict = {"model": {"hidden": a.hidden, "layers": a.layers}, "new": a.new, "prompt": a.prompt}
    out["batching"] = []
    if "local" in parts:
        out["batching"].append(batching(a, ["--strategy", "local", "--model", model, "--threads", "1"], "local 1"))
    if "pp-sim" in parts:
        from smolnet.sim import cluster as sim

        inv = os.path.join(tmp, "sv1.yml")
        sim_up("sv1", 2, "10.64.1.0/24", inv, None)
        try:
            where = ["-i", inv, "--model", model, "--strategy", "pp", "--replicas", "1"]
            out["batching"].append(batching(a, where, "pp 2 sim hosts"))
        finally:
            sim.down(name="sv1")
    if "replicas-sim" in parts or "decode-sim" in parts:
        out["replicas"] = replicas(a, model, tmp)
    print(f"\nmodel: Llama hidden {a.hidden}, {a.layers} layers; {a.new} new tokens, prompt {a.prompt}")
    print(f"| setup | 1 client tok/s | {a.clients} clients tok/s | ratio | TTFT 1 client s | TTFT p50 s | p99 s |")
    print("|---|---|---|---|---|---|---|")
    for r in out["batching"]:
        print(
            f"| {r['setup']} | {r['one_client_tokens_per_s']:.2f} | {r['many_tokens_per_s']:.2f} | "
            f"{r['ratio']:.2f}x | {r['ttft_one_s']:.2f} | {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} |"
        )
    if out.get("replicas", {}).get("rows"):
        print(f"\n4-host sim (caps {a.caps} cores), {a.clients} clients; plan's best: {out['replicas']['plan_best']}")
        print(
            "| setup | groups | measured tok/s | plan tok/s | measured/plan | copy-bw plan tok/s | measured/copy-bw plan "
            "| TTFT p50 s | p99 s | plan TTFT s |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in out["replicas"]["rows"]:
            print(
                f"| {r['setup']} | {' / '.join(','.join(g) for g in r['groups'])} | "
                f"{r['measured_tokens_per_s']:.2f} | {r['plan_tokens_per_s']:.2f} | {r['measured_vs_plan']:.2f} | "
                f"{r['copy_plan_tokens_per_s']:.2f} | {r['measured_vs_copy_plan']:.2f} | "
                f"{r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | {r['plan_ttft_s']:.2f} |"
            )
    if out.get("replicas", {}).get("decode"):
        print(f"\ngenerate (batch-1 decode) over the 4-host sim (caps {a.caps} cores), placed auto")
        print(
            "| model | strategy | order | measured tok/s | plan tok/s | measured/plan | copy-bw plan tok/s | measured/copy-bw |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in out["replicas"]["decode"]:
            if "error" in r:
                print(f"| {r['model']} | {r['strategy']} | failed: {r['error'][-80:]} | | | | | |")
                continue
            print(
                f"| {r['model']} | {r['strategy']} | {','.join(r['order'])} | {r['measured_tokens_per_s']:.2f} | "
                f"{r['plan_tokens_per_s']:.2f} | {r['measured_vs_plan']:.2f} | {r['copy_plan_tokens_per_s']:.2f} | "
                f"{r['measured_vs_copy_plan']:.2f} |"
            )
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return verdict(out, a.clients)


BAR = "serving: 8 concurrent clients >= 4x one client's tokens/s; replicas vs split within 25% of the serve plan"


def verdict(out: dict, clients: int) -> int:
    """Keep the result (bench/results/serve.json) and exit by the bar (decode rows are kept, not judged here)."""
    ratios = [r["ratio"] for r in out["batching"]]
    plan = [r["measured_vs_plan"] for r in (out.get("replicas") or {}).get("rows") or []]
    met = bool(ratios or plan) and all(x >= 4 for x in ratios) and all(0.75 <= q <= 1.25 for q in plan)
    headline = f"{clients} clients " + ", ".join(f"{r['setup']} {r['ratio']:.2f}x" for r in out["batching"])
    headline += f"; plan {sum(0.75 <= q <= 1.25 for q in plan)} of {len(plan)} within 25%" if plan else ""
    kept = write_result("serve", BAR, met, headline, out)
    print(f"{headline}: {'met' if met else 'MISSED'} ({kept})")
    return exit_code(met)


if __name__ == "__main__":
    sys.exit(main())
