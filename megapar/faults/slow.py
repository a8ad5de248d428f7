"""A testing tool: one rank made slower by a set time per step (`--inject-slow`).

`SlowRank.parse("rank=1,ms=300,from_step=5")` reads the flag; `Slowdown` makes the named global
rank's stage spend that much longer in its forward computations from that step on, as a slow
GPU would: the time is split over the step's forward calls of the stage's model chunks (a
forward pre-hook), so the ranks that need its results (the other stages, its tp / cp group,
the other dp ranks at the gradient reduction) wait for it. On the CPU the hook keeps the CPU
busy for that much of its own time (a slower CPU device; on a shared host the wall time is
longer); on CUDA it queues a kernel that spins for that long (`torch.cuda._sleep`, its cycles
per millisecond measured once), so the GPU, not the host, is what is slow. Evaluation forwards (the
model in eval mode) are not slowed.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

_EXAMPLE = "e.g. --inject-slow rank=1,ms=300 or rank=1,ms=300,from_step=5"
_KEYS = ("rank", "ms", "from_step")


@dataclass(frozen=True)
class SlowRank:
    """Which rank is slowed, by how much, from which step."""

    rank: int
    """The global rank slowed."""
    ms: float
    """Milliseconds added to each of its training steps."""
    from_step: int = 1
    """The first step slowed (steps count from 1)."""

    @classmethod
    def parse(cls, spec: str) -> SlowRank:
        """The `--inject-slow` value `rank=R,ms=T[,from_step=S]`; ValueError (one line naming
        the problem and the fix) when it is not one."""
        flag = f"--inject-slow {spec!r}"
        values: dict[str, str] = {}
        for item in spec.split(","):
            key, sep, value = (part.strip() for part in item.partition("="))
            if not sep or not key or not value:
                raise ValueError(
                    f"{flag}: {item.strip()!r} is not KEY=VALUE; give "
                    f"rank=R,ms=T[,from_step=S] ({_EXAMPLE})"
                )
            if key not in _KEYS:
                raise ValueError(
                    f"{flag}: unknown key {key!r}; the keys are {', '.join(_KEYS)} ({_EXAMPLE})"
                )
            if key in values:
                raise ValueError(f"{flag}: {key} is given twice; give it once ({_EXAMPLE})")
            values[key] = value
        missing = [k for k in ("rank", "ms") if k not in values]
        if missing:
            raise ValueError(
                f"{flag}: {' and '.join(missing)} missing; give the rank to slow "
                f"and the milliseconds per step ({_EXAMPLE})"
            )

        def number(key: str, whole: bool, low: float) -> float:
            try:
                value = float(values[key])
            except ValueError:
                value = math.nan
            if (
                not math.isfinite(value)
                or (whole and not value.is_integer())
                or value < low
                or (key == "ms" and value == 0)
            ):
                what = {
                    "rank": "a global rank (a whole number >= 0)",
                    "ms": "milliseconds per step (a finite number > 0)",
                    "from_step": "the first step slowed (a whole number >= 1)",
                }[key]
                raise ValueError(
                    f"{flag}: {key}={values[key]} is invalid: give {what} ({_EXAMPLE})"
                )
            return value

        return cls(
            int(number("rank", True, 0)),
            number("ms", False, 0),
            int(number("from_step", True, 1)) if "from_step" in values else 1,
        )

    def check_world(self, world_size: int) -> None:
        """ValueError when the rank is not one of the run's `world_size` ranks."""
        if self.rank >= world_size:
            raise ValueError(
                f"--inject-slow rank={self.rank} is not a rank of this run of "
                f"{world_size} rank{'s' if world_size > 1 else ''} (0-"
                f"{world_size - 1}); give a global rank below {world_size}"
            )


class Slowdown:
    """Slows the forward calls of `modules` (a stage's model chunks) so that a step with
    `begin_step(step, forwards)` takes `spec.ms` longer from `spec.from_step` on."""

    def __init__(self, spec: SlowRank, modules, device: torch.device):
        self.spec, self.device = spec, torch.device(device)
        self._each_s = 0.0  # seconds per forward call in the current step
        self._cycles_per_ms: float | None = None
        self._handles = [m.register_forward_pre_hook(self._hook) for m in modules]

    def begin_step(self, step: int, forwards: int) -> None:
        """Step `step` (from 1) runs `forwards` forward calls of the chunks."""
        slowed = step >= self.spec.from_step
        self._each_s = self.spec.ms / 1e3 / max(forwards, 1) if slowed else 0.0

    def _hook(self, module, args) -> None:
        if self._each_s > 0 and module.training:
            self.delay(self._each_s)

    def delay(self, seconds: float) -> None:
        """Make this rank's device `seconds` slower (the host on the CPU, the GPU on CUDA)."""
        if self.device.type != "cuda":  # the CPU is the device: keep it busy
            end = time.thread_time() + seconds
            while time.thread_time() < end:
                pass
            return
        if self._cycles_per_ms is None:  # once: how many spin cycles make a millisecond
            began, ended = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            began.record()
            torch.cuda._sleep(10_000_000)
            ended.record()
            ended.synchronize()
            self._cycles_per_ms = 10_000_000 / max(began.elapsed_time(ended), 1e-3)
        torch.cuda._sleep(int(seconds * 1e3 * self._cycles_per_ms))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
