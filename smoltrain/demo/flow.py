"""`smoltrain demo`: the whole flow on the built-in cluster, one stage at a time.

Measure the links (faults and all), provision, measure again, calibrate every host, plan
every strategy, train each one that splits `tiny8` evenly and check it against its plan
(`plan --compare`, the fixed warm-up), place by measured speed (even against auto), then
train a model on prose, put it on the share and generate across the hosts. Every plan in
the report comes from one request shape per section (stated in its heading) through the
one plan builder, so its tables agree. The sim is always taken down again; the demo exits
non-zero when any stage it reports failed. Each run writes into a fresh folder under
`--out` (reports/demo-<UTC time>/) and `reports/latest` points to it, so a failed stage
cannot sit beside an earlier run's numbers.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from smolnet.errors import SmolError, UsageError
from smoltrain import registry
from smoltrain.demo.stages import ROOT, Stages, smol

MODEL, BATCH, SEQ, MICRO = "tiny8", 8, 64, 4  # the plan and training sections (tiny8: 8 layers, 4 heads)
PLACE_BATCH = 32  # the placement section: compute, which placement balances, outweighs the all-reduce
PLACE_STRATEGIES = ("dp", "pp")
QUICK = ("dp", "pp", "tp")  # --quick trains these (the suite runs it)


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="shorter measurements and runs (CI)")
    p.add_argument(
        "--out", default="reports", help="where each run's folder goes: OUT/demo-<time>/, OUT/latest (default reports/)"
    )
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


def runnable(world: int, layers: int, heads: int) -> list[str]:
    """Strategies the demo trains: lockstep trainers whose split of the model divides evenly."""
    size = {"layers": layers, "heads": heads}
    return [
        s.name
        for s in registry.REGISTRY.values()
        if s.trains and s.synchronous and not (s.even_split and size.get(s.splits, 0) % max(world, 1))
    ]


def fresh_run_dir(base: Path, now: datetime.datetime | None = None) -> Path:
    """A new, empty folder for this run under `base` (demo-<UTC time>, then -2, -3 ... if that
    is taken), with `base/latest` pointed at it (a relative link, replaced in one rename)."""
    base.mkdir(parents=True, exist_ok=True)
    stamp = (now or datetime.datetime.now(datetime.timezone.utc)).strftime("demo-%Y%m%d-%H%M%S")
    run, n = base / stamp, 1
    while True:
        try:
            run.mkdir()
            break
        except FileExistsError:
            n += 1
            run = base / f"{stamp}-{n}"
    link, tmp = base / "latest", base / f".latest-{os.getpid()}"
    if link.exists() and not link.is_symlink():
        run.rmdir()
        raise UsageError(f"{link} is not a link to a run: move it away (each run now has its own folder)")
    tmp.unlink(missing_ok=True)
    os.symlink(run.name, tmp)
    os.replace(tmp, link)
    return run


class Demo:
    def __init__(self, args, console):
        self.args, self.console = args, console
        base = (ROOT / args.out) if not os.path.isabs(args.out) else Path(args.out)
        self.out = fresh_run_dir(base)
        self.stages = Stages(console, self.out)
        self.py = sys.executable
        inv_dir = self.out / "demo-inventory"  # beside the report, so fixing it never touches inventory/
        shutil.rmtree(inv_dir, ignore_errors=True)
        inv_dir.mkdir(parents=True)
        self.inv_dir, self.inv = inv_dir, inv_dir / "sim.yml"
        self.links, self.compute = self.out / "links.json", self.out / "compute.json"
        self.steps = 6 if args.quick else 12  # plan --compare reads the 9 after the warm-up
        self.skipped: list[str] = []

    def common(self) -> list:
        """What every plan and run of the demo shares: the hosts, the measured links and compute."""
        return ["-i", self.inv, "--links", self.links, "--compute", self.compute]

    def shape(self, batch: int = BATCH) -> list:
        return ["--model", MODEL, "--batch", batch, "--seq", SEQ, "--microbatches", MICRO]

    # --- stages ---
    def cluster(self) -> None:
        a, run = self.args, self.stages.run
        sim = smol(self.py, "smolnet", "sim")
        opts = ["--loopback"] if a.loopback else []
        opts += ["--cpu-limit", a.cpu_limit] if a.cpu_limit is not None else []
        run(
            "1. cluster: build the sim",
            sim + ["up", "--name", a.name, "--subnet", a.subnet, "--inventory", self.inv] + opts,
        )
        self.up = True
        run("   cluster: status", sim + ["status", "--name", a.name])
        dur = "1" if a.quick else "3"
        matrix = smol(self.py, "smolnet", "matrix", "-i", self.inv, "--duration", dur)
        if not a.quick:  # --quick measures once, after provisioning (20 s; provisioning still finds the MTU fault)
            # 1 s a test: these links show the faults provisioning fixes (the black hole needs no long
            # test); the plan reads the measure after it (34 s at 3 s a test; the quick demo's 1 s: 18)
            run(
                "2. measure: every link, both directions, before provisioning",
                smol(self.py, "smolnet", "matrix", "-i", self.inv, "--duration", "1", "--out", self.out / "before"),
                (0, 4),
            )
        provisioned = self.provision()
        title = "4. measure again" if provisioned else "4. measure: the report the plan reads"
        run(title, matrix + ["--out", self.out], (0, 4))

    def provision(self) -> bool:
        if "ansible_connection: local" in self.inv.read_text():
            self.skipped += ["namespaced hosts", "link shaping and the MTU fault", "provisioning (Ansible)"]
        elif self.args.skip_provision:
            self.skipped.append("provisioning (Ansible), as asked")
        if self.skipped:
            self.console.print(f"[bold yellow]SKIPPED: {'; '.join(self.skipped)}")
            return False
        playbook = [
            str(Path(self.py).parent / "ansible-playbook"),
            "-i",
            str(self.inv),
            str(ROOT / "playbooks/site.yml"),
        ]
        p = self.stages.run("3. provision: names, keys, MTU, NFS, secret", playbook, (0, 2))
        if p.returncode != 0:
            if "MTU error" not in p.stdout:
                raise SmolError(
                    f"stage '3. provision' failed for another reason than the MTU fault (log: {self.stages.log})"
                )
            self.console.print(
                "[bold yellow]provisioning refused an MTU the wire cannot carry (the laptop's switch port); "
                "telling the inventory the truth and provisioning again"
            )
            (self.inv_dir / "host_vars").mkdir(exist_ok=True)
            (self.inv_dir / "host_vars" / "laptop.yml").write_text(
                "# the laptop's switch port carries 1500\nmtu: 1500\n"
            )
            # the checks, naming and the SSH mesh passed and converged before the MTU stop: from the MTU on
            again = ["--skip-tags", "preflight,hostname,ssh_mesh"]
            self.stages.run("3. provision again with the laptop at 1500", playbook + again)
        return True

    def calibrate(self) -> None:
        self.stages.run(
            f"5. calibrate: every host measured on itself (matmul, memory, timed {MODEL} steps)",
            # every window at its shortest (--quick; docs/compute.md), the median of three probes a
            # host (one for the quick demo): 79-81 s for the four capped hosts here against 125-138 s
            # at the full windows; a quick and a full calibration of one sim differed by what two full
            # ones did (median 12% over 12 figures of 4 hosts; 2026-12-07, BENCHMARKS.md's demo section)
            smol(self.py, "smoltrain", "calibrate", "-i", self.inv, "--model", MODEL, "--out", str(self.compute))
            + ["--repeat", "1" if self.args.quick else "3", "--quick"],
        )

    def plan_all(self) -> None:
        self.stages.run(
            "6. plan: every strategy on the measured links and compute",
            smol(self.py, "smoltrain", "plan", "--strategy", "all", *self.common(), *self.shape())
            + ["--json", self.out / "plans.json", "--chart", self.out / "plan.png"],
        )

    def train_and_compare(self, strategy: str, tag: str, title: str, extra: list, batch: int = BATCH) -> None:
        run_json, cmp_json = self.out / f"run-{tag}.json", self.out / f"compare-{tag}.json"
        got = self.stages.run(
            title,
            smol(self.py, "smoltrain", "run", "--strategy", strategy, *self.common(), *self.shape(batch))
            + ["--steps", self.steps, *extra, "--json", run_json, "--out", self.out],
            required=False,
        )
        if got is None or not run_json.exists():
            return
        self.stages.run(
            f"   check: {tag} against its plan (plan --compare)",
            smol(self.py, "smoltrain", "plan", "--compare", run_json, *self.common(), "--no-what-if")
            + ["--json", cmp_json],
            required=False,
        )

    def trainings(self, world: int) -> list[str]:
        chosen = runnable(world, 8, 4)
        if self.args.quick:
            chosen = [s for s in chosen if s in QUICK]
        for s in chosen:
            self.train_and_compare(s, s, f"7. train: {s} across the cluster", [])
        return chosen

    def placement(self) -> list[str]:
        strategies = PLACE_STRATEGIES[:1] if self.args.quick else PLACE_STRATEGIES
        for s in strategies:
            self.stages.run(
                f"8. plan: {s} placed by measured speed (batch {PLACE_BATCH})",
                smol(self.py, "smoltrain", "plan", "--strategy", s, *self.common(), *self.shape(PLACE_BATCH))
                + ["--placement", "auto", "--no-what-if", "--json", self.out / f"plan-placement-{s}.json"],
                required=False,
            )
            for mode in ("even", "auto"):
                self.train_and_compare(
                    s, f"placement-{s}-{mode}", f"9. train: {s} --placement {mode}", ["--placement", mode], PLACE_BATCH
                )
        return list(strategies)

    def generation(self) -> None:
        from smoltrain.demo import generate

        generate.stages(self)

    def low_communication(self) -> None:
        from smoltrain.demo import diloco

        diloco.stages(self)

    def meshes(self) -> None:
        from smoltrain.demo import mesh

        mesh.stages(self)

    def finetune(self) -> None:
        from smoltrain.demo import finetune

        if not self.args.quick:  # about 45 s: more than --quick allows (the report says so)
            finetune.stages(self)

    # --- the whole ---
    def run(self) -> int:
        from smoltrain.demo import report

        sim = smol(self.py, "smolnet", "sim")
        self.up = False
        trained, placed = [], []
        try:
            subprocess.run(sim + ["down", "--name", self.args.name], cwd=ROOT, capture_output=True, timeout=180)
            self.cluster()
            self.calibrate()
            self.plan_all()
            world = len(json.loads(self.links.read_text()).get("hosts", []))
            trained = self.trainings(world)
            placed = self.placement()
            self.generation()
            self.low_communication()  # diloco beside dp and the best host alone
            self.meshes()  # the 2-D layouts beside the 1-D strategies
            self.finetune()  # a Hugging Face checkpoint, LoRA with the plan's pick, answers before and after
        except SmolError as e:
            self.console.print(f"[bold red]{e}")
            if not self.stages.failed:  # a failure outside a stage still fails the demo
                self.stages.results.append({"stage": "demo", "rc": 1, "seconds": 0, "ok": False, "why": str(e)})
        finally:
            try:  # while the sim's inventory is still there (the report plans on its hosts)
                path = report.write(self, trained, placed)
            finally:
                if self.up and not self.args.keep:
                    subprocess.run(sim + ["down", "--name", self.args.name], cwd=ROOT, capture_output=True, timeout=180)
        failed = self.stages.failed
        if failed:
            self.console.rule(f"[bold red]FAILED: {len(failed)} stage(s)")
            for f in failed:
                self.console.print(f"[red]  {f['stage'].strip()}: exit {f['rc']}: {f['why']}")
        elif self.skipped:
            self.console.rule("[bold yellow]done, with stages SKIPPED")
            self.console.print(
                f"[bold yellow]SKIPPED: {'; '.join(self.skipped)} -- run as root without --loopback for the whole demo"
            )
        else:
            self.console.rule("[bold green]done")
        self.console.print(f"report: {path}")
        return 1 if failed else 0


def run(args) -> int:
    from rich.console import Console

    return Demo(args, Console()).run()
