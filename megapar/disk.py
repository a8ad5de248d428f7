"""A disk's refusals of a write (full, over its quota, gone read-only, a file too large): errors
of the machine, not of the code, which megapar's tools say in one line with their fix and
without a traceback."""

from __future__ import annotations

import errno

DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)
"""The errnos of a disk's refusal of a write: exit 1 (not bad input's 2), no traceback."""
