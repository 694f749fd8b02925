"""How mesh plans look (planner.mesh_search's documents): a layout's bottleneck in words, its
bytes and time per link, the ranking of layouts, and the best mesh beside the single strategies
(`plan --strategy all`)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from smoltrain.planner.bottleneck import Bottleneck, human_bytes, human_s

TOP = 5  # layouts `--strategy all` shows beside the single strategies


def words(b: Bottleneck) -> str:
    """A layout's bottleneck record (planner.mesh_plan.bottleneck) as its `bottleneck_where`."""
    if b.cause == "memory":
        return f"rank {b.rank} ({b.host}) needs {b.needs / 1e9:.3g} GB of {b.usable / 1e9:.3g} GB usable memory"
    if b.cause == "down":
        return f"{b.axis} link {b.src} -> {b.dst} is down; the layout cannot run over it"
    if b.axis is not None:  # an axis's communication, over the link or NIC that limits it
        return f"{b.axis} over {b.limiter}: {human_s(b.seconds)} of the {human_s(b.compute_s + b.comm_s)} step"
    tail = f"; pipeline bubble {b.bubble:.0%}" if b.bubble else ""
    return f"rank {b.rank} ({b.host}, {b.device}): {human_s(b.seconds)} of {b.work} per {b.per}{tail}"


def _step(e: dict) -> str:
    return "down" if e["step_s"] is None else human_s(e["step_s"])


def layout(con: Console, doc: dict, e: dict) -> None:
    """One layout: its bytes per link by axis, then its step, its parts and its bottleneck."""
    mb = f", {doc['microbatches']} microbatches" if doc["microbatches"] > 1 else ""
    con.print(
        f"mesh {e['layout']} on {doc['world_size']} ranks, {doc['model']}, "
        f"batch {doc['batch']}x{doc['seq']}{mb}: bytes per step"
    )
    for ln in e["links"]:
        busy = "down" if ln["seconds_per_step"] is None else human_s(ln["seconds_per_step"])
        con.print(
            f"  rank {ln['src_rank']} -> rank {ln['dst_rank']}  {ln['bytes_per_step']:>14,d}  {ln['axis']}"
            f"  ({ln['src']} -> {ln['dst']}, busy {busy})"
        )
    sent = {}
    for ln in e["links"]:
        sent[ln["src_rank"]] = sent.get(ln["src_rank"], 0) + ln["bytes_per_step"]
    con.print(f"  busiest rank sends {max(sent.values(), default=0):,.0f}")
    parts = " + ".join(f"{k} {human_s(v)}" for k, v in e["seconds"].items() if v > 0)
    if e["step_s"] is not None:
        con.print(f"  step {human_s(e['step_s'])} = {parts} -> {e['tokens_per_s']:,.1f} tokens/s")
    con.print(f"  hosts (rank order, {e['placement']} placement): {', '.join(e['order'])}")
    con.print(f"  bottleneck {e['bottleneck']}: {e['bottleneck_where']}")
    unfit = [r for r in e["ranks"] if not r["fits"]]
    for r in unfit:
        con.print(f"  [red]rank {r['rank']} ({r['name']}) needs {human_bytes(r['memory_bytes'])}[/]")


def ranking(con: Console, doc: dict, top: int | None = None) -> None:
    """The layouts, best first (`top`: only so many, and no refusals); what was not searched
    or refused, in a line each. `doc`: a meshplan, or a plans document with `meshes`."""
    meshes = doc["meshes"]
    t = Table(title=f"meshes of {len(meshes[0]['order'])} ranks, best first", title_justify="left")
    for c in ("#", "mesh", "hosts", "step", "tokens/s", "bottleneck"):
        t.add_column(c)
    for i, e in enumerate(meshes[:top], 1):
        where = e["bottleneck"] + (f" ({e['bottleneck_axis']})" if e["bottleneck_axis"] else "")
        t.add_row(str(i), e["layout"], ",".join(e["order"]), _step(e), f"{e['tokens_per_s']:,.1f}", where)
    con.print(t)
    if top is None:
        for s in doc["skipped"]:
            con.print(f"  [dim]{s['layout']}: not planned: {s['reason']}[/]")
        con.print(f"  [dim]{doc['not_searched']}[/]")
    best = meshes[0]
    con.print(f"  best mesh: [bold]{best['layout']}[/] on {', '.join(best['order'])}: {best['bottleneck_where']}")


def beside(con: Console, doc: dict, best_plan: dict) -> str:
    """`--strategy all`: the best meshes under the single strategies' table, and the sentence
    naming the better of the best mesh and the best single strategy."""
    ranking(con, doc, TOP)
    m = doc["meshes"][0]
    if m["tokens_per_s"] > best_plan["tokens_per_s"]:
        x = m["tokens_per_s"] / best_plan["tokens_per_s"] if best_plan["tokens_per_s"] else float("inf")
        return (
            f"the mesh {m['layout']} on {', '.join(m['order'])}, {m['tokens_per_s']:,.1f} tokens/s, "
            f"{x:.2f}x the best single strategy ({best_plan['strategy']}); bottleneck {m['bottleneck']}"
        )
    return (
        f"{best_plan['strategy']} alone beats every mesh (the best, {m['layout']}, {m['tokens_per_s']:,.1f} tokens/s)"
    )
