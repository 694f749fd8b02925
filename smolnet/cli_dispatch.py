"""Shared command-line plumbing for `smolnet` and `smoltrain`.

Each subcommand lives in its own module exposing `add_arguments(parser)` and
`run(args) -> int`; only the chosen one is imported, so `--help` and light commands
never pay for heavy imports such as torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from smolnet.errors import SmolError


class OneLineParser(argparse.ArgumentParser):
    """Usage errors in one line (`prog: error: ...`, exit 2), like every other input error;
    `--help` still shows the whole usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def parse(prog: str, description: str, commands: dict[str, tuple[str, str]], argv) -> argparse.Namespace:
    """Parse argv, importing only the chosen subcommand (the README tests use this)."""
    parser = OneLineParser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, help_text) in commands.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        raise SystemExit(2)
    return args


def dispatch(prog: str, description: str, commands: dict[str, tuple[str, str]], argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse(prog, description, commands, argv)
    except SystemExit as e:  # --help (0) or a usage error already printed (2)
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    try:
        return int(args._run(args) or 0)
    except SmolError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
