"""How plans look: a rich summary in words, the what-if table, the ranking, and a chart."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from smolnet.files import save_figure_atomic
from smoltrain.planner.bottleneck import human_bytes, human_s


def _s(v) -> str:
    return "down" if v is None else human_s(v)


def summary(con: Console, plan: dict) -> None:
    m = plan["model"]
    n = m["params"]
    count = f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"
    head = (
        f"[bold]{plan['strategy']}[/] · {plan['mode']} · {m['name']} ({count} params, "
        f"{m['layers']} layers, hidden {m['hidden']}) · world {plan['world_size']} · {plan['dtype']}"
    )
    if plan["mode"] == "train":
        head += f" · batch {plan['batch']} x seq {plan['seq']}"
        if plan["microbatches"] > 1:
            head += f" · {plan['microbatches']} microbatches"
    else:
        head += f" · decode at context {plan['seq']}"
    if plan.get("compute_dtype", plan["dtype"]) != plan["dtype"]:
        head += f" · matmuls in {plan['compute_dtype']}"
    if plan.get("quantize"):
        head += f" · {plan['quantize']} weights"
    if plan.get("wire_dtype") and plan["wire_dtype"] != plan["dtype"]:
        head += f" · {plan['wire_dtype']} on the wire"
    con.print(head)
    unit = "step" if plan["mode"] == "train" else "generated token"
    con.print(
        f"  bytes per token  {human_bytes(plan['bytes_per_token'])} (busiest rank); "
        f"per {unit} {human_bytes(plan['bytes_per_step'])}, all links {human_bytes(plan['total_bytes_per_step'])}"
    )
    if plan["step_s"] is None:
        con.print("  step             cannot run: a link it needs is down")
    else:
        extra = f", pipeline bubble {plan['bubble_fraction']:.0%}" if plan["bubble_fraction"] else ""
        con.print(
            f"  per {unit:<12} {human_s(plan['step_s'])} = compute {human_s(plan['compute_s_per_step'])}"
            f" + communication {human_s(plan['comm_s_per_step'])}{extra} -> "
            f"{plan['tokens_per_s']:,.1f} tokens/s"
        )
    color = {"capacity": "red", "link": "yellow", "latency": "yellow"}.get(plan["bottleneck"], "green")
    con.print(f"  bottleneck       [{color}]{plan['bottleneck']}[/]: {plan['bottleneck_where']}")


def links_table(con: Console, plan: dict) -> None:
    if not plan["links"]:
        con.print("  no traffic between ranks")
        return
    t = Table(title="traffic per link", title_justify="left")
    for c in ("src", "dst", "bytes/step", "messages", "busy", "goodput Mbit/s", "RTT us"):
        t.add_column(c, justify="right" if c not in ("src", "dst") else "left")
    for ln in plan["links"]:
        t.add_row(
            ln["src"],
            ln["dst"],
            human_bytes(ln["bytes_per_step"]),
            str(ln["messages_per_step"]),
            _s(ln["seconds_per_step"]),
            f"{ln['rate_mbit']:.0f}",
            f"{ln['rtt_us']:.0f}",
        )
    con.print(t)


def memory_table(con: Console, plan: dict) -> None:
    t = Table(title="memory per rank", title_justify="left")
    for c in ("rank", "host", "device", "weights+grads+optimizer", "activations", "KV cache", "total / usable", "fits"):
        t.add_column(c)
    for r in plan["ranks"]:
        mm = r["memory"]
        t.add_row(
            str(r["rank"]),
            r["name"],
            r["device"],
            human_bytes(mm["weights"] + mm["grads"] + mm["optimizer"]),
            human_bytes(mm["activations"]),
            human_bytes(mm["kv_cache"]),
            f"{human_bytes(mm['total'])} / {human_bytes(r['memory_available'])}",
            "yes" if r["fits"] else "[red]no[/]",
        )
    con.print(t)


def what_if_table(con: Console, rows: list[dict], sentence: str) -> None:
    t = Table(title="what if the links were", title_justify="left")
    for c in ("link class", "goodput Mbit/s", "RTT us", "step", "communication", "tokens/s", "bottleneck"):
        t.add_column(c)
    for r in rows:
        t.add_row(
            r["link_class"],
            f"{r['goodput_mbit']:,.0f}",
            f"{r['rtt_us']:.0f}",
            _s(r["step_s"]),
            _s(r["comm_s_per_step"]),
            f"{r['tokens_per_s']:,.1f}",
            r["bottleneck"],
        )
    con.print(t)
    con.print(f"  {sentence}")


def rank_plans(plans: list[dict]) -> list[dict]:
    """Best first: plans that fit before those that do not, then by tokens per second."""
    return sorted(plans, key=lambda p: (p["bottleneck"] == "capacity", -(p["tokens_per_s"] or 0.0)))


def ranking_table(con: Console, plans: list[dict], skipped: list[dict]) -> None:
    t = Table(title="strategies for this cluster, best first", title_justify="left")
    for c in ("#", "strategy", "bytes/token", "step", "compute", "communication", "tokens/s", "bottleneck"):
        t.add_column(c)
    ranked = rank_plans(plans)
    for i, p in enumerate(ranked, 1):
        t.add_row(
            str(i),
            p["strategy"],
            human_bytes(p["bytes_per_token"]),
            _s(p["step_s"]),
            _s(p["compute_s_per_step"]),
            _s(p["comm_s_per_step"]),
            f"{p['tokens_per_s']:,.1f}",
            p["bottleneck"],
        )
    con.print(t)
    for i, p in enumerate(ranked, 1):
        con.print(f"  {i}. {p['strategy']}: {p['bottleneck']}: {p['bottleneck_where']}")
    for s in skipped:
        con.print(f"  [dim]{s['strategy']}: not planned: {s['reason']}[/]")


def chart(plans: list[dict], path: str) -> None:
    """Bytes per token per strategy (log scale) and the step split into compute and communication."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [p["strategy"] for p in plans]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 1.4 * len(plans) + 4), 4.2))
    bpt = [max(p["bytes_per_token"], 1e-3) for p in plans]
    ax1.bar(names, bpt, color="#4477aa")
    ax1.set_yscale("log")
    ax1.set_ylabel("bytes per token (busiest rank)")
    ax1.set_title("traffic")
    comp = [p["compute_s_per_step"] or 0 for p in plans]
    comm = [p["comm_s_per_step"] or 0 for p in plans]
    ax2.bar(names, comp, label="compute", color="#228833")
    ax2.bar(names, comm, bottom=comp, label="communication", color="#ee6677")
    ax2.set_ylabel("seconds per " + ("step" if plans[0]["mode"] == "train" else "token"))
    ax2.set_title("step time")
    ax2.legend()
    m = plans[0]
    fig.suptitle(f"{m['model']['name']} · {m['mode']} · world {m['world_size']} · {m['dtype']}")
    fig.tight_layout()
    save_figure_atomic(fig, path)
