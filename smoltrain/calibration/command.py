"""`smoltrain calibrate -i INVENTORY | --local`: the compute report, with progress per host."""

from __future__ import annotations

from smolnet.errors import UsageError
from smolnet.files import write_json_atomic

EXIT_SOME_FAILED = 4


def _fp32(h: dict) -> str:
    """The median rate, and with repeats the range the probes spanned."""
    each = h.get("fp32_flops_each") or []
    spread = f" ({min(each) / 1e9:,.1f}-{max(each) / 1e9:,.1f})" if len(each) > 1 else ""
    return f"{h['flops']['fp32'] / 1e9:,.1f}{spread}"


def _table(doc: dict):
    from rich.table import Table

    t = Table(title=f"compute of {len(doc['hosts'])} host(s), {doc['settings']['model']} training steps")
    cols = ("host", "cap (cores)", "threads", "fp32 GFLOP/s", "bf16", "fp16", "mem GB/s", "step ms (batch)", "machine")
    for c in cols:
        t.add_column(c, no_wrap=True)
    for h in doc["hosts"]:
        if h["status"] != "ok":
            failed = f"[red]failed: {h['error']}[/]"
            t.add_row(h["name"], "", "", failed, "", "", "", "", (h.get("machine_id") or "?")[:8])
            continue
        st = ", ".join(f"{s['seconds'] * 1e3:,.0f} ({s['batch']})" for s in h["train_step"])
        cap = h.get("cpu_limit_cores")
        t.add_row(
            h["name"],
            f"{cap:.2f}" if cap else f"none ({h['cores']} cores)",
            str(h.get("threads", 1)),
            _fp32(h),
            *(f"{(h['flops'].get(k) or 0) / 1e9:,.1f}" for k in ("bf16", "fp16")),
            f"{h['mem_bw_bytes_s'] / 1e9:,.1f}",
            st or "-",
            h["machine_id"][:8],
        )
    return t


def run_compute(args, out: str) -> int:
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from smoltrain.calibration.cluster import calibrate_hosts, local_report

    con = Console()
    model = args.model or "tiny"
    if args.local:
        with con.status("measuring this machine: matmul FLOP/s, memory bandwidth, training steps ..."):
            doc = local_report(
                model, args.seconds, repeats=args.repeat, threads=args.threads, device=args.device, quick=args.quick
            )
    else:
        from smolnet.inventory import InventoryError, load_inventory

        try:
            inv = load_inventory(args.inventory)
            hosts = inv.select(args.hosts.split(",") if args.hosts else None)
        except InventoryError as e:
            raise UsageError(str(e)) from None
        with Progress(
            SpinnerColumn(), TextColumn("{task.fields[host]:<12} {task.description}"), TimeElapsedColumn(), console=con
        ) as prog:
            tasks = {h.name: prog.add_task("connecting", host=h.name) for h in hosts}

            def say(name: str, what: str) -> None:
                prog.update(tasks[name], description=what)
                if what.startswith(("done", "failed")):
                    prog.update(tasks[name], completed=100, total=100)

            doc = calibrate_hosts(
                hosts, model, args.seconds, say, repeats=args.repeat, sequential=args.sequential, quick=args.quick
            )
        doc["inventory"] = str(args.inventory)
    write_json_atomic(out, doc)
    if args.json and args.json != out:
        write_json_atomic(args.json, doc)
    con.print(_table(doc))
    for m in doc.get("machines") or []:
        if len(m["hosts"]) > 1:  # which hosts of one machine were measured together (together.py)
            con.print(f"machine {m['machine_id'][:8]}: {', '.join(m['hosts'])} measured {m['why']}")
    bad = [h for h in doc["hosts"] if h["status"] != "ok"]
    for h in bad:
        con.print(f"[red]{h['name']}: {h['error']}[/]")
    con.print(f"wrote {out}; `smoltrain plan` and `run` use it when it exists (or pass --compute {out})")
    return EXIT_SOME_FAILED if bad else 0
