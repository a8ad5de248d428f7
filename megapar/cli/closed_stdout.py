"""`quiet_when_stdout_closes`: a command whose reader stops early (`megapar-plan ... | head`)
ends without a traceback, as Python's documentation advises for SIGPIPE."""

from __future__ import annotations

import functools
import os
import select
import sys
from collections.abc import Callable


def stdout_closed() -> bool:
    """Whether standard output is a pipe whose reader has gone (poll reports an error on it)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):  # replaced by an object without a descriptor
        return False
    poll = select.poll()
    poll.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))


def quiet_when_stdout_closes(main: Callable[..., int]) -> Callable[..., int]:
    """`main`, returning 1 without a traceback when its standard output was closed by the
    reader; a BrokenPipeError of any other pipe (a socket, a worker's) is raised as it was."""

    @functools.wraps(main)
    def wrapped(argv=None) -> int:
        try:
            code = main(argv)
            sys.stdout.flush()
            return code
        except BrokenPipeError:
            if not stdout_closed():
                raise
            # The rest of what is buffered goes nowhere, so that exit's flush cannot fail again.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1

    return wrapped
