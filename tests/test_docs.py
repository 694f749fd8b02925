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


SHELL_LANGS = ("", "sh", "bash", "console", "shell")
SYNOPSIS = re.compile(r"[\[<|]|\.\.\.")  # optional parts, placeholders in angle brackets, alternatives
COMMAND = re.compile(r"^(?:sudo )?(?:\$ )?(?:\S*/)?(?:python3? -m )?(smolnet|smoltrain)\s+(.*)$")


def _command_lines(text: str) -> list[tuple[str, bool]]:
    """(line, inline): shell lines of fenced shell blocks (continuations joined, comments and a
    trailing `&` cut), then inline spans."""
    lines = []
    for lang, block in re.findall(r"```([^\n]*)\n(.*?)```", text, re.S):
        if lang.strip() in SHELL_LANGS:
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                lines.append((line.split(" #", 1)[0].strip().removesuffix("&").strip(), False))
    lines += [(s.strip(), True) for s in SPAN.findall(FENCE.sub("", text))]
    return lines


def _commands_in(text: str) -> list[tuple[str, list[str], bool]]:
    import shlex

    out = []
    for line, inline in _command_lines(text):
        m = COMMAND.match(line.lstrip("$ ").replace(".venv/bin/", ""))
        if not m or SYNOPSIS.search(m.group(2)):
            continue
        try:
            argv = shlex.split(m.group(2).split(" && ")[0].split(" > ")[0])
        except ValueError:
            continue
        if argv and argv[0] in _commands(m.group(1)):
            out.append((m.group(1), argv, inline))
    return out


# An inline span names a command or an option (`smoltrain serve --port`), not a whole line: what
# it leaves out may be missing, and an ALL-CAPS word is a placeholder; a wrong name never passes.
PARTIAL = ("the following arguments are required", "expected one argument")


def _tolerated(err: str, argv: list[str], inline: bool) -> bool:
    placeholder = any(re.fullmatch(r"[A-Z][A-Z_]+", a) for a in argv)
    return (inline and any(p in err for p in PARTIAL)) or (placeholder and "unrecognized" not in err)


def _parse_error(tool: str, argv: list[str]) -> str | None:
    import contextlib
    import io

    from smolnet.cli_dispatch import parse

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parse(tool, "", _commands(tool), argv)
    except SystemExit as e:
        if e.code not in (0, None):
            return err.getvalue().strip() or f"exit {e.code}"
    return None


@pytest.mark.parametrize("doc", DOCS + [ROOT / "README.md"], ids=lambda p: p.name)
def test_every_command_line_parses(doc):
    """Each whole `smolnet`/`smoltrain` command line (not a synopsis with [optional] parts,
    <placeholders> or ...) parses with the real argument parsers."""
    bad = [
        f"{tool} {' '.join(argv)}: {err}"
        for tool, argv, inline in _commands_in(doc.read_text())
        if (err := _parse_error(tool, argv)) and not _tolerated(err, argv, inline)
    ]
    assert not bad, f"{doc.name}: command lines that do not parse:\n" + "\n".join(bad)


def test_the_parse_check_catches_a_bad_option():
    text = "```sh\nsmoltrain plan --strategy dp --no-such-flag 3\nsmolnet matrix -i x.yml &\n```\n`smolnet matrix`\n"
    cmds = _commands_in(text)
    assert [(c, inline) for c, _, inline in cmds] == [("smoltrain", False), ("smolnet", False), ("smolnet", True)]
    assert "no-such-flag" in _parse_error(*cmds[0][:2]) and _parse_error(*cmds[1][:2]) is None
    err = _parse_error(*cmds[2][:2])
    assert _tolerated(err, cmds[2][1], True) and not _tolerated(err, cmds[2][1], False)
    assert not _tolerated("unrecognized arguments: --bogus", ["run", "--bogus", "FILE"], True)


ORDER_LINK = re.compile(r"\]\(([^)#\s]+\.md)\)")


def _course_order() -> list[str]:
    """The pages of docs/index.md in its order (the strategy registry is an appendix)."""
    seen = []
    for target in ORDER_LINK.findall((ROOT / "docs" / "index.md").read_text()):
        if target not in seen and target != "registry.md":
            seen.append(target)
    return seen


def test_previous_and_next_links_follow_the_index():
    order = _course_order()
    assert order[:4] == ["01-sim.md", "02-provision.md", "03-measure.md", "04-plan.md"], order
    for i, name in enumerate(order):
        lines = (ROOT / "docs" / name).read_text().rstrip().splitlines()
        footer = lines[-1] if len(lines) > 1 and lines[-2] == "---" else ""
        assert footer, f"{name}: no previous/next footer"
        prev = re.search(r"\[← [^\]]*\]\(([^)]+)\)", footer)
        nxt = re.search(r"\[[^\]]* →\]\(([^)]+)\)", footer)
        assert (prev.group(1) if prev else None) == (order[i - 1] if i else None), (name, footer)
        assert (nxt.group(1) if nxt else None) == (order[i + 1] if i + 1 < len(order) else None), (name, footer)


def test_numbered_chapters_carry_their_number():
    index = (ROOT / "docs" / "index.md").read_text()
    for n, target in re.findall(r"(?m)^(\d+)\. \[[^\]]+\]\(([^)]+)\)", index):
        title = (ROOT / "docs" / target).read_text().splitlines()[0]
        assert title.startswith(f"# {n}. ") and target.startswith(f"0{n}-"), (target, title)


def test_the_readme_lists_every_chapter_in_the_index_order():
    readme = (ROOT / "README.md").read_text()
    learn = readme.split("## Learn more", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"\]\(docs/([^)#\s]+\.md)\)", learn[learn.index("\n1. [") :])
    assert listed == _course_order() + ["registry.md"], listed
    assert "](docs/glossary.md)" in readme
