"""Predicted vs measured step time per strategy on three sims built differently, and
calibrated compute vs each host's cap.

Scenarios (`--scenarios`, default all three, each its own sim), then `--draws` K clusters
(default 6) drawn from `--seed` (fresh each run when not given; printed, and kept in the result)
by the sim's scenario random (smolnet/sim/draw.py), each reported, misses included:
  home    the CPU-capped home sim (caps 0.15/0.25/0.45/0.65 cores scaled to this machine,
          the sim's own short CFS periods, readable by each host; 1-2.5 Gbit links)
  cores   one host per CPU of this machine (at most 4), a cpuset each and no quota: the
          plan's uncapped path, as on real machines; 1000/500 Mbit links with a peak rate
  hidden  four hosts capped 0.15/0.3/0.4/0.6 cores by a 10 ms CFS quota on a parent cgroup
          the host cannot read (a cgroup namespace), each its own machine; 300-800 Mbit
          links with a peak rate (no bursts after idling: smolnet/sim/net.py tbf_argv)

For each: measure the links (`smolnet matrix`), calibrate every host (`smoltrain calibrate
-i`, tiny8, median of `--repeat` probes), train each of the seven trained strategies for a
few steps (`smoltrain run -i`, placement auto) and compare with the plan made from the
measured links and compute (`plan --compare`). Two sets of runs (`--sets`): `main`
(tiny8, batch 8, seed 0: the runs the timing model was diagnosed on) and `heldout` (tiny,
batch 12, seed 7: a model, batch and seed that shaped nothing; tiny's figures are scaled
from tiny8's calibration). Target: measured/predicted within 0.75..1.25, bytes within 2%.

Also: on home, each host's calibrated fp32 FLOP/s against its cap's share of an uncapped
host's (the same hosts with `--cpu-limit 0`); on cores and hidden, against the cap's share
of one uncapped thread measured just before (a whole core for cores).

Writes bench/out/compute.md (and .json) and keeps the result in bench/results/compute.json
(bench/common.py); exits 1 when any run misses the bar. Run under the shared lock, on a machine nothing
else uses if the figures are to mean anything (it records how steady the machine was):
    flock /tmp/smol-sim.lock .venv/bin/python bench/bench_compute.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import PY, ROOT, exit_code, write_result
from compute_bars import BAR, CAL_BAR, calibration_verdict, verdict
from compute_decode import DECODE, checkpoint, run_decode
from compute_decode import lines as decode_lines
from compute_sims import BUILT_IN, WEIGHT_GROUP, describe, down, keys, sh, sim_of, up, weigh

from smoltrain.demo.report import nominal_step as _nominal_step

STRATEGIES = ("dp", "fsdp", "syncps", "edp", "mp", "pp", "tp")
SETS = {"main": {"model": "tiny8", "batch": 8, "seed": 0}, "heldout": {"model": "tiny", "batch": 12, "seed": 7}}
CALIBRATE_MODEL = "tiny8"


def calibrate(inv: Path, model: str, repeats: int, out: Path) -> None:
    """Every host's compute, each figure the median of `repeats` probes."""
    sh([PY, "-m", "smoltrain", "calibrate", "-i", inv, "--model", model, "--repeat", repeats, "--out", out])


def calibration_check(d: Path, capped: Path, repeats: int) -> list[dict]:
    """Capped hosts vs the same hosts uncapped: each probe's fp32 rate against the cap, and the
    median the plan used (a VM runs a capped host's work 0.75-0.95 as fast per CPU-second, from
    one process to the next; see BENCHMARKS.md)."""
    inv = up(d, "home", "0")
    try:
        calibrate(inv, "none", repeats, d / "uncapped.json")
    finally:
        down(sim_of("home")[0])
    free = {h["name"]: h for h in json.loads((d / "uncapped.json").read_text())["hosts"]}
    out = []
    for h in json.loads(capped.read_text())["hosts"]:
        n = h["name"]
        if h["status"] != "ok" or free[n]["status"] != "ok":
            continue
        cap = min(1.0, h["cpu_limit_cores"] or 1.0)
        ref = free[n]["flops"]["fp32"] * cap
        each = h.get("fp32_flops_each") or [h["flops"]["fp32"]]
        out.append({"host": n, "cap": cap, "ratios": [x / ref for x in each], "ratio": h["flops"]["fp32"] / ref})
    return out


def truth_check(inv: Path, report: Path, one_thread: float) -> list[dict]:
    """Calibrated fp32 FLOP/s of each host against the share the sim gives it (its cap, hidden
    or not, else a whole core) of one uncapped thread measured just before."""
    import yaml

    hosts = yaml.safe_load(inv.read_text())["all"]["children"]["cluster"]["hosts"]
    out = []
    for h in json.loads(report.read_text())["hosts"]:
        if h["status"] != "ok":
            continue
        cap = min(1.0, hosts[h["name"]].get("smol_sim_cpu_cores") or 1.0)
        each = h.get("fp32_flops_each") or [h["flops"]["fp32"]]
        ref = one_thread * cap
        out.append(
            {"host": h["name"], "cap": cap, "ratios": [x / ref for x in each], "ratio": h["flops"]["fp32"] / ref}
        )
    return out


STEADY = r"""
import sys, time, torch
torch.set_num_threads(1)
a, b = torch.randn(384, 384), torch.randn(384, 384)
for _ in range(20):
    torch.mm(a, b)
for _ in range(int(sys.argv[1])):
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.5:
        torch.mm(a, b)
        n += 1
    print(2 * 384**3 * n / (time.perf_counter() - t0))
"""


def steadiness(windows: int = 8) -> list[float]:
    """fp32 FLOP/s of one uncapped thread on this machine, half-second windows back to back.
    A shared VM's core can swing 1.8x within minutes (measured 2026-12-04: 5.1e10-9.3e10);
    no prediction holds through that, so the report says how steady the machine was."""
    r = sh([PY, "-c", STEADY, windows], ok=(0,))
    return [float(x) for x in r.stdout.split()]


def loop_delivery(caps: dict[str, float], windows: int = 6) -> dict[str, float]:
    """Per cap: the rate of a plain matmul loop (not smoltrain's probe) in a cgroup of that
    cap, over cap x the same loop uncapped just before. Tells the sim's own fidelity apart
    from the calibration's: where a VM's idle vCPU comes back slow, a capped CPU-second does
    less than an uncapped one, and the loop shows it too."""
    import statistics

    from smolnet.sim import cgroup

    out = {}
    for host, cores in caps.items():
        free = statistics.median(steadiness(windows))
        cg = cgroup.create(f"cbench-loop-{host}", cores)
        try:
            r = subprocess.run(
                [PY, "-c", STEADY, str(windows)],
                capture_output=True,
                text=True,
                timeout=300,
                preexec_fn=lambda cg=cg: cgroup.add_pid(cg, os.getpid()),
            )
        finally:
            cgroup.remove(cg)
        if r.returncode != 0:
            raise SystemExit(f"the plain loop under {host}'s cap failed ({r.returncode}): {r.stderr[-400:]}")
        out[host] = statistics.median(float(x) for x in r.stdout.split()) / (free * cores)
    return out


def _spread(vals: list[float]) -> str:
    return f"{min(vals):.3g}-{max(vals):.3g} FLOP/s (max/min {max(vals) / min(vals):.2f})"


def run_set(inv: Path, d: Path, set_name: str, cfg: dict, steps: str, strategies: list[str]) -> list[dict]:
    """Train each strategy with `cfg` and compare with its plan; one row per strategy."""
    rows = []
    for s in strategies:
        run, cmp = d / f"run-{set_name}-{s}.json", d / f"cmp-{set_name}-{s}.json"
        r = sh(
            [PY, "-m", "smoltrain", "run", "--strategy", s, "-i", inv, "--model", cfg["model"], "--batch", cfg["batch"]]
            + ["--seed", cfg["seed"], "--steps", steps, "--links", d / "links.json", "--compute", d / "compute.json"]
            + ["--json", run, "--out", d],
            ok=(0, 1, 2, 4),
        )
        failed = json.loads(run.read_text()).get("error") if run.exists() else None
        if not run.exists() or failed:
            why = failed or ((r.stdout + r.stderr).strip().splitlines() or ["no report"])[-1]
            rows.append({"strategy": s, "error": str(why)[:120]})
            continue
        sh(
            [PY, "-m", "smoltrain", "plan", "--compare", run, "--links", d / "links.json"]
            + ["--compute", d / "compute.json", "-i", inv, "--no-what-if", "--json", cmp]
        )
        c = json.loads(cmp.read_text())
        slow = max(c["ranks"], key=lambda x: x["compute_s"]["predicted"]) if c.get("ranks") else None
        rows.append(
            {
                "strategy": s,
                "pred": c["step_s"]["predicted"],
                "meas": c["step_s"]["measured"],
                "comm": [c["comm_s"]["predicted"], c["comm_s"]["measured"]],
                "slowest": [slow["name"], slow["compute_s"]["predicted"], slow["compute_s"]["measured"]]
                if slow
                else None,
                "nominal": _nominal_step(s, c["plan"], inv, d / "links.json"),
                "bytes_ok": c["bytes_within_2pct"],
                "missed": c.get("missed") or [],
                "outside": c.get("outside") or [],  # every rank's compute or comm term outside 25%
            }
        )
    return rows


def bench_scenario(scn: str, d: Path, a) -> dict:
    """One scenario (a built-in, or `random:N`: draw N): its sim, links, calibration, every set
    of runs, and the calibration check."""
    import statistics

    name, _ = sim_of(scn)
    d.mkdir(parents=True, exist_ok=True)
    steady = steadiness()
    inv = up(d, scn)
    if a.weight:
        weigh(a.weight, [name])
    try:
        sh([PY, "-m", "smolnet", "matrix", "-i", inv, "--duration", "2", "--out", d])
        calibrate(inv, CALIBRATE_MODEL, a.repeat, d / "compute.json")
        sets = {k: run_set(inv, d, k, SETS[k], a.steps, a.strategies.split(",")) for k in a.sets.split(",")}
        decode = run_decode(inv, d, a.model_dir, [x for x in a.decode.split(",") if x]) if a.decode else []
        truth = None if scn == "home" else truth_check(inv, d / "compute.json", statistics.median(steady))
    finally:
        down(name)
    if scn == "home":
        truth = calibration_check(d, d / "compute.json", a.repeat)
        loop = loop_delivery({c["host"]: c["cap"] for c in truth})
        for c in truth:
            c["loop"] = loop[c["host"]]
    return {
        "scenario": scn,
        "hosts": describe(scn).splitlines(),
        "steady_before": steady,
        "steady_after": steadiness(),
        "sets": sets,
        "decode": decode,
        "calibration": truth,
        "load": os.getloadavg(),
    }


def guarded(scn: str, d: Path, a) -> dict:
    """bench_scenario, with a sim or calibration that failed reported as that scenario's miss
    (the other scenarios still run)."""
    try:
        return bench_scenario(scn, d, a)
    except SystemExit as e:  # common.sh: a command failed, with its tail
        down(sim_of(scn)[0])
        return {"scenario": scn, "hosts": describe(scn).splitlines(), "error": str(e)[-400:], "sets": {}}


TITLES = {
    "home": "the CPU-capped home sim (readable caps, the sim's short periods, 1-2.5 Gbit)",
    "cores": "the whole-core sim (a cpuset each, no quota, 1000/500 Mbit with a peak rate)",
    "hidden": "the hidden-cap sim (10 ms quotas the hosts cannot read, own machines, 300-800 Mbit with a peak rate)",
}


def title(key: str) -> str:
    if key.startswith("random:"):
        return f"a drawn cluster (smolnet sim up --scenario random --seed {key.partition(':')[2]})"
    return TITLES[key]


def _ms(x) -> str:
    return f"{x * 1e3:.1f}" if x else "-"


def report(results: list[dict], a) -> str:
    lines = [
        f"# Compute prediction on {len(results)} sims ({a.steps} steps each run; calibrated with {CALIBRATE_MODEL}, "
        f"median of {a.repeat} probes; draws from bench --seed {a.seed})",
        "",
        f"Machine: {os.cpu_count()} cores. Other jobs on it slow the hosts (a capped host gets at most "
        "its fair share of a busy machine; a whole-core host shares its CPU with them)."
        + (f" The bench and its hosts ran at cpu.shares {a.weight} (others 1024)." if a.weight else ""),
    ]
    for res in results:
        lines += ["", f"## {res['scenario']}: {title(res['scenario'])}", ""]
        lines += [f"- {h}" for h in res.get("hosts") or []] + ([""] if res.get("hosts") else [])
        if res.get("error"):
            lines.append(f"FAILED before its runs: {res['error']}")
            continue
        lines += [
            f"Load average at the end {', '.join(f'{x:.1f}' for x in res['load'])}. One uncapped thread, 8 "
            f"half-second windows: before {_spread(res['steady_before'])}, after {_spread(res['steady_after'])}.",
        ]
        for set_name, rows in res["sets"].items():
            cfg = SETS[set_name]
            ok = sum(1 for r in rows if "error" not in r and 0.75 <= r["meas"] / r["pred"] <= 1.25)
            lines += [
                "",
                f"### {set_name}: {cfg['model']}, batch {cfg['batch']}, seed {cfg['seed']} "
                f"({ok} of {len(rows)} within 25%)",
                "",
                "| strategy | predicted ms | measured ms | measured/predicted | within 25% | comm ms pred/meas "
                "| slowest compute ms pred/meas | nominal ms | bytes within 2% | rank terms outside 25% |",
                "|---|---|---|---|---|---|---|---|---|---|",
            ]
            for r in rows:
                if "error" in r:
                    lines.append(f"| {r['strategy']} | - | - | - | - | - | - | - | - | {r['error']} |")
                    continue
                q = r["meas"] / r["pred"]
                sl = r["slowest"]
                slow = f"{sl[0]} {_ms(sl[1])}/{_ms(sl[2])}" if sl else "-"
                lines.append(
                    f"| {r['strategy']} | {_ms(r['pred'])} | {_ms(r['meas'])} | {q:.2f} | "
                    f"{'yes' if 0.75 <= q <= 1.25 else 'no'} | {_ms(r['comm'][0])}/{_ms(r['comm'][1])} | {slow} | "
                    f"{_ms(r['nominal'])} | {'yes' if r['bytes_ok'] else 'no'} | {'; '.join(r.get('outside') or []) or '-'} |"
                )
        lines += decode_lines(res.get("decode") or [])
        cal = res.get("calibration") or []
        ref = "the same host uncapped" if res["scenario"] == "home" else "one uncapped thread just before"
        lines += [
            "",
            f"Calibrated fp32 FLOP/s of each host over its cap's share (a whole core where none) of {ref}; "
            "each probe, and the median the plans used"
            + ("; last column: a plain matmul loop in a cgroup of the same cap." if res["scenario"] == "home" else "."),
            "",
            "| host | cap (cores) | share/cap, each probe | median | within 15% |"
            + (" a plain loop in the same cap |" if res["scenario"] == "home" else ""),
            "|---|---|---|---|---|" + ("---|" if res["scenario"] == "home" else ""),
        ]
        for c in cal:
            lines.append(
                f"| {c['host']} | {c['cap']:.2f} | {', '.join(f'{x:.2f}' for x in c['ratios'])} | {c['ratio']:.2f} | "
                f"{'yes' if abs(c['ratio'] - 1) <= 0.15 else 'no'} |" + (f" {c['loop']:.2f} |" if "loop" in c else "")
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", default="16")
    ap.add_argument("--scenarios", default=",".join(BUILT_IN), help="home, cores, hidden (comma-separated; none: '')")
    ap.add_argument("--draws", type=int, default=6, help="drawn clusters (smolnet/sim/draw.py) after the scenarios")
    ap.add_argument("--seed", type=int, default=None, help="the draws' seed (default: a fresh one, printed)")
    ap.add_argument("--sets", default=",".join(SETS), help="main (tiny8, batch 8, seed 0), heldout (tiny, 12, 7)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--decode", default=",".join(DECODE), help="decode runs per scenario: pp, tp (none: '')")
    ap.add_argument("--repeat", type=int, default=3, help="probes per host in each calibration (median)")
    ap.add_argument(
        "--weight",
        type=int,
        default=0,
        help="cpu.shares of the bench and its hosts (others have 1024; 0: none): less noise on a shared machine",
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "compute.md"))
    a = ap.parse_args()
    named = [x for x in a.scenarios.split(",") if x]
    bad = [x for x in named if x not in BUILT_IN] + [x for x in a.sets.split(",") if x not in SETS]
    bad += [x for x in a.decode.split(",") if x and x not in DECODE]
    if bad:
        ap.error(f"unknown scenario or set: {', '.join(bad)}")
    if a.draws < 0 or (a.seed is not None and not 0 <= a.seed < 2**32):
        ap.error("--draws must be >= 0 and --seed 0..2**32-1")
    if a.seed is None:
        from smolnet.sim.draw import fresh_seed

        a.seed = fresh_seed()
    todo = keys(named, a.seed, a.draws)
    print(f"bench_compute --seed {a.seed}: {', '.join(todo)}", flush=True)
    d = Path(tempfile.mkdtemp(prefix="cbench-"))
    a.model_dir = checkpoint(d) if a.decode else None
    if a.weight:
        weigh(a.weight)
    try:
        results = [guarded(scn, d / scn.replace(":", "-"), a) for scn in todo]
    finally:
        if a.weight:
            from smolnet.sim import cgroup

            cgroup.remove(cgroup.path(WEIGHT_GROUP))  # moves this process back out first
    text = report(results, a)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    print(text)
    met, headline = verdict(results)
    headline = f"--seed {a.seed}: {headline}"
    kept = write_result("compute", BAR, met, headline, {"seed": a.seed, "draws": a.draws, "results": results})
    print(f"{headline}: {'met' if met else 'MISSED'} ({kept})")
    cal_met, cal_line = calibration_verdict(results)
    cal = {"calibration": {res["scenario"]: res.get("calibration") for res in results}}
    kept = write_result("compute-calibration", CAL_BAR, cal_met, cal_line, dict(cal, seed=a.seed))
    print(f"{cal_line}: {'met' if cal_met else 'MISSED'} ({kept})")
    return exit_code(met and cal_met)


if __name__ == "__main__":
    sys.exit(main())
