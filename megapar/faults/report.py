"""An unexpected error in a running worker: one line for the terminal, the traceback in a file.

`worker_failure(text, log_dir, rank)` turns a failure (a launcher WorkerError message, or the
traceback of a rank run in this process) into one line naming the rank and the step, and writes
the full text to `log_dir/rank{R}.log`; `log_dir_for` says where those logs go;
`tell_torchrun` gives the line to torchrun, which prints it as the failure's root cause.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from megapar.made_dirs import missing_dirs, remove_empty

_RANK = re.compile(r"^rank (\d+) failed: ")
_DIED = re.compile(r"^rank (\d+) ")
_STEP = re.compile(r"^TrainingError: rank \d+ \([^)]*\) failed at step (\d+): ")


_RUN_NAME = re.compile(r"^run-[0-9]{8}-[0-9]{6}-[0-9]+$")


_job: dict[str, str] = {}  # the run log name this process's job agreed on (`use_run_log_name`)


def run_log_name() -> str:
    """A run's own directory name under CACHE/logs: run-<time>-<pid> of this process, or the
    one its job's ranks agreed on (`use_run_log_name`)."""
    return _job.get("run") or f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def use_run_log_name(name: str | None) -> None:
    """Name this process's run `name` (a `run_log_name` of its job's rank 0, so that every rank
    of a torchrun / srun job without a --save lock record writes its log in one directory);
    None: its own again."""
    _job.clear()
    if name is not None and is_run_log_name(name):
        _job["run"] = name


os.register_at_fork(after_in_child=_job.clear)  # a forked run is a run of its own


def is_run_log_name(name: object) -> bool:
    """Whether `name` is a `run_log_name` (one path component: safe to join to CACHE/logs)."""
    return isinstance(name, str) and bool(_RUN_NAME.match(name))


def log_dir_for(save: str | None, cache: str, run: str | None = None) -> Path:
    """Where per-rank logs go: SAVE/logs with `save`, else CACHE/logs/RUN, RUN the run's
    directory name (`run`, which the ranks of one job share; default this process's
    `run_log_name`). The caller passes no `save` for a --save its run made and saved nothing
    in."""
    if save:
        return Path(os.path.expanduser(save)) / "logs"
    name = run if run is not None and is_run_log_name(run) else run_log_name()
    return Path(os.path.expanduser(cache)) / "logs" / name


def worker_failure(text: str, log_dir: Path, rank: int | None = None) -> tuple[str, str | None]:
    """(one line naming the rank and the step, the log file with the full text) of a failure.

    `text` is a WorkerError message ("rank R failed: Type: message\\nTraceback ...") or, for a
    rank run in this process, "Type: message\\nTraceback ..." with `rank` given."""
    first, _, _ = text.partition("\n")
    m = _RANK.match(first)
    died = _DIED.match(first)
    if m:
        rank, first = int(m.group(1)), first[m.end() :]
    elif died and rank is None:  # "rank R died with exit code C": no traceback to show
        rank = int(died.group(1))  # (a rank's own line naming another is logged as its own)
    rank = 0 if rank is None else rank
    s = _STEP.match(first)
    if s:
        where, first = f"at step {s.group(1)}", first[s.end() :]
    else:
        where = "before training started"
    line = f"rank {rank} failed {where}: {first}" if not _DIED.match(first) else first

    log = log_dir / f"rank{rank}.log"
    made, new = missing_dirs(log_dir), not log.exists()
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        log.write_text(text if text.endswith("\n") else text + "\n")
    except OSError:  # e.g. the disk is full: no half-written log, no directory made for it
        try:
            if new:
                log.unlink(missing_ok=True)
        except OSError:
            pass
        remove_empty(made)
        return line, None
    return line, str(log)


def tell_torchrun(line: str, log: str | None) -> None:
    """Under torchrun, a failed rank's one line (and where its log is) in the error file torchrun
    gave it (TORCHELASTIC_ERROR_FILE, in the JSON of torch elastic's `ErrorHandler`): torchrun
    prints it as "traceback" in its summary, under "Root Cause" for the rank that failed first,
    where it would otherwise say "error_file: <N/A>". Nothing elsewhere, or when unwritable."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    shown = line + (f"\n(this rank's log: {log})" if log else "")
    data = {
        "message": {
            "message": line,
            "extraInfo": {"py_callstack": shown, "timestamp": str(int(time.time()))},
        }
    }
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass
