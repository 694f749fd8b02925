"""One cost core: the time a link takes for a message is computed in one place
(`Link.seconds`), and every plan that times a transfer goes through it."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

from smoltrain.planner.links import Link

ROOT = Path(__file__).resolve().parents[1] / "smoltrain"
HOME = ROOT / "planner" / "links.py"  # the one module allowed to write the formula


def _attr(node, name: str) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == name


def link_time_sites(source: str) -> list[int]:
    """Lines that compute link time by hand: bytes divided by a link's `.bytes_per_s`, or a
    link's `.alpha_s` added to something (latency plus transfer)."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.BinOp):
            continue
        by_goodput = isinstance(node.op, ast.Div) and _attr(node.right, "bytes_per_s")
        plus_latency = isinstance(node.op, ast.Add) and any(
            _attr(side, "alpha_s")
            or (isinstance(side, ast.BinOp) and (_attr(side.left, "alpha_s") or _attr(side.right, "alpha_s")))
            for side in (node.left, node.right)
        )
        if by_goodput or plus_latency:
            hits.append(node.lineno)
    return hits


def test_the_detector_sees_each_hand_written_form():
    assert link_time_sites("t = ln.alpha_s + n / ln.bytes_per_s")
    assert link_time_sites("t = m * ln.alpha_s + n / ln.bytes_per_s if ln.up else inf")
    assert link_time_sites("t = n / wire.bytes_per_s")
    assert not link_time_sites("t = ln.seconds(n, m)\na = m * ln.alpha_s")


def test_no_module_but_links_computes_link_time():
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        if path == HOME:
            continue
        lines = link_time_sites(path.read_text())
        if lines:
            found[str(path.relative_to(ROOT.parent))] = lines
    assert not found, f"link time computed outside planner/links.py (use Link.seconds): {found}"
    assert link_time_sites(HOME.read_text()), "the formula's home no longer holds it"


def test_link_seconds_is_latency_per_message_plus_bytes_over_goodput():
    ln = Link(800.0, 300.0)  # 100 MB/s, 150 us one way
    assert ln.seconds(1e6) == pytest.approx(150e-6 + 0.01)
    assert ln.seconds(1e6, 3) == pytest.approx(3 * 150e-6 + 0.01)
    assert ln.seconds(0, 0) == 0.0
    assert math.isinf(Link(None, 300.0).seconds(1))
    assert math.isinf(Link(800.0, 300.0, "down").seconds(1))
