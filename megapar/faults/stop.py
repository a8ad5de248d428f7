"""What stops a run on purpose: numbers that stop being finite, stop requests.

- `NonFiniteGuard`: stops the run after N consecutive steps whose loss or gradient norm is not
  finite (fp16: N consecutive skipped steps, or an overflow at the loss-scale floor): megapar-
  train's loop, and `Engine.train_step` of the Python API (N = 1 outside fp16).
- `StopRequests` / `install_stop_handlers`: SIGTERM / SIGUSR1 (configurable), the first SIGINT,
  a wall-clock budget or a step interval ask every rank to finish its step, save and exit 0; all
  ranks agree on the step with one tiny all-reduce per step. A second SIGINT aborts at once (one
  within `SAME_INTERRUPT_S` of the first is the same interrupt delivered twice).
- `watch_sigterm`: a SIGTERM is obeyed even while the main thread is blocked in a wait that
  cannot see it (a collective, the rendezvous, a CUDA synchronisation behind a hung NCCL
  kernel), where Python runs no signal handler: see `STOP_GRACE_S`.

Signal handlers only set flags (they never run training code), so a step is never cut in half.
"""

from __future__ import annotations

import ctypes
import faulthandler
import linecache
import math
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from megapar.env_seconds import env_seconds
from megapar.faults import status as _status
from megapar.faults.blame import stopped_siblings
from megapar.wording import and_list, scale_text


class RunStopped(RuntimeError):
    """A run brought down on purpose with a clear one-line reason (no traceback needed)."""

    no_traceback = True


class NonFiniteError(RunStopped):
    """Training produced non-finite numbers for too many consecutive steps."""


# --- non-finite numbers -----------------------------------------------------------------------
class LossScaler(Protocol):
    """What the guard reads of the fp16 loss scaler (`megapar.optim.DynamicLossScaler`)."""

    min_scale: float
    hysteresis_left: int | None
    dynamic: bool


class NonFiniteGuard:
    """Counts consecutive bad steps; `observe` raises NonFiniteError when there are too many.

    Every rank sees the same loss, gradient norm and skip flag, so every rank raises together.
    """

    CLI_ADVICE = (
        "stopped without saving (the last checkpoint, if any, is intact). Lower --lr, "
        "raise --warmup-steps or {clip} --clip-grad; --max-nonfinite-steps sets the "
        "patience (0 = never stop)"
    )
    """What megapar-train's error adds after the reason ({clip}: "lower" where the run clips,
    "use" where it does not)."""

    INJECTED_ADVICE = (
        "stopped without saving (the last checkpoint, if any, is intact); the fault injected "
        "on purpose ({spec}) put it there: leave out --inject-corrupt (or MEGAPAR_INJECT_CORRUPT) "
        "to train; --max-nonfinite-steps sets the patience"
    )
    """megapar-train's, where the run injects the value itself ({spec}: the injection's; "lower
    --lr" cannot help it; a new user's finding)."""

    def __init__(
        self,
        max_steps: int,
        precision: str,
        scaler: LossScaler | None = None,
        advice: str = CLI_ADVICE.format(clip="use"),
        keywords: bool = False,
    ):
        self.max_steps, self.precision, self.scaler = max_steps, precision, scaler
        """`scaler`: the fp16 loss scaler (its floor and hysteresis), None in other modes."""
        self.keywords = keywords
        """Whether the error names the settings as `megapar.prepare`'s keywords
        (min_loss_scale) instead of megapar-train's flags (--min-loss-scale)."""
        self.advice = advice
        """What the error says after the reason (what was kept, how to go on)."""
        self.bad = 0
        self.first_bad: int | None = None

    def _name(self, setting: str) -> str:
        return setting if self.keywords else "--" + setting.replace("_", "-")

    def observe(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        skipped: bool,
        loss_scale: float,
        locate: Callable[[], str] | None = None,
    ) -> None:
        """Count step `step` (`loss_scale`: the scale it ran with; called after the scaler's
        update). In fp16 a skipped step whose loss is finite is the loss scaler's overflow,
        not a bad step: it counts only when the scale is at its floor and the overflow used up
        the hysteresis (it cannot go lower: the run stops at once), or when the scale is static
        (--loss-scale: nothing lowers it). `locate` (collective, called on every rank before
        raising): where the first non-finite value appeared, added to the error."""
        scaler = self.scaler if self.precision == "fp16" else None
        at_floor = (
            scaler is not None
            and scaler.dynamic
            and skipped
            and loss_scale <= scaler.min_scale
            and scaler.hysteresis_left == 0
        )
        if scaler is not None:
            bad = not math.isfinite(loss) or at_floor or (skipped and not scaler.dynamic)
        else:
            bad = skipped or not (math.isfinite(loss) and math.isfinite(grad_norm))
        if not bad:
            self.bad, self.first_bad = 0, None
            return
        self.bad += 1
        self.first_bad = self.first_bad or step
        if self.max_steps and (self.bad >= self.max_steps or at_floor):
            what = nonfinite_parts(loss, grad_norm)
            if at_floor and self.bad < self.max_steps:
                assert scaler is not None  # (at_floor)
                floor = self._name("min_loss_scale")
                why = (
                    f"the fp16 loss scale reached its floor {scale_text(scaler.min_scale)} "
                    f"({floor}) and "
                    f"still overflowed"
                    + (f" (lower {floor} to let it fall further)" if scaler.min_scale > 1 else "")
                )
            elif scaler is not None and not scaler.dynamic:
                why = (
                    f"{self.bad} consecutive steps ({self.first_bad}-{step}) overflowed at the "
                    f"static fp16 loss scale {scale_text(loss_scale)} "
                    f"({self._name('loss_scale')}) or had "
                    f"a non-finite loss (last: {what}; skipped): lower "
                    f"{self._name('loss_scale')}, or leave it out for the dynamic scale"
                )
            elif self.bad == 1:
                why = f"non-finite {what}"
            elif scaler is not None:
                why = (
                    f"{self.bad} consecutive steps ({self.first_bad}-{step}) had a non-finite "
                    f"loss (last: {what}; skipped in fp16)"
                )
            else:
                why = (
                    f"{self.bad} consecutive steps ({self.first_bad}-{step}) had a non-finite "
                    f"loss or gradient norm (last: {what})"
                )
            where = f"; {locate()}" if locate is not None else ""
            raise NonFiniteError(f"training diverged at step {step}: {why}{where}; {self.advice}")


def nonfinite_parts(loss: float, grad_norm: float) -> str:
    """What of a step is not finite: "loss (nan) and gradients (norm inf)", "loss (nan)", ..."""
    parts = ([f"loss ({loss})"] if not math.isfinite(loss) else []) + (
        [f"gradients (norm {grad_norm})"] if not math.isfinite(grad_norm) else []
    )
    return " and ".join(parts) or f"nothing (loss {loss}, gradient norm {grad_norm})"


def params_finite(weights) -> bool:
    """True when every tensor of `weights` (the weights a rank holds) on every rank is finite
    (collective over the world)."""
    weights = list(weights)
    bad = torch.zeros((), dtype=torch.float32)
    for p in weights:
        if not torch.isfinite(p.detach()).all():
            bad = torch.ones((), dtype=torch.float32)
            break
    dev = weights[0].device
    bad = bad.to(dev)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bool(bad.item())


# --- stop requests ----------------------------------------------------------------------------
SAME_INTERRUPT_S = 1.0
"""A SIGINT this soon after the first is the same interrupt, not a second Ctrl-C: one interrupt
often arrives twice microseconds apart. coreutils `timeout -s INT` sends it to its child and
then to its whole process group (the child again); a terminal's Ctrl-C goes to every process of
the foreground group, and torchrun forwards the one it got to its workers as well. Only a SIGINT
after this window aborts; a person pressing Ctrl-C again presses it later than that."""


class Interrupts:
    """Counts the interrupts (Ctrl-Cs) of a process: every SIGINT within `SAME_INTERRUPT_S` of
    the first is that one again."""

    def __init__(self) -> None:
        self.first: float | None = None
        """When (time.monotonic) the first SIGINT came; None: none yet."""

    def arrive(self, now: float | None = None) -> int:
        """Which interrupt a SIGINT arriving `now` (default: time.monotonic()) is: 1 the first
        (stop cleanly), 2 a second one (abort), 0 a repeat of the first (ignore it)."""
        now = time.monotonic() if now is None else now
        if self.first is None:
            self.first = now
            return 1
        return 0 if now - self.first < SAME_INTERRUPT_S else 2


_requested: dict[str, str] = {"reason": ""}
_interrupts = Interrupts()


def _on_signal(signum, frame):
    _requested["reason"] = _requested["reason"] or signal.Signals(signum).name


_acknowledge: dict[str, str | None] = {"line": None}


def _on_sigint(signum, frame):
    which = _interrupts.arrive()
    if which == 2:
        os._exit(130)
    if which == 1 and _acknowledge["line"]:  # said now: a long step ends later
        try:  # os.write: a print could land inside another write to stderr (a progress bar)
            os.write(2, (_acknowledge["line"] + "\n").encode())
        except OSError:
            pass
    _requested["reason"] = _requested["reason"] or "SIGINT"


def parse_signals(spec: str) -> list[signal.Signals]:
    """ "SIGTERM,SIGUSR1" (or "TERM,USR1", or numbers as kill -l gives them: "15,10"; or ""
    for none) -> signals; raises ValueError."""
    out = []
    for name in filter(None, (s.strip().upper() for s in spec.split(","))):
        if name.isdigit():  # a number: its name on this system, if it has one
            try:
                name = signal.Signals(int(name)).name
            except ValueError:
                raise ValueError(
                    f"--exit-signals: {name} is not a signal number here; use names, e.g. "
                    f"SIGTERM,SIGUSR1"
                ) from None
        name = name if name.startswith("SIG") else "SIG" + name
        if name in ("SIGKILL", "SIGSTOP") or not hasattr(signal, name):
            raise ValueError(
                f"--exit-signals: {name} is not a signal that can be caught; "
                f"use e.g. SIGTERM,SIGUSR1"
            )
        out.append(getattr(signal, name))
    return out


def install_stop_handlers(spec: str = "SIGTERM,SIGUSR1", acknowledge: str | None = None):
    """In a worker: the signals in `spec` (and a first SIGINT) request a clean stop; the first
    SIGINT writes the line `acknowledge` to stderr at once, where one is given (the stop comes at
    the step's end). Returns a function that puts the previous handlers back."""
    global _interrupts
    _requested.update(reason="")
    _acknowledge["line"] = acknowledge
    _interrupts = Interrupts()
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    old = {sig: signal.signal(sig, _on_signal) for sig in parse_signals(spec)}
    old[signal.SIGINT] = signal.signal(signal.SIGINT, _on_sigint)

    def restore():
        for sig, handler in old.items():
            signal.signal(sig, handler)

    return restore


# --- a SIGTERM obeyed while waiting ---------------------------------------------------------
STOP_GRACE_S = env_seconds("MEGAPAR_STOP_GRACE_S", 20.0)
"""After a SIGTERM that asks for a clean stop (`install_stop_handlers`), how long a rank may go
on (finish its step, save) before a wait it is blocked in ends it. torchrun and Slurm kill a
process 30 s after their SIGTERM; a rank that is still blocked then exits first, with its
--save lock released and its stacks written. MEGAPAR_STOP_GRACE_S overrides it."""

BLOCKED_S = 2.0
"""The main thread counts as blocked in one call (a wait) when it has run no Python for this
long: it did not run a callback queued for it (`Py_AddPendingCall`)."""

SIGTERM_EXIT_CODE = 128 + int(signal.SIGTERM)

_watch: dict = {"pid": None, "since": None}
_cleanups: dict[Callable[[], None], str] = {}


def exits_at_once(handler):
    """Mark a SIGTERM handler that ends the process (no clean stop to wait for): a rank
    blocked when it comes ends at once instead of after `STOP_GRACE_S`."""
    handler.megapar_exits = True
    return handler


@exits_at_once
def _terminate(signum, frame):
    raise SystemExit(128 + signum)


def terminate_on_sigterm(replace: bool = False) -> None:
    """In the main thread: SIGTERM raises SystemExit(143), so `finally` blocks run and
    `watch_sigterm` sees the signal, where it would have its default action (or always, with
    `replace`: a forked worker must not run its launcher's handler)."""
    if threading.current_thread() is threading.main_thread() and (
        replace or signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, _terminate)


ABORT_SIGNALS = ("SIGHUP", "SIGQUIT", "SIGUSR2")
"""Signals whose default action ends a process without a word (SIGQUIT with a core dump): where
--exit-signals does not name them, megapar-train's launcher turns them into an abort that says
so and releases --save's lock (`exit_on_signals`; a closed terminal's SIGHUP left it behind)."""


def exit_on_signals(names: tuple[str, ...], skip: tuple[str, ...] = ()) -> dict:
    """In the main thread: each signal of `names` not in `skip` whose action is the default
    raises SystemExit(128 + its number) instead, so `finally` blocks run; returns {signal: its
    previous handler} to restore. A worker forked after it takes the default back
    (`default_on_signals`)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    out = {}
    for name in names:
        sig = getattr(signal, name, None)
        if sig is not None and name not in skip and signal.getsignal(sig) is signal.SIG_DFL:
            out[sig] = signal.signal(sig, _terminate)
    return out


def exit_codes(handlers: dict) -> dict[int, str]:
    """{the exit code `exit_on_signals` makes of a signal (128 + its number): the signal's
    name} for the signals of `handlers`, what `exit_on_signals` returned."""
    return {128 + int(sig): signal.Signals(sig).name for sig in handlers}


def default_on_signals(names: tuple[str, ...]) -> None:
    """In a forked worker: the signals of `names` its launcher made exits (`exit_on_signals`)
    take their default action again."""
    for name in names:
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) is _terminate:
            signal.signal(sig, signal.SIG_DFL)


def sigterm_as_exit():
    """`terminate_on_sigterm` for a command's run (megapar-data, megapar-convert): in the main
    thread, where SIGTERM has its default action, SIGTERM raises SystemExit(143), so a run it
    stops (`timeout`, a scheduler) cleans up as an interrupted one does. Returns the handler
    to restore afterwards (None: nothing installed)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGTERM)
    terminate_on_sigterm()
    return previous


def on_forced_exit(cleanup: Callable[[], None], done: str) -> None:
    """Run `cleanup` if `watch_sigterm` ends the process; `done` says what it did ("--save lock
    released")."""
    _cleanups[cleanup] = done


def forget_forced_exit(cleanup: Callable[[], None]) -> None:
    _cleanups.pop(cleanup, None)


def watch_sigterm() -> bool:
    """Make a SIGTERM obeyed while the main thread waits (call in the main thread; once per
    process is enough).

    Python runs a signal handler only between bytecodes, so a rank blocked in a collective or
    the rendezvous would ignore torchrun's SIGTERM until its wait ends (up to --timeout-s) and be
    killed with SIGKILL, leaving its --save lock behind. Here the signal wakes a thread (the
    signal module's wakeup fd) which, once the main thread has been blocked in one call for
    `BLOCKED_S`, writes what it waited for and the rank's Python stacks as one block to stderr,
    runs the `on_forced_exit` cleanups, names (and continues, `blame.stopped_siblings`) a stopped
    torchrun rank of this node and exits with code 143: at once when the SIGTERM handler
    ends the process (`exits_at_once`: before training, the lock's), `STOP_GRACE_S` after the
    signal when it asks for a clean stop. A rank that is not blocked writes nothing here: a
    routine preemption's stop is the run's one line. Needs a Python handler for
    SIGTERM (`terminate_on_sigterm`). Returns whether the watch runs (not where another wakeup
    fd is in use, or off the main thread)."""
    if _watch["pid"] == os.getpid():
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:
        old = -2
    if old != -1:  # someone else's (an event loop): leave it theirs
        if old >= 0:
            signal.set_wakeup_fd(old)
        os.close(r)
        os.close(w)
        return False
    _watch.update(pid=os.getpid(), since=None)
    threading.Thread(
        target=_read_signals, args=(r,), name="megapar-sigterm-watch", daemon=True
    ).start()
    return True


def _after_fork_in_child() -> None:
    """A forked child has no watch thread; its inherited wakeup fd would wake its parent's."""
    if _watch["pid"] is not None:
        try:
            signal.set_wakeup_fd(-1)
        except ValueError:
            pass
    _watch.update(pid=None, since=None)
    _cleanups.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _read_signals(fd: int) -> None:
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        if int(signal.SIGTERM) in data and _watch["since"] is None:
            _watch["since"] = time.monotonic()
            threading.Thread(
                target=_end_if_blocked, name="megapar-sigterm-grace", daemon=True
            ).start()


def _end_if_blocked() -> None:
    handler = signal.getsignal(signal.SIGTERM)
    grace = 0.0 if getattr(handler, "megapar_exits", False) else STOP_GRACE_S
    time.sleep(max(0.0, _watch["since"] + grace - time.monotonic()))
    while main_thread_runs(BLOCKED_S):
        time.sleep(0.5)
    done = run_forced_exit_cleanups()
    stuck = stopped_siblings()  # torchrun's: what it may have waited for
    waited = time.monotonic() - _watch["since"]
    call, waits = _main_thread_call()
    if waits:
        _write_block(
            f"megapar: {_who()}SIGTERM {waited:.0f} s ago and still blocked at "
            f"{_status.status()} (a wait that cannot see the signal"
            + (f"; MEGAPAR_STOP_GRACE_S gives it {grace:.0f} s" if grace else "")
            + f"): exiting with code {SIGTERM_EXIT_CODE}"
            + "".join(f"; {d}" for d in [*done, stuck] if d)
            + f"; its Python stacks:\n{_stacks()}"
        )
    else:  # a long step's computation (a CPU's backward can take minutes): no stacks
        late = (
            f", so it could not stop at the step's end within the {grace:.0f} s "
            f"MEGAPAR_STOP_GRACE_S gives"
            if grace
            else ""
        )
        _write_block(
            f"megapar: {_who()}SIGTERM {waited:.0f} s ago and still computing at "
            f"{_status.status()}, inside one call that runs no Python ({call}){late}: "
            f"exiting with code {SIGTERM_EXIT_CODE}"
            + "".join(f"; {d}" for d in [*done, stuck] if d)
            + "\n"
        )
    os._exit(SIGTERM_EXIT_CODE)


WAITS = ("/torch/distributed/", "/megapar/launcher", "/threading.py", "/multiprocessing/")
"""Where a main thread's innermost Python frame is a wait (a collective, a rendezvous, a store,
a join), not a computation (`_main_thread_call`)."""

WAIT_CALLS = (
    "wait(",
    "barrier(",
    "join(",
    "recv(",
    "sleep(",
    "acquire(",
    ".get(",
    "select(",
    "synchronize(",
    ".item(",
    ".cpu(",
    ".tolist(",
    "float(",
    '"cpu"',
)
"""Calls that make the line a main thread's innermost Python frame runs a wait wherever it is:
a collective's `work.wait()` in megapar's own code, and on a GPU a synchronisation (an event's,
a host copy's) behind a hung NCCL kernel."""


def _main_thread_call() -> tuple[str, bool]:
    """("function at file:line") of the main thread's innermost Python frame, the call it is
    blocked in (a C call has no frame of its own), and whether that call is a wait (`WAITS`,
    `WAIT_CALLS`); a wait where that cannot be told."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    if frame is None:
        return "unknown", True
    path = frame.f_code.co_filename.replace(os.sep, "/")
    cut = max(path.rfind("/torch/"), path.rfind("/megapar/"))
    where = f"{frame.f_code.co_name} at {path[cut + 1 :] if cut >= 0 else os.path.basename(path)}"
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    waits = not line or any(w in path for w in WAITS) or any(c in line for c in WAIT_CALLS)
    return f"{where}:{frame.f_lineno}", waits


def run_forced_exit_cleanups() -> list[str]:
    """Run the `on_forced_exit` cleanups (the process is about to end with `os._exit`); what
    each that succeeded did."""
    done = []
    for cleanup, what in list(_cleanups.items()):
        try:
            cleanup()
            done.append(what)
        except Exception:  # noqa: BLE001, S110 - exiting anyway
            pass
    return done


def write_block(text: str) -> None:
    """`text` to stderr in one write (`_write_block`)."""
    _write_block(text)


_PENDING = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


def main_thread_runs(within_s: float) -> bool:
    """Whether the main thread runs Python within `within_s`: it runs a callback queued with
    `Py_AddPendingCall` at its next bytecode, which a thread blocked in one C call (a wait)
    never reaches. True where that cannot be asked (nothing is ended then)."""
    answered = threading.Event()

    def answer(_):
        answered.set()
        return 0

    callback = _PENDING(answer)
    _watch["callback"] = callback  # alive until the main thread has run it
    try:
        add = ctypes.pythonapi.Py_AddPendingCall
        add.argtypes, add.restype = [_PENDING, ctypes.c_void_p], ctypes.c_int
        if add(callback, None) != 0:
            return True
    except (AttributeError, OSError):
        return True
    return answered.wait(within_s)


def _who() -> str:
    """ "rank 3: " in a job's rank (torchrun's, Slurm's, the launcher's), "" in one process."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
    if rank is None and dist.is_initialized():
        rank = str(dist.get_rank())
    return f"rank {rank}: " if rank is not None else ""


def _stacks() -> str:
    """Every Python thread's stack (faulthandler's format, which needs a real file)."""
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        return f.read()


def _write_block(text: str) -> None:
    """`text` to stderr in one write, so that the ranks sharing a terminal or a log file do not
    interleave their lines."""
    data = (text.rstrip("\n") + "\n").encode(errors="replace")
    try:
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):
        pass
    while data:
        try:
            data = data[os.write(2, data) :]
        except OSError:
            return


_SIGNALS = 65
"""Signal numbers counted by `StopRequests.reason` (0-64: Linux's, real-time ones included)."""


class StopRequests:
    """Decides, the same way on every rank, whether to stop after the current step."""

    def __init__(
        self,
        exit_duration_mins: float = 0.0,
        exit_interval: int = 0,
        device: torch.device | str = "cpu",
    ):
        self.exit_duration_s = exit_duration_mins * 60.0
        self.exit_interval, self.device = exit_interval, torch.device(device)
        self.start = time.monotonic()

    def reason(self, step: int) -> str | None:
        """Why to stop after `step` (None: go on). Collective over the world: call on every rank.
        A signal every rank received is named alone; one that some ranks received is named with
        them, on every rank (one all-reduce of summed counts: the ranks past --exit-duration-mins,
        the signalled ranks' rank + 1, which name the one rank where only one was signalled,
        and the ranks signalled by each signal number)."""
        name = _requested["reason"]
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        due = bool(self.exit_duration_s) and time.monotonic() - self.start >= self.exit_duration_s
        counts = [0] * (2 + _SIGNALS)
        counts[0], counts[1] = int(due), rank + 1 if name else 0
        if name:
            counts[2 + signal.Signals[name].value] = 1
        if world > 1:
            flag = torch.tensor(counts, dtype=torch.int64, device=self.device)
            dist.all_reduce(flag)
            counts = [int(v) for v in flag.tolist()]
        due_ranks, ranks, by_signal = counts[0], counts[1], counts[2:]
        signalled = sum(by_signal)
        if signalled:
            got = [signal.Signals(n).name for n, k in enumerate(by_signal) if k]
            name = and_list(got)
            if signalled == 1 and world > 1:
                who = f"{name} on rank {ranks - 1}"
            elif signalled < world:
                who = f"{name} on {signalled} of {world} ranks"
            elif got == ["SIGINT"]:
                return f"interrupted at step {step}, saving"
            else:
                who = name
            return f"{who} received: stopping at step {step}"
        if due_ranks:
            return f"--exit-duration-mins {self.exit_duration_s / 60:g} reached at step {step}"
        if self.exit_interval and step % self.exit_interval == 0:
            return f"--exit-interval {self.exit_interval} reached at step {step}"
        return None
