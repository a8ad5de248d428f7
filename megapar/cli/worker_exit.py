"""How megapar-eval's and megapar-generate's workers ending in an exception end the command:
a Ctrl-C or SIGTERM that stopped the ranks is one line and exit 130 / 143, any other failure
one line naming the rank (its traceback in a log file) and exit 1; and their refusal of a
torchrun / Slurm job of another size than tp x pp. Which process of such a job prints what
every process refuses (`prints_refusals`; `refused`, `parser_errors_once`: the start-up errors
of megapar-train too)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from megapar.device import env_local_rank
from megapar.faults.report import log_dir_for, tell_torchrun, worker_failure
from megapar.faults.stop import SIGTERM_EXIT_CODE, sigterm_as_exit
from megapar.launcher import WorkerError, launched_world_size, run_workers, under_launcher

_STOPPED = re.compile(
    r"rank \d+ failed: (?:KeyboardInterrupt\b|(SystemExit\(143\): terminated \(SIGTERM\))$)", re.M
)
"""How a rank that a Ctrl-C or a SIGTERM stopped fails (`WorkerError`'s first line)."""


def stopped_line(tool: str, sigterm: bool, stopped_note: str = "") -> tuple[str, int]:
    """(`tool`'s line, its exit code) for a run a SIGTERM (else a Ctrl-C) stopped."""
    what = "terminated (SIGTERM)" if sigterm else "interrupted"
    return f"{tool}: {what}{stopped_note}", SIGTERM_EXIT_CODE if sigterm else 130


TRACEBACK = "Traceback (most recent call last)"
"""What a failure's text holds where a rank's stack is in it (a log worth pointing to)."""


def worker_exit(tool: str, exc: Exception, doing: str, stopped_note: str = "") -> int:
    """Print `tool`'s line for `exc`, raised by its `run_workers`, and return the exit code.
    A Ctrl-C or SIGTERM (the terminal's to every rank, or passed on by the launcher) is not a
    failure: "interrupted" / "terminated (SIGTERM)" and `stopped_note`; a failure's line says
    `doing` (e.g. "in evaluation") where megapar-train's says "before training started". A
    failure this process's rank raised without a traceback to show (`no_traceback`: under
    torchrun a checkpoint file failing its check, or another rank's failure to load it,
    `load_everywhere`) is its message alone, as megapar-train's line is: no type name, no
    log named for a traceback it does not hold."""
    stopped = _STOPPED.match(str(exc)) if isinstance(exc, WorkerError) else None
    if stopped:
        line, code = stopped_line(tool, stopped.group(1) is not None, stopped_note)
        print(line, file=sys.stderr)
        return code
    rank = None  # a WorkerError names its rank
    clean = False
    if isinstance(exc, WorkerError):  # a forked rank's: a log only for a traceback (a full
        text = str(exc)  # disk under --save-logits pointed at one of none; a re-test)
        clean = TRACEBACK not in text
    else:  # this process's rank: under torchrun / Slurm its own, not rank 0
        rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
        clean = getattr(exc, "no_traceback", False)
        text = str(exc) if clean else f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    line, log = worker_failure(text, log_dir_for(None, "~/.cache/megapar"), rank)
    print(
        f"{tool}: error: {line.replace('before training started', doing)}"
        + (f" (full traceback in {log})" if log and not clean else ""),
        file=sys.stderr,
    )
    return 1


def run_reported(
    tool: str,
    worker: Callable[[Any], Any],
    world_size: int,
    args: Any,
    doing: str,
    stopped_note: str = "",
) -> list[Any] | int:
    """`run_workers(worker, world_size, args)` (no optimizers), or the exit code of its end
    (its line printed: `worker_exit`). A single local worker runs in this process: a SIGTERM
    raises SystemExit(143) there (`sigterm_as_exit`) and ends, as a Ctrl-C's KeyboardInterrupt
    does, in the same line and exit code as the forked ranks' stop. Under torchrun / Slurm,
    whose SIGTERM raises SystemExit(143) in each rank (`run_workers`), a SIGTERM's or Ctrl-C's
    line is printed by the first process of each node (`prints_refusals`); the others end
    with its exit code and no line."""
    launched = under_launcher()
    previous = None if launched or world_size > 1 else sigterm_as_exit()
    try:
        return run_workers(worker, world_size, args, optimizers=False)
    except KeyboardInterrupt:
        line, code = stopped_line(tool, False, stopped_note)
    except SystemExit as exc:
        if (previous is None and not launched) or exc.code != SIGTERM_EXIT_CODE:
            raise
        line, code = stopped_line(tool, True, stopped_note)
    except Exception as exc:  # noqa: BLE001 - one line here, the traceback in a log file
        return worker_exit(tool, exc, doing, stopped_note)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if prints_refusals():  # once per node under torchrun / Slurm
        print(line, file=sys.stderr)
    return code


def launched_size_refusal(tool: str, tp: int, pp: int, cp: int = 1) -> str | None:
    """The refusal of a torchrun / Slurm job whose process count is not `tool`'s tp x cp x pp
    (it has no data parallelism), or None (no launcher, or the right count). Every process of
    the job refuses it (exit 2); only the first on each node (`prints_refusals`) prints it."""
    world = tp * cp * pp
    if not under_launcher() or launched_world_size() == world:
        return None
    sizes = f"tp x cp x pp = {tp} x {cp} x {pp}" if cp > 1 else f"tp x pp = {tp} x {pp}"
    flags = "--tp / --cp / --pp" if cp > 1 else "--tp / --pp"
    return (
        f"torchrun / Slurm started {launched_world_size()} processes but {tool} runs on "
        f"{sizes} = {world} (it has no data parallelism); start {world} or change {flags}"
    )


def prints_refusals() -> bool:
    """Whether this process prints a refusal (or a note) every process of a torchrun / Slurm
    job makes: the first on its node (LOCAL_RANK / SLURM_LOCALID 0), or one started alone
    (megapar-train's, megapar-eval's and megapar-generate's start-up errors). Per node, not
    RANK 0 alone: each node's torchrun shows its own workers' output, so every node's says
    why it stopped, once. Malformed launcher variables: every process (its own to say)."""
    try:
        return not under_launcher() or env_local_rank() == 0
    except ValueError:
        return True


REFUSAL_LEAD_S = 5.0
"""How long a process that does not print a refusal every process makes (`prints_refusals`)
waits before it exits: torchrun ends a node's other workers (SIGTERM) once one exits non-zero,
and its first worker, about to print the line, was ended unheard (1 run in 4 of a --tp 3 on 4
processes)."""


def _after_the_printer() -> None:
    """Under a launcher, in a process that does not print the refusal: wait `REFUSAL_LEAD_S`,
    for the node's first process to print it before torchrun ends it."""
    if under_launcher() and not prints_refusals():
        time.sleep(REFUSAL_LEAD_S)


def refused(tool: str, message: object) -> int:
    """Print `tool`'s one-line start-up error (bad input, before any worker) where
    `prints_refusals` says; its exit code, 2, on every process (the others exit after the
    one that prints, `_after_the_printer`)."""
    if prints_refusals():
        print(f"{tool}: error: {message}", file=sys.stderr)
    else:
        _after_the_printer()
    return 2


@contextlib.contextmanager
def parser_errors_once() -> Iterator[None]:
    """Within: a parser's error line (argparse prints it, then exits 2) reaches stderr only
    where `prints_refusals`; elsewhere stderr is discarded, the exit code the same. Under
    torchrun every rank's error file gets the line too (`tell_torchrun`), as a refusal after
    the parser's does: its summary said "error_file: <N/A>" for a mistyped flag."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            yield
    except SystemExit as exc:
        line = said.getvalue().strip()
        if exc.code == 2 and line:
            tell_torchrun(line.splitlines()[-1], None)
            _after_the_printer()
        raise
    finally:
        if prints_refusals():
            sys.stderr.write(said.getvalue())
