"""The tutorial in docs/ stays true: every relative link resolves, and every `make` target
and every smolnet/smoltrain command it names exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
CHAPTERS = [
    "01-sim.md",
    "02-provision.md",
    "03-measure.md",
    "04-plan.md",
    "05-run.md",
    "06-home-cluster.md",
    "troubleshooting.md",
    "testing.md",
]
FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)
SPAN = re.compile(r"`([^`\n]+)`")


def _code(text: str) -> list[str]:
    """Every line of code in a document: fenced blocks and inline spans."""
    lines = [ln for block in FENCE.findall(text) for ln in block.splitlines()]
    return lines + SPAN.findall(FENCE.sub("", text))


def _make_targets() -> set[str]:
    targets = set()
    for m in re.finditer(r"^([A-Za-z0-9_ %-]+):(?!=)", (ROOT / "Makefile").read_text(), flags=re.M):
        for t in m.group(1).split():
            targets.add(t)
    for t in [t for t in targets if "%" in t]:
        targets.discard(t)
    return targets


def _commands(tool: str) -> dict:
    import importlib

    return importlib.import_module(f"{tool}.cli").COMMANDS


def test_the_chapters_exist_in_the_course_order():
    names = [p.name for p in DOCS]
    assert set(CHAPTERS) <= set(names), set(CHAPTERS) - set(names)
    index = (ROOT / "docs" / "index.md").read_text()
    positions = [index.index(f"({c})") for c in CHAPTERS]
    assert positions == sorted(positions)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_resolves(doc):
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+://|mailto:|#", target):
            continue
        path = (doc.parent / target.split("#", 1)[0]).resolve()
        assert path.exists(), f"{doc.name}: link to {target} does not resolve"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_make_target_named_exists(doc):
    targets = _make_targets()
    for line in _code(doc.read_text()):
        for t in re.findall(r"(?:^|[\s;&|(])make ([a-z][a-z0-9-]*)", line):
            assert t in targets, f"{doc.name}: `make {t}` but the Makefile has no such target"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_cli_command_named_exists(doc):
    subactions = {("smolnet", "sim"): {"up", "down", "status"}, ("smoltrain", "bench"): {"allreduce"}}
    pattern = re.compile(r"(?:^|[\s/(]|-m )(smolnet|smoltrain) ([a-z][a-z-]*)(?: ([a-z][a-z-]*))?")
    found = 0
    for line in _code(doc.read_text()):
        for tool, cmd, sub in pattern.findall(line):
            if line.lstrip().startswith(("from ", "import ")):
                continue
            found += 1
            assert cmd in _commands(tool), f"{doc.name}: `{tool} {cmd}` is not a {tool} command"
            allowed = subactions.get((tool, cmd))
            if allowed and sub:
                assert sub in allowed, f"{doc.name}: `{tool} {cmd} {sub}` is not an action of {tool} {cmd}"
    if doc.name in ("01-sim.md", "03-measure.md", "04-plan.md", "05-run.md"):
        assert found, f"{doc.name} names no command at all: the pattern is broken"


def test_the_check_catches_a_made_up_command_and_target(tmp_path):
    assert "frobnicate" not in _commands("smolnet") and "frobnicate" not in _make_targets()
    assert {"test", "demo", "lint", "system-deps", "test-unit", "test-sim"} <= _make_targets()
