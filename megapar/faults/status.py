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

_state: dict[str, object] = {"step": None, "action": "starting"}
_shared: ctypes.Array[ctypes.c_char] | None = None  # the launcher's multiprocessing char array
_prefix = b""  # "step S, " encoded (set_step)
_encoded: dict[str, bytes] = {}  # action texts encoded, NUL-terminated: the pipeline's repeat
_ENCODED_MAX = 65536
_view_of = None  # the array `_view` is a byte view of (set_action checks it is `_shared`)
_view = memoryview(b"")  # `_shared` as bytes once published, written from `_at` on by set_action
_at = 0  # where the action starts: after the prefix
_room = 0  # bytes from `_at` to the end of the array (the action's text and its NUL)
_stack_file = None  # kept open for faulthandler
_LINE = object()  # the action: the one in the shared line after the prefix (`action_line`)

DUMP_SIGNAL = getattr(signal, "SIGUSR2", None)
"""The signal that makes a rank write its Python stacks (faulthandler)."""


def install(rank: int, shared=None, stack_path: str | None = None) -> None:
    """Register the stack dump for this process (rank). `shared`: the launcher's status buffer;
    `stack_path`: file faulthandler writes to (default stderr)."""
    global _shared, _stack_file
    _shared = shared
    out = sys.stderr
    if stack_path:
        _stack_file = out = open(stack_path, "w")  # noqa: SIM115 - must outlive this call
    try:
        if DUMP_SIGNAL is not None:
            faulthandler.register(DUMP_SIGNAL, file=out, all_threads=True)
    except (AttributeError, ValueError, OSError):  # no SIGUSR2 (Windows) or no real fd
        pass
    _publish()


def set_step(step: int | None) -> None:
    """The 1-based optimizer step this rank is running (None: none yet, e.g. a new engine)."""
    global _prefix
    _state["action"] = _action()
    _state["step"] = step
    _prefix = b"" if step is None else f"step {step}, ".encode()
    _publish()


def set_action(action: str) -> None:
    """What this rank is doing now, e.g. "recv_grad of micro-batch 3 from rank 5"."""
    _state["action"] = action
    if _shared is not None:
        data = _encoded.get(action)
        if data is not None and _view_of is _shared and len(data) <= _room:
            _view[_at : _at + len(data)] = data  # the prefix stays: only the action is written
        else:
            _publish()


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
    if _shared is None:
        return None
    if _view_of is not _shared:
        _publish()
    if longest > _room:
        return None
    _state["action"] = _LINE
    return (ctypes.c_char * _room).from_buffer(_shared, _at)


def status() -> str:
    step = _state["step"]
    return (f"step {step}, " if step is not None else "") + _action()


def _action() -> str:
    """The current action's text (read from the shared line while `action_line` writes it)."""
    action = _state["action"]
    if action is _LINE:
        return bytes(_view[_at:]).split(b"\0", 1)[0].decode(errors="replace")
    return str(action)


def _publish() -> None:
    """`status()` into the shared buffer, NUL-terminated (truncated to fit). Every pipeline
    action sets one, so an action's encoding is kept and `set_action` then writes only the
    action's bytes after the prefix, through a byte view of the array (no ctypes call)."""
    global _view_of, _view, _at, _room
    if _shared is not None:
        action = _state["action"] = _action()
        data = _encoded.get(action) if isinstance(action, str) else None
        if data is None:
            data = str(action).encode() + b"\0"
            if isinstance(action, str) and len(_encoded) < _ENCODED_MAX:
                _encoded[action] = data
        _shared.value = (_prefix + data[:-1])[: len(_shared) - 1]  # NUL-terminated by ctypes
        if _view_of is not _shared:
            _view, _view_of = memoryview(_shared).cast("B"), _shared
        _at, _room = len(_prefix), len(_shared) - len(_prefix)


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
