"""Durations megapar reads from environment variables (MEGAPAR_TIMEOUT_S, ...): a value that is
no number of seconds from MIN_SECONDS to MAX_SECONDS falls back to the default at import (an
import must not fail on it) and is named in one line by the command-line tools' checks
(`problem`)."""

from __future__ import annotations

import os

MAX_SECONDS = 1e9
"""Longest wait a timeout takes (about 31 years): torch's TCPStore fails at once from about
1e10 s (its deadline in int64 nanoseconds overflows), gloo from 1e13, datetime.timedelta from
8.64e13 (measured with torch 2.13)."""

MIN_SECONDS = 1e-3
"""Shortest wait a timeout takes: torch counts a wait in whole milliseconds, and a shorter one
is 0, a wait that times out at once (1e-4 s failed every rank's join with gloo's stack dumps)."""

TIMEOUT_ENV = {"timeout_s": "MEGAPAR_TIMEOUT_S", "nccl_timeout_s": "MEGAPAR_NCCL_TIMEOUT_S"}
"""megapar-train's timeout settings that an environment variable gives a default (where the
command line and its --config give none)."""

TIMEOUT_VARIABLES = (*TIMEOUT_ENV.values(), "MEGAPAR_STOP_GRACE_S")
"""The environment variables of megapar's waits, checked by every command that waits."""


def env_seconds(name: str, default: float) -> float:
    """Environment variable `name` as seconds: its value where it is a number of at least
    `MIN_SECONDS` and at most `MAX_SECONDS`, else `default` (unset, or invalid)."""
    try:
        value = float(os.environ[name])
    except (KeyError, ValueError):
        return default
    return value if MIN_SECONDS <= value <= MAX_SECONDS else default


def problem(*names: str) -> str | None:
    """The one line for the first of environment variables `names` (default: every one of
    `TIMEOUT_VARIABLES`) whose value is not a number of seconds from `MIN_SECONDS` to
    `MAX_SECONDS`; None where every one that is set is."""
    for name in names or TIMEOUT_VARIABLES:
        given = os.environ.get(name)
        if given is not None and env_seconds(name, -1.0) == -1.0:
            return (
                f"{name}={given!r} is invalid: give a number of seconds from {MIN_SECONDS:g} "
                f"to {MAX_SECONDS:g}, or unset it"
            )
    return None
