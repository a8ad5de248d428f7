"""Learning-rate schedule: linear warmup, then cosine / linear / constant decay to min_lr."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megapar.wording import counted

DECAY_STYLES = ("cosine", "linear", "constant")


@dataclass
class LRScheduler:
    """lr(step) for optimizer step `step` (0-based). Stateless: the step index is the state."""

    max_lr: float
    """Peak learning rate, reached at the end of warmup."""
    min_lr: float
    """Learning rate at and after max_steps."""
    warmup_steps: int
    """Steps of linear warmup: step s < warmup_steps uses max_lr * (s + 1) / warmup_steps."""
    max_steps: int
    """Step at which the decay reaches min_lr (and stays there)."""
    decay: str = "cosine"
    """Decay after warmup: "cosine", "linear" or "constant" (stays at max_lr)."""

    def __post_init__(self):
        if self.decay not in DECAY_STYLES:
            raise ValueError(f"unknown lr decay {self.decay!r}; expected one of {DECAY_STYLES}")
        if self.max_lr < 0 or self.min_lr < 0:
            raise ValueError(
                f"learning rates must be >= 0, got max_lr={self.max_lr} min_lr={self.min_lr}"
            )
        if self.min_lr > self.max_lr:
            raise ValueError(
                f"min_lr {self.min_lr} is larger than max_lr {self.max_lr}; "
                f"lower --min-lr or raise --lr"
            )
        if self.warmup_steps < 0 or self.max_steps < 1:
            raise ValueError(
                f"need warmup_steps >= 0 and max_steps >= 1, got "
                f"warmup_steps={self.warmup_steps} max_steps={self.max_steps}"
            )
        if self.warmup_steps > self.max_steps:
            raise ValueError(
                f"warmup of {counted(self.warmup_steps, 'step')} is longer than the "
                f"{counted(self.max_steps, 'training step')}; lower --warmup-steps"
            )

    def lr(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.max_lr * (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return self.max_lr
        span = self.max_steps - self.warmup_steps
        progress = 1.0 if span == 0 else min(1.0, (step - self.warmup_steps) / span)
        if self.decay == "linear":
            factor = 1.0 - progress
        else:
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.max_lr - self.min_lr) * factor

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, d: dict) -> None:
        restored = LRScheduler(**d)  # validates
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(restored, f.name))
