"""One error hierarchy: every exception the packages raise derives from SmolError.

The command line prints a SmolError as one line (`prog: error: message`) and exits with
its `code`; tests/test_errors.py fails if a class outside this hierarchy appears.
"""

from __future__ import annotations


class SmolError(Exception):
    """A user-facing failure: the message is printed as one line, then exit `code`."""

    code = 1

    def __init__(self, message: str = "", code: int | None = None):
        super().__init__(" ".join(str(message).split("\n")).strip())
        if code is not None:
            self.code = code


class UsageError(SmolError):
    """Bad input: a command line, inventory or document that cannot be used (exit 2)."""

    code = 2
