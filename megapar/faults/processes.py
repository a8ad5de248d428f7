"""Whether a process is alive, workers that die with their launcher, and the temporaries of
writers that died.

One answer to "is that process still there?" for everything that must tell a live owner from a
dead one: the save-directory lock, the leftovers of a crashed save, the stack directories of a
launcher killed with -9, a stopped worker, the temporary files and staging directories of a
writer killed with -9 (`owner_tag`, `remove_stale_temporaries`); and the work a process must
finish before it exits (`before_exit`, `finish_before_exit`: a background checkpoint write).
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import importlib
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
import uuid

PR_SET_PDEATHSIG = 1
_launcher_pid: int | None = None
_before_exit: list = []
_exit_uncollected = False


def process_start(pid: int) -> str | None:
    """An id of process `pid`'s start (boot id + start time in clock ticks; Linux), or None: a
    pid reused by another process after a reboot or a wrap-around has another one."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = f.read().rsplit(")", 1)[1].split()[19]
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{f.read().strip()}:{ticks}"
    except (OSError, IndexError):
        return None


def pid_alive(pid: int, start: str | None = None) -> bool:
    """Whether process `pid` of this host exists (another user's counts), and, when `start`
    (its `process_start`) is given and can be read, is still the same process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    except OSError:
        return True  # cannot tell: never treat a possibly live owner as gone
    if _state(pid) in ("Z", "X"):  # exited, not yet reaped (a parent gone; PID 1 reaps late)
        return False
    now = process_start(pid) if start is not None else None
    return start is None or now is None or now == start


def _state(pid: int) -> str | None:
    """Process `pid`'s state letter from Linux /proc (R, S, T, Z, ...); None where unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def cpu_ticks(pid: int) -> int | None:
    """CPU time process `pid` has used so far (user + system, every thread), in clock ticks
    (Linux /proc); None where unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


def stopped(pid: int) -> bool:
    """Whether live process `pid` is stopped (SIGSTOP / SIGTSTP; Linux /proc)."""
    return _state(pid) in ("T", "t")


def sibling_ranks() -> dict[int, int]:
    """{global rank: pid} of the other processes this one's parent started with a rank in
    their environment (RANK, or SLURM_PROCID): torchrun's workers on this node, an srun step's
    tasks. From /proc (Linux; {} elsewhere, and under megapar's own launcher, whose forked
    workers were started without one)."""
    found: dict[int, int] = {}
    try:
        tasks = os.listdir(f"/proc/{os.getppid()}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{os.getppid()}/task/{task}/children") as f:
                pids = [int(p) for p in f.read().split()]
        except (OSError, ValueError):
            continue
        for pid in pids:
            if pid == os.getpid():
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
            except OSError:
                continue
            rank = env.get(b"RANK", env.get(b"SLURM_PROCID", b""))
            if rank.isdigit():
                found[int(rank)] = pid
    return found


TORCHRUN_NAMES = (b"torchrun", b"torch.distributed.run", b"torch.distributed.launch")
"""How torchrun's agent is started: its script's name (`torchrun ...`, `python .../torchrun
...`), or the module `python -m` runs."""


def _is_torchrun(cmdline: bytes) -> bool:
    """Whether a process's command line (NUL-separated) starts torchrun's agent: its program or
    the script its interpreter runs is named torchrun, or it runs `-m torch.distributed.run`
    (a wrapper script whose name or arguments merely hold the word is not)."""
    argv = cmdline.split(b"\0")
    if any(os.path.basename(a) in TORCHRUN_NAMES for a in argv[:2]):
        return True
    return any(a == b"-m" and b in TORCHRUN_NAMES for a, b in zip(argv, argv[1:]))


def gone_siblings() -> list[int]:
    """Under torchrun, this process its agent's child: the global ranks of this node whose
    process is no longer there (killed, or ended), from LOCAL_RANK, LOCAL_WORLD_SIZE and
    `sibling_ranks`; [] elsewhere (megapar's own launcher's forked workers hold no rank in
    /proc's environment; a rank started through a wrapper, `torchrun --no-python run.sh`, is
    not the agent's child, and its siblings are not found beside it)."""
    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return []
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            parent = f.read()
    except OSError:
        return []
    if not _is_torchrun(parent):
        return []
    try:
        rank = int(os.environ["RANK"])
        local, size = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return []
    here = set(sibling_ranks()) | {rank}
    return [r for r in range(rank - local, rank - local + size) if r not in here]


def die_with_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """Kill this process (SIGKILL) as soon as `parent_pid`, its launcher, is gone: Linux's
    ``prctl(PR_SET_PDEATHSIG)``, and on any OS a watchdog thread that notices the re-parenting."""
    global _launcher_pid
    _launcher_pid = parent_pid
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watchdog still works
    if os.getppid() != parent_pid:  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)

    def watchdog():
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent_pid:
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watchdog, name="megapar-parent-watchdog", daemon=True).start()


def start_pool_worker(parent_pid: int, then: str, *args) -> None:
    """A spawned pool worker's initializer, in this light module so that it runs before the
    worker imports its work's modules (torch: seconds on a loaded machine, in which a worker of
    a parent killed -9 would go on): it dies with `parent_pid` (`die_with_parent`), leaves
    Ctrl-C to its parent (which ends it with SIGTERM, obeyed even where the parent ignores it:
    an ignored signal is inherited across the spawn's exec), then calls `then`
    ("module:function") with `args`."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent_pid)
    module, _, function = then.partition(":")
    getattr(importlib.import_module(module), function)(*args)


def before_exit(finish) -> None:
    """Have `finish()` run before this process exits: by `finish_before_exit`, which a local
    worker calls once its function returned (a forked worker skips `atexit`) and torchrun's and
    a single process's interpreter calls at exit. `finish` should hold only a weak reference
    to what it finishes."""
    _before_exit.append(finish)


def finish_before_exit() -> None:
    """Run (once each) what `before_exit` registered, in order; the first exception is raised
    after the others ran."""
    error = None
    while _before_exit:
        try:
            _before_exit.pop(0)()
        except BaseException as exc:  # noqa: BLE001 - raised once the rest ran
            error = error or exc
    if error is not None:
        raise error


def exit_uncollected() -> None:
    """Have this process's exit leave the objects alive then to the OS instead of collecting
    them (`gc.freeze()` once the exit has finished this process's work, unless process groups
    are still there). A command holds torch's modules, whose whole heap the interpreter's
    collections at exit walked. What a command writes is closed before it returns; only the
    finalizers of objects still in reference cycles at exit are not run, which Python never
    promises to run at exit."""
    global _exit_uncollected
    _exit_uncollected = True


def _freeze_at_exit() -> None:
    """`exit_uncollected`'s exit handler, run once `finish_before_exit` has run."""
    if not _exit_uncollected:
        return
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return  # a failed rank's groups: freed at exit as they always were
    gc.freeze()


atexit.register(_freeze_at_exit)  # atexit runs the last registered first: this after the next
atexit.register(finish_before_exit)


def launcher_alive() -> bool:
    """False once the launcher that started this worker has gone (True when there is none)."""
    return _launcher_pid is None or os.getppid() == _launcher_pid


def _host() -> str:
    """This host's name with every character but letters, digits and dots made ``_`` (so a
    name holding it splits at its dashes unambiguously)."""
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())


def owner_tag() -> str:
    """``PID-HOST`` of this process, put after ``.tmp-`` in the names of its temporary files
    and staging directories, so a later writer to the same destination can tell a dead one's
    leftovers from a live one's (`remove_stale_temporaries`)."""
    return f"{os.getpid()}-{_host()}"


def stale_temporaries(directory: str | os.PathLike, prefix: str) -> list[str]:
    """The names of the entries ``directory/{prefix}PID-HOST-...`` (files or directories, named
    with `owner_tag`) whose writer was a process of this host that is gone (killed with -9,
    say), sorted. A live writer's (another run writing the same destination now), another
    host's (a shared file system) and names without a tag are not among them."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    mine, stale = f"-{_host()}-", []
    for name in sorted(names):
        match = re.match(r"(\d+)(-.*)", name[len(prefix) :]) if name.startswith(prefix) else None
        if match is None or not match.group(2).startswith(mine) or pid_alive(int(match.group(1))):
            continue
        stale.append(name)
    return stale


def tmp_name(path: str) -> str:
    """A temporary name beside `path`, ``path.tmp-PID-HOST-<random>`` (`owner_tag`)."""
    return f"{path}.tmp-{owner_tag()}-{uuid.uuid4().hex[:8]}"


def remove_stale_tmps(path: str) -> list[str]:
    """Remove the ``path.tmp-*`` files of writers of this host that are gone (killed with -9
    while writing `path`); a live writer's are kept. Returns the names removed."""
    return remove_stale_temporaries(
        os.path.dirname(os.path.abspath(path)), os.path.basename(path) + ".tmp-"
    )


def remove_stale_temporaries(directory: str | os.PathLike, prefix: str) -> list[str]:
    """Remove the `stale_temporaries` of `directory` under `prefix`; returns the names
    removed."""
    removed = []
    for name in stale_temporaries(directory, prefix):
        path = os.path.join(directory, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except OSError:  # gone already (another run cleaned it), or not ours to remove
                continue
        removed.append(name)
    return removed
