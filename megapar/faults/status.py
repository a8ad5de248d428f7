"""Hang diagnosis: what each rank is doing, and every rank's Python stack when a run fails.

Each rank records its current step and action (`set_step`, `set_action`: the pipeline action
with its micro-batch and peer, or the collective it is in) in a small buffer shared with the
launcher. When one rank fails (typically a collective / point-to-point timeout, whose message
names the rank it waited for), the launcher (`megapar.launcher.run_local`) sends every other
rank SIGUSR2 (SIGUSR1 and SIGTERM are clean-stop signals of megapar-train), which makes Python's
`faulthandler` write that rank's stack of every thread to its stack file *immediately*, even while
it is blocked in C++ (a gloo wait); the launcher then appends "rank R: step S, <action>" and the
stack of every rank to the error it raises.

Under torchrun / Slurm (no launcher of ours) a rank that torchrun's SIGTERM (sent to the
surviving ranks when one fails, or for a preemption) finds blocked in one wait writes its stacks
as one block on stderr (or torchrun --log-dir), so that the ranks sharing a terminal do not
interleave; a rank that is running writes none (`megapar.faults.stop.watch_sigterm`).
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys
import time

_LINE = object()  # the action: the one in the shared line after the prefix (`action_line`)
_ENCODED_MAX = 65536
_stack_file = None  # this process's file faulthandler writes to (`install`), kept open for it

DUMP_SIGNAL = getattr(signal, "SIGUSR2", None)
"""The signal that makes a rank write its Python stacks (faulthandler)."""


class RankStatus:
    """One run's record of what this rank is doing: its step and action, published (when the
    launcher shares a line with the rank, `shared`: its multiprocessing char array) for the
    launcher to read. A run starts its own (`begin`), so that one run never shows another's
    step or action: two runs in one process (a test runner's, a notebook's), or a rank forked
    from a process that ran one."""

    def __init__(self, shared=None) -> None:
        self.step: int | None = None
        self.action: object = "starting"
        self.shared = shared
        self.prefix = b""  # "step S, " encoded (set_step)
        self.encoded: dict[str, bytes] = {}  # action texts encoded, NUL-terminated
        self.view_of = None  # the array `view` is a byte view of (set_action checks it)
        self.view = memoryview(b"")  # `shared` as bytes once published, from `at` on
        self.at = 0  # where the action starts: after the prefix
        self.room = 0  # bytes from `at` to the end of the array (the action and its NUL)
        self.publish()

    def set_step(self, step: int | None) -> None:
        self.action = self.action_text()
        self.step = step
        self.prefix = b"" if step is None else f"step {step}, ".encode()
        self.publish()

    def set_action(self, action: str) -> None:
        self.action = action
        if self.shared is not None:
            data = self.encoded.get(action)
            if data is not None and self.view_of is self.shared and len(data) <= self.room:
                self.view[self.at : self.at + len(data)] = data  # the prefix stays
            else:
                self.publish()

    def action_line(self, longest: int):
        if self.shared is None:
            return None
        if self.view_of is not self.shared:
            self.publish()
        if longest > self.room:
            return None
        self.action = _LINE
        return (ctypes.c_char * self.room).from_buffer(self.shared, self.at)

    def status(self) -> str:
        return (f"step {self.step}, " if self.step is not None else "") + self.action_text()

    def action_text(self) -> str:
        """The current action's text (read from the shared line while `action_line` writes
        it)."""
        if self.action is _LINE:
            return bytes(self.view[self.at :]).split(b"\0", 1)[0].decode(errors="replace")
        return str(self.action)

    def publish(self) -> None:
        """`status()` into the shared line, NUL-terminated (truncated to fit). Every pipeline
        action sets one, so an action's encoding is kept and `set_action` then writes only the
        action's bytes after the prefix, through a byte view of the array (no ctypes call)."""
        shared = self.shared
        if shared is None:
            return
        action = self.action = self.action_text()
        data = self.encoded.get(action) if isinstance(action, str) else None
        if data is None:
            data = str(action).encode() + b"\0"
            if isinstance(action, str) and len(self.encoded) < _ENCODED_MAX:
                self.encoded[action] = data
        shared.value = (self.prefix + data[:-1])[: len(shared) - 1]  # NUL-terminated by ctypes
        if self.view_of is not shared:
            self.view, self.view_of = memoryview(shared).cast("B"), shared
        self.at, self.room = len(self.prefix), len(shared) - len(self.prefix)


_run = RankStatus()
"""The record of the run this process is in now (`begin`): what `set_step`, `set_action` and
`status` of code deep inside the run (the pipeline, the collectives) and its signal and watch
threads reach."""


def begin(shared=None) -> RankStatus:
    """Start this process's record of a new run (`shared`: the launcher's line) and return it:
    called where a run starts (the launcher's worker, torchrun's rank, a one-process run)."""
    global _run
    _run = RankStatus(shared)
    return _run


def current() -> RankStatus:
    """The record of the run this process is in now."""
    return _run


def use(record: RankStatus) -> RankStatus:
    """Make `record` this process's current one; returns the one it was (to put it back)."""
    global _run
    previous, _run = _run, record
    return previous


def install(rank: int, shared=None, stack_path: str | None = None) -> None:
    """Start this rank's record of a new run (`begin`) and register the stack dump for this
    process. `shared`: the launcher's status buffer; `stack_path`: file faulthandler writes to
    (default stderr)."""
    global _stack_file
    out = sys.stderr
    if stack_path:
        _stack_file = out = open(stack_path, "w")  # noqa: SIM115 - must outlive this call
    try:
        if DUMP_SIGNAL is not None:
            faulthandler.register(DUMP_SIGNAL, file=out, all_threads=True)
    except (AttributeError, ValueError, OSError):  # no SIGUSR2 (Windows) or no real fd
        pass
    begin(shared)


def set_step(step: int | None) -> None:
    """The 1-based optimizer step this rank is running (None: none yet, e.g. a new engine)."""
    _run.set_step(step)


def set_action(action: str) -> None:
    """What this rank is doing now, e.g. "recv_grad of micro-batch 3 from rank 5"."""
    _run.set_action(action)


def encode_action(action: str) -> bytes:
    """`action` as `action_line`'s line takes it (its bytes, NUL-terminated)."""
    return action.encode() + b"\0"


def action_line(longest: int):
    """For a loop that publishes many actions it encoded beforehand (`encode_action`; the
    pipeline executor's walk): the shared line where the action starts, as a ctypes char array
    over it, so that ``line.value = data`` publishes one with no call (a copy and the NUL,
    about half what a slice assignment to a memoryview costs); None when no launcher's line is
    shared or an action of `longest` bytes would not fit after the prefix (call `set_action`
    then). The line is good until the next `set_step` (which moves where the action starts);
    until the next `set_action`, `status()` reads the action from the line."""
    return _run.action_line(longest)


def status() -> str:
    """This rank's "step S, action" in the current run."""
    return _run.status()


def diagnose(procs, statuses, stacks: str, settle_s: float = 0.5) -> str:
    """Every rank's status and (for ranks still running) Python stack, dumped on DUMP_SIGNAL."""
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in alive:
        try:
            if DUMP_SIGNAL is not None:
                os.kill(procs[r].pid, DUMP_SIGNAL)
        except (OSError, AttributeError, TypeError):
            pass
    time.sleep(settle_s if alive else 0.0)  # faulthandler writes at once; let the files settle
    lines = ["what every rank was doing when the run failed (status; stack of running ranks):"]
    for r, _p in enumerate(procs):
        state = statuses[r].value.decode(errors="replace") or "not started"
        lines.append(f"--- rank {r}: {state}" + ("" if r in alive else " [exited]"))
        path = os.path.join(stacks, f"rank{r}.txt")
        if r in alive and os.path.exists(path):
            with open(path) as f:
                lines.append(f.read().rstrip())
    return "\n".join(lines)
