"""The console scripts' entry points (pyproject.toml's ``[project.scripts]``).

Each imports its command's module and runs its ``main``. A command's imports (torch's) take
seconds; a Ctrl-C in them would print a traceback of whatever import it cut, and a SIGTERM end
the command without a word. While it imports, either ends it at once
with one line, exit 130 (Ctrl-C) or 143 (SIGTERM): nothing has been done yet, and an exception
raised inside a library's import could be caught there and leave it half imported. A Ctrl-C
the command's own ``main`` does not handle ends it with one line, exit 130, as well; in the
console script, one after ``main`` returned is ignored (the command only exits then).
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading

INTERRUPTED_EXIT_CODE = 130
"""128 + SIGINT: the shells' exit status of a command a Ctrl-C ended."""

ENDED_WORDS = {"SIGTERM": "terminated", "SIGHUP": "hung up", "SIGQUIT": "quit", "SIGUSR2": "ended"}
"""The other signals whose default action would end a command without a word (while it
imports, or a command that writes: megapar-convert), and the word its one line says then."""


def exit_while_starting(command: str):
    """A signal handler for `command` while it starts (imports): one line, then exit 128 + the
    signal's number at once (os._exit: an exception raised inside a library's import could be
    caught there, or abort the process)."""

    def exit_at_once(signum, frame):
        sig = signal.Signals(signum)
        what = "interrupted" if sig == signal.SIGINT else f"{ENDED_WORDS[sig.name]} ({sig.name})"
        os.write(2, f"{command}: {what} while starting; nothing was done\n".encode())
        os._exit(128 + signum)

    return exit_at_once


def _import_main(command: str, name: str):
    """`megapar.cli.NAME`'s main. Meanwhile (in the main thread) a Ctrl-C, SIGTERM, SIGHUP,
    SIGQUIT or SIGUSR2, where it has its default action, writes one line and exits (128 + its
    number); the handlers are as they were again once the import ends, for the command's
    own."""
    if threading.current_thread() is not threading.main_thread():
        return importlib.import_module(f"megapar.cli.{name}").main
    exit_at_once = exit_while_starting(command)

    defaults: dict[int, object] = {signal.SIGINT: signal.default_int_handler}
    for other in ENDED_WORDS:  # where the platform has it (Windows has no SIGHUP)
        if hasattr(signal, other):
            defaults[getattr(signal, other)] = signal.SIG_DFL
    previous = {
        sig: signal.signal(sig, exit_at_once)
        for sig, default in defaults.items()
        if signal.getsignal(sig) is default
    }
    try:
        return importlib.import_module(f"megapar.cli.{name}").main
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(name: str) -> int:
    command = f"megapar-{name}"
    main = _import_main(command, name)
    try:
        return main()
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE
    finally:  # done: a late Ctrl-C (a second one just after a clean stop) would only cut the
        # exit short, with a traceback of an exit handler or a death by SIGINT
        if _console_script(command) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def _console_script(command: str) -> bool:
    """Whether this process is `command`'s console script (which exits once the command
    returns), not a caller of this module's functions that goes on (a test, a notebook)."""
    return os.path.basename(sys.argv[0]).startswith(command) if sys.argv else False


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


def generate() -> int:
    return _run("generate")
