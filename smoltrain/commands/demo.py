"""`smoltrain demo`: the whole flow on the built-in cluster, one stage at a time.

Each stage is a plain command line (the same ones the README teaches), so the demo
doubles as a check that the tutorial still works. A failing stage is named with its
reason, and the sim is always taken down again.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from smolnet.errors import SmolError

ROOT = Path(__file__).resolve().parents[2]


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="shorter measurements and runs (CI)")
    p.add_argument("--out", default="reports", help="report directory (default reports/)")
    p.add_argument("--name", default="smol", help="sim name")
    p.add_argument("--subnet", default="10.213.0.0/24", help="sim subnet")
    p.add_argument("--keep", action="store_true", help="leave the sim up afterwards")
    p.add_argument("--skip-provision", action="store_true", help="skip the Ansible stage")


class Stage:
    def __init__(self, console, out: Path):
        self.console = console
        self.out = out
        self.log = out / "demo.log"
        self.results: list[dict] = []

    def run(self, title: str, argv: list[str], ok_codes=(0,), timeout: float = 600) -> subprocess.CompletedProcess:
        self.console.rule(f"[bold]{title}")
        self.console.print(f"[dim]$ {' '.join(shlex.quote(a) for a in argv)}")
        t0 = time.monotonic()
        env = dict(os.environ, PYTHONUNBUFFERED="1", ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"))
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
        with open(self.log, "a") as log:
            log.write(f"\n$ {' '.join(argv)}\n")
            log.flush()
            try:
                p = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                raise SmolError(f"stage '{title}' timed out after {timeout:.0f}s (log: {self.log})") from None
            log.write(p.stdout)
        sys.stdout.write(p.stdout[-6000:])
        dt = time.monotonic() - t0
        self.results.append({"stage": title, "rc": p.returncode, "seconds": round(dt, 1)})
        if p.returncode not in ok_codes:
            last = [ln for ln in p.stdout.strip().splitlines() if ln.strip()][-1:] or ["no output"]
            raise SmolError(f"stage '{title}' failed (exit {p.returncode}): {last[0][:300]} (log: {self.log})")
        return p


def run(args) -> int:
    from rich.console import Console

    console = Console()
    out = (ROOT / args.out) if not os.path.isabs(args.out) else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stage = Stage(console, out)
    stage.log.write_text("")
    py = sys.executable
    inv = str(ROOT / "inventory" / ("sim.yml" if args.name == "smol" else f"sim-{args.name}.yml"))
    dur = "1" if args.quick else "3"
    steps = "6" if args.quick else "20"
    up = False
    try:
        subprocess.run([py, "-m", "smolnet", "sim", "down", "--name", args.name], cwd=ROOT,
                       capture_output=True, timeout=120)
        stage.run("1. cluster: sim up", [py, "-m", "smolnet", "sim", "up", "--name", args.name,
                                         "--subnet", args.subnet, "--inventory", inv])
        up = True
        stage.run("   cluster: status", [py, "-m", "smolnet", "sim", "status", "--name", args.name])
        if not args.skip_provision and (ROOT / "playbooks" / "site.yml").exists():
            stage.run("2. provision: names, keys, MTU, NFS", [str(Path(py).parent / "ansible-playbook"),
                      "-i", inv, str(ROOT / "playbooks" / "site.yml"), "-e", "mtu_strict=false"])
        links = out / "links.json"
        stage.run("3. measure: every link, both directions",
                  [py, "-m", "smolnet", "matrix", "-i", inv, "--duration", dur, "--out", str(out)],
                  ok_codes=(0, 4))
        plans = out / "plans.json"
        stage.run("4. plan: every strategy on the measured links",
                  [py, "-m", "smoltrain", "plan", "--strategy", "all", "-i", inv, "--links", str(links),
                   "--json", str(plans), "--chart", str(out / "plan.png")])
        chosen = pick_strategies(json.loads(plans.read_text()))
        for strat in chosen:
            run_json = out / f"run-{strat}.json"
            stage.run(f"5. train: {strat} across the cluster",
                      [py, "-m", "smoltrain", "run", "--strategy", strat, "-i", inv, "--steps", steps,
                       "--json", str(run_json)], timeout=900)
            stage.run(f"6. check: plan vs measured for {strat}",
                      [py, "-m", "smoltrain", "plan", "--compare", str(run_json), "--links", str(links),
                       "-i", inv, "--json", str(out / f"compare-{strat}.json")])
        from smoltrain.demo_report import write_report

        path = write_report(out, chosen, stage.results)
        console.rule("[bold green]done")
        console.print(f"report: {path}")
        return 0
    finally:
        if up and not args.keep:
            subprocess.run([py, "-m", "smolnet", "sim", "down", "--name", args.name], cwd=ROOT,
                           capture_output=True, timeout=180)


def pick_strategies(doc) -> list[str]:
    """The strategy the plan ranks best that `run` supports, plus one it calls link-bound."""
    runnable = ("dp", "fsdp", "syncps", "mp", "pp", "tp")
    plans = doc.get("plans", doc) if isinstance(doc, dict) else doc
    plans = [p for p in plans if p.get("strategy") in runnable]
    if not plans:
        raise SmolError("the plan ranked no runnable strategy")
    ranked = sorted(plans, key=lambda p: p.get("step_s") or float("inf"))
    best = ranked[0]["strategy"]
    bound = next((p["strategy"] for p in ranked[1:] if p.get("bottleneck") in ("link", "latency")), None)
    return [best] + ([bound] if bound else [ranked[-1]["strategy"]])
