"""A disk's refusals of a write (full, over its quota, gone read-only, a file too large): errors
of the machine, not of the code, which megapar's tools say in one line with their fix and
without a traceback."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable

from megapar.faults.processes import remove_stale_tmps, tmp_name
from megapar.made_dirs import keep_mode

DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)
"""The errnos of a disk's refusal of a write: exit 1 (not bad input's 2), no traceback."""


def write_whole(path: str, write: Callable[[str], None], suffix: str = "") -> None:
    """`write(file)` into a temporary file beside `path` (`tmp_name` + `suffix`: a chart's
    format is its suffix), renamed onto `path` with its mode (`keep_mode`) once complete: a
    disk that refuses the write, or a signal mid-write, leaves `path` as it was and no
    temporary, and a killed run's temporary is removed by the next (`remove_stale_tmps`). A
    `path` that is no regular file (a device: /dev/null) is written itself, never replaced.
    Its OSError is raised for the caller to word (`refused_write`)."""
    special = os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode)
    part = path if special else tmp_name(path) + suffix
    try:
        if not special:
            remove_stale_tmps(path)
        write(part)
        if not special:
            keep_mode(part, path)  # the replaced file's (its 0600 became 0644; a re-test)
            os.replace(part, path)
    finally:
        if part != path:
            with contextlib.suppress(OSError):
                os.remove(part)


def refused_write(flag: str, path: str, exc: OSError) -> str:
    """The one line of a write of `flag`'s file `path` that `write_whole` could not make."""
    return (
        f"{flag} {path}: {exc.strerror or exc} while writing it; nothing was written (free "
        f"space there, or give another file name)"
    )
