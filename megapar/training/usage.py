"""A bad input to megapar-train (`UsageError`, exit code 2) and the flag a config field is
given by (`flag_of`): shared by the checks of `validate` and its companions."""

from __future__ import annotations


class UsageError(ValueError):
    """A bad input: the message names the problem and the fix (exit code 2)."""


def flag_of(name: str) -> str:
    """The command-line flag of config field `name` (``--name-with-dashes``)."""
    return "--" + name.replace("_", "-")
