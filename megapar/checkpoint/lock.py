"""The save-directory lock: one run at a time writes a checkpoint root.

Two runs saving into one ``--save`` directory (a requeued job started while the old one still
runs) would overwrite each other's ``step_*`` directories and ``latest`` silently. So a run
takes ``ROOT/megapar.lock`` before any worker starts and keeps it until it exits:

- the file holds the owner's host, pid, the process's start time (to tell a reused pid), the
  directory it locks (its path, device and inode: a copy of the directory, ``cp -r`` of a live
  run's checkpoints, carries a lock that is not its own), the start time of the run and its
  command line, as JSON; `describe` turns it into the one line a refused run prints;
- the owner holds an exclusive ``flock`` on it (released by the kernel when the process dies,
  even by ``kill -9``) and refreshes its modification time every `HEARTBEAT_S` seconds;
- `SaveLock.release` (on exit, an exception, SIGTERM) deletes the file, also when SIGTERM
  comes while the process is blocked in a wait (`megapar.faults.stop.watch_sigterm`: torchrun's
  rank 0 waiting for the others to join). A forked child never deletes its parent's lock.

A lock left behind is *stale* when its owner is gone: on this host, when the pid no longer
runs (or runs another process: its start time differs) and no process holds the ``flock``, or
when the file was copied from another directory (the owner locks that one, not this); on
another host, whose processes cannot be seen, only when its heartbeat is older than
`STALE_AFTER_S` (a ``flock`` on a network file system may or may not reach other hosts, so it
is not trusted for them). A stale lock is taken over with a note; a live one refuses the run
(`SaveLockError`), naming the other run and the fix.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import shlex
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from megapar.faults import stop
from megapar.faults.processes import pid_alive, process_start

LOCK_NAME = "megapar.lock"
HEARTBEAT_S = 30.0
"""How often the owner refreshes the lock file's modification time."""
STALE_AFTER_S = 300.0
"""A lock of another host whose heartbeat is older than this is stale."""


class SaveLockError(RuntimeError):
    """The save directory is in use by another live run."""


def _fs_now(directory: Path) -> float:
    """The current time as the file system stamps it (immune to clock skew between hosts)."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".megapar-clock-") as f:
            return os.fstat(f.fileno()).st_mtime
    except OSError:
        return time.time()


def read_owner(path: Path) -> dict | None:
    """The owner record of a lock file (None when there is none or it is unreadable)."""
    try:
        owner = json.loads(path.read_text())
        return owner if isinstance(owner, dict) else None
    except (OSError, ValueError):
        return None


def describe(owner: dict, root: Path, age_s: float | None = None) -> str:
    """One sentence naming the run that holds `root`'s lock."""
    alive = f", last alive {age_s:.0f} s ago" if age_s is not None else ""
    command = owner.get("command") or "?"
    if len(command) > 120:
        command = command[:117] + "..."
    return (
        f"--save {root} is in use by another run (pid {owner.get('pid')} on "
        f"{owner.get('host')}, started {owner.get('started')}{alive}: {command})"
    )


def _directory_id(directory: Path) -> list[int] | None:
    """[device, inode] of `directory` (None when it cannot be read)."""
    try:
        st = directory.stat()
    except OSError:
        return None
    return [st.st_dev, st.st_ino]


def owner_state(path: Path) -> tuple[str, dict | None, float | None]:
    """("none" | "live" | "stale" | "copy", owner, heartbeat age in seconds) of a lock file, as
    seen from this process (the ``flock`` is not consulted: see `SaveLock.acquire`). "copy":
    a lock of this host that its owner took in another directory (this one is a copy of it),
    so it does not lock this one."""
    owner = read_owner(path)
    if owner is None:
        return ("none" if not path.exists() else "stale"), None, None
    try:
        age = _fs_now(path.parent) - path.stat().st_mtime
    except OSError:
        return "none", None, None
    if owner.get("host") == socket.gethostname():
        directory = owner.get("directory_id")
        if directory is not None and directory != _directory_id(path.parent):
            return "copy", owner, age
        try:
            pid = int(owner["pid"])
        except (KeyError, TypeError, ValueError):
            return "stale", owner, age
        return ("live" if pid_alive(pid, owner.get("proc_start")) else "stale"), owner, age
    return ("live" if age <= STALE_AFTER_S else "stale"), owner, age


def refusal(
    root: Path, owner: dict, age: float | None, other: str = "give this run another --save"
) -> str:
    """The message of a refused second writer: who holds the lock, and what to do (`other`:
    the writer's other way out, e.g. megapar-convert's another DST)."""
    other_host = owner.get("host") != socket.gethostname()
    when = (
        f"; a lock of another host counts as abandoned {STALE_AFTER_S / 60:g} minutes "
        f"after its last heartbeat, or delete {root / LOCK_NAME} if that run is gone"
        if other_host
        else ""
    )
    return (
        f"{describe(owner, root, age if other_host else None)}: two runs saving into one "
        f"directory overwrite each other's checkpoints; wait for it to end, stop it, or "
        f"{other}{when}"
    )


def launched_job() -> str | None:
    """The torchrun / Slurm job this process is a rank of, as its ranks all see it (its
    rendezvous address and run id); None outside a launcher's job. A live job holds its
    address, so another live run has another."""
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    run = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID") or ""
    return f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}/{run}"


def check_unlocked(
    root: str | Path,
    allowed_pids: tuple[int, ...] = (),
    other: str = "give this run another --save",
    job: str | None = None,
) -> None:
    """Raise SaveLockError when another live run (not one of `allowed_pids`, e.g. this process
    and its launcher, nor the launcher's `job` whose rank 0 took it: `launched_job`) holds
    `root`'s lock (`other`: as `refusal`'s). Reads only; writes nothing."""
    root = Path(root).expanduser()
    state, owner, age = owner_state(root / LOCK_NAME)
    if state != "live" or owner is None:
        return
    if owner.get("host") == socket.gethostname() and owner.get("pid") in allowed_pids:
        return
    if job is not None and owner.get("job") == job:
        return
    raise SaveLockError(refusal(root, owner, age, other))


class SaveLock:
    """The exclusive lock of one checkpoint root, held by this process while a run writes it.

        lock = SaveLock(save_dir).acquire()   # SaveLockError when another run holds it
        try: ... run ...
        finally: lock.release()

    `command`: the run's command line, recorded for the refusal (default: this process's);
    `rank_logs`: where the run's rank logs go, recorded for its other ranks (`read_owner`).
    `acquire` returns self; `taken_over` then names a stale lock it replaced (or is None).
    While held, SIGTERM (when nothing else handles it) releases the lock and exits.
    """

    def __init__(self, root: str | Path, command: str | None = None, rank_logs: dict | None = None):
        self.root = Path(root).expanduser()
        self.command = command or shlex.join([os.path.basename(sys.argv[0]), *sys.argv[1:]])
        self.rank_logs = rank_logs
        """Where the run's ranks write their logs when one fails, recorded for the ranks that
        do not hold the lock (megapar-train's {"in_save", "run"})."""
        self.path = self.root / LOCK_NAME
        self.taken_over: str | None = None
        self._fd: int | None = None
        self._owner: int | None = None  # the pid that took it (a forked child does not own it)
        self._stop = threading.Event()
        self._old_sigterm: Callable[[int, FrameType | None], Any] | int | None = None

    def acquire(self) -> SaveLock:
        """Take the lock: SaveLockError where a live run holds it, an OSError naming the lock
        file where it cannot be written (a full disk; no file is left)."""
        self.root.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a live process holds it (here, or over NFS)
                os.close(fd)
                state, owner, age = owner_state(self.path)
                raise SaveLockError(
                    refusal(self.root, owner or {"host": "?", "pid": "?"}, age)
                ) from None
            except OSError as exc:  # a file system without flock: the record decides
                if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    os.close(fd)
                    raise
            try:  # the file may have been deleted (released) between open and flock: retry
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        state, owner, age = owner_state(self.path)
        if state == "live" and owner is not None:  # e.g. another host's, alive by its heartbeat
            os.close(fd)
            raise SaveLockError(refusal(self.root, owner, age))
        if state == "copy" and owner is not None:
            self.taken_over = (
                f"took over {self.path}, a copy of the lock of pid {owner.get('pid')}'s run "
                f"(started {owner.get('started')}), which locks {owner.get('directory')}, "
                f"not this directory"
            )
        elif owner is not None:
            self.taken_over = (
                f"took over the stale lock {self.path} of pid {owner.get('pid')} "
                f"on {owner.get('host')} (started {owner.get('started')}), "
                f"whose run is gone"
            )
        job = launched_job()
        record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "proc_start": process_start(os.getpid()),
            "directory": str(self.root.resolve()),
            "directory_id": _directory_id(self.root),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": self.command,
            **({"rank_logs": self.rank_logs} if self.rank_logs is not None else {}),
            **({"job": job} if job is not None else {}),
        }
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
            os.fsync(fd)
        except OSError as exc:  # a full disk: the empty file goes, the error names it
            self.path.unlink(missing_ok=True)
            os.close(fd)
            raise OSError(exc.errno, exc.strerror, str(self.path)) from None
        self._fd, self._owner = fd, os.getpid()
        stop.on_forced_exit(self.release, "--save lock released")
        threading.Thread(target=self._heartbeat, name="megapar-save-lock", daemon=True).start()
        self._catch_sigterm()
        return self

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def _catch_sigterm(self) -> None:
        """SIGTERM with its default action would kill this process with the file in place; a
        SIGTERM while the process is blocked in a wait releases it too (`stop.watch_sigterm`)."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:

            @stop.exits_at_once
            def on_sigterm(signum, frame):
                self.release()
                raise SystemExit(128 + signum)

            self._old_sigterm = signal.signal(signal.SIGTERM, on_sigterm)
        stop.watch_sigterm()

    def release(self) -> None:
        """Delete the lock file and drop the lock (idempotent; nothing in a forked child)."""
        if self._fd is None or self._owner != os.getpid():
            return
        stop.forget_forced_exit(self.release)
        self._stop.set()
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None
        try:
            if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:  # still ours
                self.path.unlink()
        except OSError:  # gone, or --save was moved, replaced or made read-only under the run
            pass
        finally:
            os.close(self._fd)  # drops the flock
            self._fd = None

    def __enter__(self) -> SaveLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
