"""What stops a run on purpose: numbers that stop being finite, stop requests.

- `NonFiniteGuard`: stops the run after N consecutive steps whose loss or gradient norm is not
  finite (fp16: N consecutive skipped steps, or an overflow at the loss-scale floor): megapar-
  train's loop, and `Engine.train_step` of the Python API (N = 1 outside fp16).
- `StopRequests` / `install_stop_handlers`: SIGTERM / SIGUSR1 (configurable), the first SIGINT,
  a wall-clock budget or a step interval ask every rank to finish its step, save and exit 0; all
  ranks agree on the step with one tiny all-reduce per step. A second SIGINT aborts at once.

Signal handlers only set flags (they never run training code), so a step is never cut in half.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import torch
import torch.distributed as dist


class RunStopped(RuntimeError):
    """A run brought down on purpose with a clear one-line reason (no traceback needed)."""

    no_traceback = True


class NonFiniteError(RunStopped):
    """Training produced non-finite numbers for too many consecutive steps."""


# --- non-finite numbers -----------------------------------------------------------------------
class NonFiniteGuard:
    """Counts consecutive bad steps; `observe` raises NonFiniteError when there are too many.

    Every rank sees the same loss, gradient norm and skip flag, so every rank raises together.
    """

    CLI_ADVICE = ("stopped without saving (the last checkpoint, if any, is intact). Lower --lr, "
                  "raise --warmup-steps or use --clip-grad; --max-nonfinite-steps sets the "
                  "patience (0 = never stop)")
    """What megapar-train's error adds after the reason."""

    def __init__(self, max_steps: int, precision: str, min_scale: float | None = None,
                 advice: str = CLI_ADVICE):
        self.max_steps, self.precision, self.min_scale = max_steps, precision, min_scale
        self.advice = advice
        """What the error says after the reason (what was kept, how to go on)."""
        self.bad, self.first_bad = 0, None

    def observe(self, step: int, loss: float, grad_norm: float, skipped: bool,
                loss_scale: float) -> None:
        if self.precision == "fp16":
            bad = skipped or not math.isfinite(loss)
        else:
            bad = skipped or not (math.isfinite(loss) and math.isfinite(grad_norm))
        if not bad:
            self.bad, self.first_bad = 0, None
            return
        self.bad += 1
        self.first_bad = self.first_bad or step
        at_floor = (self.precision == "fp16" and self.min_scale is not None
                    and skipped and loss_scale <= self.min_scale)
        if self.max_steps and (self.bad >= self.max_steps or at_floor):
            what = nonfinite_parts(loss, grad_norm)
            if at_floor and self.bad < self.max_steps:
                why = f"the fp16 loss scale reached its floor {loss_scale:g} and still overflowed"
            elif self.precision == "fp16":
                why = (f"{self.bad} consecutive steps ({self.first_bad}-{step}) had a non-finite "
                       f"gradient (skipped in fp16)")
            elif self.bad == 1:
                why = f"non-finite {what}"
            else:
                why = (f"{self.bad} consecutive steps ({self.first_bad}-{step}) had a non-finite "
                       f"loss or gradient norm (last: {what})")
            raise NonFiniteError(f"training diverged at step {step}: {why}; {self.advice}")


def nonfinite_parts(loss: float, grad_norm: float) -> str:
    """What of a step is not finite: "loss (nan) and gradients (norm inf)", "loss (nan)", ..."""
    parts = ([f"loss ({loss})"] if not math.isfinite(loss) else []) + \
        ([f"gradients (norm {grad_norm})"] if not math.isfinite(grad_norm) else [])
    return " and ".join(parts) or f"nothing (loss {loss}, gradient norm {grad_norm})"


def params_finite(model, group=None) -> bool:
    """True when every parameter of every rank is finite (collective over `group`, default world)."""
    bad = torch.zeros((), dtype=torch.float32)
    for p in model.parameters():
        if not torch.isfinite(p.detach()).all():
            bad = torch.ones((), dtype=torch.float32)
            break
    dev = next(model.parameters()).device
    bad = bad.to(dev)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    return not bool(bad.item())


# --- stop requests ----------------------------------------------------------------------------
_requested: dict[str, str | int] = {"reason": "", "sigint": 0}


def _on_signal(signum, frame):
    _requested["reason"] = _requested["reason"] or signal.Signals(signum).name


def _on_sigint(signum, frame):
    _requested["sigint"] += 1
    if _requested["sigint"] > 1:
        os._exit(130)
    _requested["reason"] = _requested["reason"] or "SIGINT"


def parse_signals(spec: str) -> list[signal.Signals]:
    """"SIGTERM,SIGUSR1" (or "TERM,USR1", or "" for none) -> signals; raises ValueError."""
    out = []
    for name in filter(None, (s.strip().upper() for s in spec.split(","))):
        name = name if name.startswith("SIG") else "SIG" + name
        if name in ("SIGKILL", "SIGSTOP") or not hasattr(signal, name):
            raise ValueError(f"--exit-signals: {name} is not a signal that can be caught; "
                             f"use e.g. SIGTERM,SIGUSR1")
        out.append(getattr(signal, name))
    return out


def install_stop_handlers(spec: str = "SIGTERM,SIGUSR1"):
    """In a worker: the signals in `spec` (and a first SIGINT) request a clean stop.
    Returns a function that puts the previous handlers back."""
    _requested.update(reason="", sigint=0)
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    old = {sig: signal.signal(sig, _on_signal) for sig in parse_signals(spec)}
    old[signal.SIGINT] = signal.signal(signal.SIGINT, _on_sigint)

    def restore():
        for sig, handler in old.items():
            signal.signal(sig, handler)

    return restore


class StopRequests:
    """Decides, the same way on every rank, whether to stop after the current step."""

    def __init__(self, exit_duration_mins: float = 0.0, exit_interval: int = 0,
                 device: torch.device | str = "cpu"):
        self.exit_duration_s = exit_duration_mins * 60.0
        self.exit_interval, self.device = exit_interval, torch.device(device)
        self.start = time.monotonic()

    def reason(self, step: int) -> str | None:
        """Why to stop after `step` (None: go on). Collective over the world: call on every rank."""
        code = 0.0
        if _requested["reason"]:
            code = 2.0
        elif self.exit_duration_s and time.monotonic() - self.start >= self.exit_duration_s:
            code = 1.0
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([code], dtype=torch.float32, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            code = float(flag.item())
        if code == 2.0:
            who = _requested["reason"] or "a signal on another rank"
            if who == "SIGINT":
                return f"interrupted at step {step}, saving"
            return f"{who} received: stopping at step {step}"
        if code == 1.0:
            return f"--exit-duration-mins {self.exit_duration_s / 60:g} reached at step {step}"
        if self.exit_interval and step % self.exit_interval == 0:
            return f"--exit-interval {self.exit_interval} reached at step {step}"
        return None
