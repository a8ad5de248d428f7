"""The tests' forked child: a command run in a process of its own, so the signals a test sends
it (or its launcher) never reach pytest."""

import os
import sys


def fork_running(fn, out) -> int:
    """Fork a child that runs `fn()` with its stdout and stderr in the file `out` (not pytest's
    capture) and exits with what `fn` returns (3 if it raises); returns the child's pid."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = sys.stderr = open(fd, "w", buffering=1)
        rc = 3
        try:
            rc = fn()
        finally:
            os._exit(rc)
    return pid


def exit_code(pid: int) -> int:
    """The exit code of child `pid`, once it has ended (-N: killed by signal N)."""
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def join_or_kill(procs, timeout_s: float) -> None:
    """Join the multiprocessing children `procs`, each within `timeout_s`; one still alive then
    is killed (and reaped), so a hung child never outlives its test."""
    for p in procs:
        p.join(timeout=timeout_s)
        if p.is_alive():
            p.kill()
            p.join()
