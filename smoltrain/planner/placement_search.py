"""Rank order: which host is rank 0, 1, ... so the heaviest transfers avoid the slowest links.

A strategy's transfers follow a topology of rank numbers: a ring (dp, fsdp, tp: rank r sends
to r+1, the last back to 0), a chain (mp, pp: neighbours both ways) or a star (syncps, edp:
rank 0 serves every other rank). An order costs (slowest edge, sum of edges) for ring and
chain, where every edge carries the same bytes and the slowest one paces the step; a star's
hub serialises its edges, so it costs their sum. Up to 8 hosts every order is scored (from
a pairwise cost table, so 8! orders take a moment); beyond that a greedy walk from each
start host, then 2-opt swaps. The first order of the input wins ties, so equal links keep
the inventory's order.
"""

from __future__ import annotations

import itertools

EXHAUSTIVE_MAX = 8


def edges(n: int, topology: str) -> list[tuple[int, int]]:
    """Directed rank pairs that carry the strategy's traffic."""
    if n < 2:
        return []
    if topology == "star":
        return [(0, r) for r in range(1, n)] + [(r, 0) for r in range(1, n)]
    pairs = [(r, r + 1) for r in range(n - 1)]
    if topology == "ring" and n > 2:
        pairs.append((n - 1, 0))
    else:
        pairs += [(r + 1, r) for r in range(n - 1)]
    return pairs


def _table(names: list[str], link_s, nbytes: float) -> dict[tuple[str, str], float]:
    return {(a, b): link_s(a, b, nbytes) for a in names for b in names if a != b}


def order_cost(order, topology: str, table) -> tuple[float, float]:
    costs = [table[(order[s], order[d])] for s, d in edges(len(order), topology)]
    if not costs:
        return (0.0, 0.0)
    total = sum(costs)
    return (total, total) if topology == "star" else (max(costs), total)


def _greedy(names, topology, table) -> list[list[str]]:
    """One order per start host: walk to the cheapest next host; then 2-opt swaps."""
    out = []
    for start in names:
        order, left = [start], [n for n in names if n != start]
        while left:
            nxt = min(left, key=lambda n: table[(order[-1], n)] + table[(n, order[-1])])
            order.append(nxt)
            left.remove(nxt)
        best = order_cost(order, topology, table)
        improved = True
        while improved:
            improved = False
            for i, j in itertools.combinations(range(len(order)), 2):
                cand = list(order)
                cand[i], cand[j] = cand[j], cand[i]
                c = order_cost(cand, topology, table)
                if c < best:
                    order, best, improved = cand, c, True
        out.append(order)
    return out


def candidate_orders(names: list[str], topology: str, link_s, nbytes: float, keep: int = 6) -> list[list[str]]:
    """Up to `keep` distinct orders, cheapest links first; the given order when links are free."""
    names = list(names)
    if link_s is None or len(names) < 2:
        return [names]
    table = _table(names, link_s, nbytes)
    if len(names) <= EXHAUSTIVE_MAX:
        pool = (list(p) for p in itertools.permutations(names))
    else:
        pool = iter(_greedy(names, topology, table) + [names])
    scored = sorted(((order_cost(o, topology, table), i, o) for i, o in enumerate(pool)), key=lambda t: (t[0], t[1]))
    out, seen = [], set()
    for _, _, o in scored:
        if tuple(o) not in seen:
            seen.add(tuple(o))
            out.append(o)
        if len(out) >= keep:
            break
    return out


def slowest_edge(order: list[str], topology: str, link_s, nbytes: float) -> tuple[str, str, float] | None:
    """The edge that paces the order (for the plan's words)."""
    if link_s is None or len(order) < 2:
        return None
    s, d = max(edges(len(order), topology), key=lambda e: link_s(order[e[0]], order[e[1]], nbytes))
    return order[s], order[d], link_s(order[s], order[d], nbytes)
