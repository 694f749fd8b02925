"""`smoltrain demo`: the whole flow on the built-in cluster, one stage at a time.

Each stage is a plain command line (the same ones the README teaches), so the demo
doubles as a check that the tutorial still works. A failing stage is named with its
reason, and the sim is always taken down again.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from smolnet.errors import SmolError
from smoltrain import registry

ROOT = Path(__file__).resolve().parents[2]


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="shorter measurements and runs (CI)")
    p.add_argument("--out", default="reports", help="report directory (default reports/)")
    p.add_argument("--name", default="demo", help="sim name (default demo)")
    p.add_argument("--subnet", default="10.213.9.0/24", help="sim subnet (default 10.213.9.0/24)")
    p.add_argument("--keep", action="store_true", help="leave the sim up afterwards")
    p.add_argument("--skip-provision", action="store_true", help="skip the Ansible stage")
    p.add_argument(
        "--loopback",
        action="store_true",
        help="loopback hosts instead of the namespaced sim (no root needed; skips shaping and provisioning)",
    )
    p.add_argument(
        "--cpu-limit",
        metavar="CORES",
        help="the sim hosts' CPU caps, passed to `smolnet sim up` (default: the home scenario's; 0 = uncapped)",
    )


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
                p = subprocess.run(
                    argv,
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    timeout=timeout,
                )
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


def _sim_is_loopback(inv: Path) -> bool:
    return "ansible_connection: local" in inv.read_text()


def run(args) -> int:
    from rich.console import Console

    console = Console()
    out = (ROOT / args.out) if not os.path.isabs(args.out) else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stage = Stage(console, out)
    stage.log.write_text("")
    py = sys.executable
    playbook = [str(Path(py).parent / "ansible-playbook")]
    # The demo's inventory lives beside its report, so fixing it never touches inventory/.
    inv_dir = out / "demo-inventory"
    shutil.rmtree(inv_dir, ignore_errors=True)
    inv_dir.mkdir(parents=True)
    inv = inv_dir / "sim.yml"
    dur = "1" if args.quick else "3"
    steps = "6" if args.quick else "20"
    sim = [py, "-m", "smolnet", "sim"]
    up = False
    try:
        subprocess.run(sim + ["down", "--name", args.name], cwd=ROOT, capture_output=True, timeout=180)
        sim_opts = ["--loopback"] if args.loopback else []
        if args.cpu_limit is not None:
            sim_opts += ["--cpu-limit", args.cpu_limit]
        stage.run(
            "1. cluster: build the sim",
            sim + ["up", "--name", args.name, "--subnet", args.subnet, "--inventory", str(inv)] + sim_opts,
        )
        up = True
        stage.run("   cluster: status", sim + ["status", "--name", args.name])
        stage.run(
            "2. measure: every link, both directions, before provisioning",
            [py, "-m", "smolnet", "matrix", "-i", str(inv), "--duration", dur, "--out", str(out / "before")],
            ok_codes=(0, 4),
        )
        provisioned = False
        skipped = []
        if _sim_is_loopback(inv):
            skipped += ["namespaced hosts", "link shaping and the MTU fault", "provisioning (Ansible)"]
        elif args.skip_provision:
            skipped.append("provisioning (Ansible), as asked")
        if skipped:
            console.print(f"[bold yellow]SKIPPED: {'; '.join(skipped)}")
        else:
            p = stage.run(
                "3. provision: names, keys, MTU, NFS, secret",
                playbook + ["-i", str(inv), str(ROOT / "playbooks" / "site.yml")],
                ok_codes=(0, 2),
            )
            if p.returncode != 0:
                if "MTU error" not in p.stdout:
                    raise SmolError(
                        f"stage '3. provision' failed for another reason than the MTU fault (log: {stage.log})"
                    )
                console.print(
                    "[bold yellow]provisioning refused an MTU the wire cannot carry (the laptop's "
                    "switch port); telling the inventory the truth and provisioning again"
                )
                (inv_dir / "host_vars").mkdir(exist_ok=True)
                (inv_dir / "host_vars" / "laptop.yml").write_text(
                    "# the laptop's switch port carries 1500\nmtu: 1500\n"
                )
                stage.run(
                    "3. provision again with the laptop at 1500",
                    playbook + ["-i", str(inv), str(ROOT / "playbooks" / "site.yml")],
                )
            provisioned = True
        links = out / "links.json"
        stage.run(
            "4. measure again" if provisioned else "4. measure: the report the plan reads",
            [py, "-m", "smolnet", "matrix", "-i", str(inv), "--duration", dur, "--out", str(out)],
            ok_codes=(0, 4),
        )
        from smoltrain.commands.demo_compute import compute_stage

        compute_md = compute_stage(stage, py, inv, out, links, steps, args.quick)
        plans = out / "plans.json"
        stage.run(
            "5. plan: every strategy on the measured links",
            [
                py,
                "-m",
                "smoltrain",
                "plan",
                "--strategy",
                "all",
                "-i",
                str(inv),
                "--links",
                str(links),
                "--json",
                str(plans),
                "--chart",
                str(out / "plan.png"),
            ],
        )
        world = len(json.loads(links.read_text()).get("hosts", []))
        chosen = pick_strategies(json.loads(plans.read_text()), world)
        for strat in chosen:
            run_json = out / f"run-{strat}.json"
            stage.run(
                f"6. train: {strat} across the cluster",
                [
                    py,
                    "-m",
                    "smoltrain",
                    "run",
                    "--strategy",
                    strat,
                    "-i",
                    str(inv),
                    "--steps",
                    steps,
                    "--links",
                    str(links),
                    "--json",
                    str(run_json),
                    "--out",
                    str(out),
                ],
                timeout=900,
            )
            stage.run(
                f"7. check: plan vs measured for {strat}",
                [
                    py,
                    "-m",
                    "smoltrain",
                    "plan",
                    "--compare",
                    str(run_json),
                    "--links",
                    str(links),
                    "-i",
                    str(inv),
                    "--json",
                    str(out / f"compare-{strat}.json"),
                ],
            )
        from smoltrain.commands.demo_report import write_report

        path = write_report(out, chosen, stage.results)
        body = compute_md.read_text().split("\n", 1)[1]  # the compute stage's table, under the report's heading
        with open(path, "a") as f:
            f.write(f"\n## Measured compute: predicted vs measured step time\n{body}\n")
        from smoltrain.commands.demo_placement import placement_stage

        placement_stage(stage, console, py, inv, links, out, steps, path, args.quick)  # even vs auto, into REPORT.md
        from smoltrain.commands.demo_generate import generate_stages

        generate_stages(stage, py, inv, out, steps, path)
        from smoltrain.commands.demo_diloco import diloco_stage

        diloco_stage(stage, console, py, inv, links, out, path, args.quick)  # diloco beside dp and one host alone
        if skipped:
            console.rule("[bold yellow]done, with stages SKIPPED")
            console.print(
                f"[bold yellow]SKIPPED: {'; '.join(skipped)} -- run as root without --loopback for the whole demo"
            )
        else:
            console.rule("[bold green]done")
        console.print(f"report: {path}")
        return 0
    finally:
        if up and not args.keep:
            subprocess.run(sim + ["down", "--name", args.name], cwd=ROOT, capture_output=True, timeout=180)


def pick_strategies(doc, world: int, layers: int = 6, heads: int = 6) -> list[str]:
    """The strategy the plan ranks best that `run` can split tiny over, plus one it calls link-bound."""
    size = {"layers": layers, "heads": heads}
    runnable = {  # trains in lockstep, and splits tiny evenly where it must
        s.name
        for s in registry.REGISTRY.values()
        if s.trains and s.synchronous and not (s.even_split and size.get(s.splits, 0) % max(world, 1))
    }
    plans = doc.get("plans", doc) if isinstance(doc, dict) else doc
    plans = [p for p in plans if p.get("strategy") in runnable]
    if not plans:
        raise SmolError("the plan ranked no runnable strategy")
    ranked = sorted(plans, key=lambda p: p.get("step_s") or float("inf"))
    best = ranked[0]["strategy"]
    bound = next((p["strategy"] for p in ranked[1:] if p.get("bottleneck") in ("link", "latency")), None)
    return [best] + ([bound] if bound else [ranked[-1]["strategy"]])
