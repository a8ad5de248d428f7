"""The console scripts' entry points (pyproject.toml's ``[project.scripts]``).

Each imports its command's module and runs its ``main``. A command's imports take seconds
(torch's alone about 2.5 s), and a Ctrl-C in them printed a traceback of whatever import it
cut; here it ends the command with one line and exit 130, as megapar-data's Ctrl-C does. A
Ctrl-C the command's own ``main`` does not handle ends it the same way.
"""

from __future__ import annotations

import importlib
import sys

INTERRUPTED_EXIT_CODE = 130
"""128 + SIGINT: the shells' exit status of a command a Ctrl-C ended."""


def _run(name: str) -> int:
    command = f"megapar-{name}"
    try:
        main = importlib.import_module(f"megapar.cli.{name}").main
    except KeyboardInterrupt:
        print(f"{command}: interrupted while starting; nothing was done", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE
    try:
        return main()
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE


def train() -> int:
    return _run("train")


def data() -> int:
    return _run("data")


def eval() -> int:  # noqa: A001 - the command's name
    return _run("eval")


def convert() -> int:
    return _run("convert")


def bubble() -> int:
    return _run("bubble")


def plan() -> int:
    return _run("plan")
