"""A bad input to megapar-train (`UsageError`, exit code 2) and the flag a config field is
given by (`flag_of`): shared by the checks of `validate` and its companions."""

from __future__ import annotations

import shlex

from megapar.wording import scale_text


class UsageError(ValueError):
    """A bad input: the message names the problem and the fix (exit code 2)."""


def flag_of(name: str) -> str:
    """The command-line flag of config field `name` (``--name-with-dashes``)."""
    return "--" + name.replace("_", "-")


SCALE_FIELDS = frozenset({"loss_scale", "initial_loss_scale", "min_loss_scale"})
"""The fields that hold an fp16 loss scale, shown as `wording.scale_text` shows one."""


def value_text(name: str, value) -> str:
    """Config field `name`'s `value` as a user writes it: a loss scale whole (65536, not
    65536.0), any other value as str gives it."""
    if name in SCALE_FIELDS and isinstance(value, (int, float)) and not isinstance(value, bool):
        return scale_text(float(value))
    return str(value)


def flag_with_value(name: str, value) -> str:
    """Config field `name` set to `value` as words a user can paste into a command line: a
    switch as ``--compile`` / ``--no-compile`` (argparse's BooleanOptionalAction), a list as
    its words (``--data a b``), other values quoted where a shell would split them."""
    if isinstance(value, bool):
        return flag_of(name) if value else "--no-" + name.replace("_", "-")
    words = value if isinstance(value, (list, tuple)) else [value]
    return " ".join([flag_of(name), *(shlex.quote(value_text(name, w)) for w in words)])
