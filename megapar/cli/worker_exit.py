"""How megapar-eval's and megapar-generate's workers ending in an exception end the command:
a Ctrl-C or SIGTERM that stopped the ranks is one line and exit 130 / 143, any other failure
one line naming the rank (its traceback in a log file) and exit 1."""

from __future__ import annotations

import re
import sys
import traceback

from megapar.faults.report import log_dir_for, worker_failure
from megapar.faults.stop import SIGTERM_EXIT_CODE
from megapar.launcher import WorkerError

_STOPPED = re.compile(r"rank \d+ failed: (?:KeyboardInterrupt\b|(SystemExit: 143)$)", re.M)
"""How a rank that a Ctrl-C or a SIGTERM stopped fails (`WorkerError`'s first line)."""


def worker_exit(tool: str, exc: Exception, doing: str, stopped_note: str = "") -> int:
    """Print `tool`'s line for `exc`, raised by its `run_workers`, and return the exit code.
    A Ctrl-C or SIGTERM (the terminal's to every rank, or passed on by the launcher) is not a
    failure: "interrupted" / "terminated (SIGTERM)" and `stopped_note`; a failure's line says
    `doing` (e.g. "in evaluation") where megapar-train's says "before training started"."""
    stopped = _STOPPED.match(str(exc)) if isinstance(exc, WorkerError) else None
    if stopped:
        sigterm = stopped.group(1) is not None
        what = "terminated (SIGTERM)" if sigterm else "interrupted"
        print(f"{tool}: {what}{stopped_note}", file=sys.stderr)
        return SIGTERM_EXIT_CODE if sigterm else 130
    text = (
        str(exc)
        if isinstance(exc, WorkerError)
        else f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    )
    line, log = worker_failure(text, log_dir_for(None, "~/.cache/megapar"), None)
    print(
        f"{tool}: error: {line.replace('before training started', doing)}"
        + (f" (full traceback in {log})" if log else ""),
        file=sys.stderr,
    )
    return 1
