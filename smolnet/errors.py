"""Errors that end a command with one clear line and a chosen exit status."""
from __future__ import annotations


class SmolError(Exception):
    """A user-facing failure: the message is printed as one line, then exit `code`."""

    code = 1

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class UsageError(SmolError):
    code = 2
