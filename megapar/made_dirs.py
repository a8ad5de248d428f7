"""The directories a write makes and takes back: `missing_dirs` lists what ``mkdir(parents=True)``
would make, `remove_empty` removes them again while they are empty (a failed first save, a rank
log that could not be written); `give_usual_mode` gives what a writer made private the mode a
plain create would. Standard library only, for any layer."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def missing_dirs(path: str | Path) -> list[Path]:
    """`path` and those of its parents that do not exist yet, deepest first: the directories
    ``mkdir(parents=True)`` of it would make (`remove_empty` takes them back)."""
    missing, here = [], Path(path).expanduser().absolute()
    while here != here.parent and not (here.exists() or here.is_symlink()):
        missing.append(here)
        here = here.parent
    return missing


def remove_empty(dirs: list[Path]) -> None:
    """Remove `dirs` (deepest first, as `missing_dirs` lists them) while each is an empty
    directory: from the first that holds anything (or is gone or not a directory) on, every
    one is left as it is, so nothing but empty directories is ever removed."""
    for directory in dirs:
        try:
            directory.rmdir()
        except OSError:
            return


def give_usual_mode(path: str | os.PathLike) -> None:
    """Give `path` the mode a plain create under this process's umask would: 0o777 less the
    umask for a directory, 0o666 less it for a file (`tempfile.mkdtemp` makes its directory
    0700, safetensors its file 0600, so what is renamed into place would be its owner's only)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~umask)


def keep_mode(path: str | os.PathLike, replaced: str | os.PathLike) -> None:
    """Give `path`, a file about to be renamed over `replaced`, the mode of `replaced` where
    that exists (a user's private 0600 file stays private), else the usual mode
    (`give_usual_mode`)."""
    try:
        os.chmod(path, stat.S_IMODE(os.stat(replaced).st_mode))
    except FileNotFoundError:
        give_usual_mode(path)
