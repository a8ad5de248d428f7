"""Durations megapar reads from environment variables (MEGAPAR_TIMEOUT_S, ...): a value that is
no finite number of seconds > 0 falls back to the default at import (an import must not fail on
it) and is named in one line by the command-line tools' checks (`problem`)."""

from __future__ import annotations

import os


def env_seconds(name: str, default: float) -> float:
    """Environment variable `name` as seconds: its value where it is a finite number > 0, else
    `default` (unset, or invalid)."""
    try:
        value = float(os.environ[name])
    except (KeyError, ValueError):
        return default
    return value if 0 < value < float("inf") else default


def problem(*names: str) -> str | None:
    """The one line for the first of environment variables `names` whose value is not a finite
    number of seconds > 0; None where every one that is set is."""
    for name in names:
        given = os.environ.get(name)
        if given is not None and env_seconds(name, -1.0) == -1.0:
            return f"{name}={given!r} is invalid: give a number of seconds > 0, or unset it"
    return None
