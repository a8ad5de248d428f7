"""Learning-rate schedule: linear warmup, then cosine / linear / constant decay to min_lr, or
warmup-stable-decay (WSD: max_lr until a final decay to min_lr)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import InitVar, dataclass

from megapar.wording import counted

DECAY_STYLES = ("cosine", "linear", "constant", "wsd")
WSD_STYLES = ("linear", "cosine", "sqrt", "exponential")
"""Shapes of WSD's final decay, as a factor of progress p in [0, 1] (1 at its start, 0 at its
end): linear 1 - p, cosine (1 + cos(pi p)) / 2, sqrt 1 - sqrt(p) (Megatron-LM's minus_sqrt,
transformers' 1-sqrt) and exponential 2 x 0.5^p - 1 (Megatron-LM's)."""


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
    """Step at which the decay reaches min_lr (and stays there): --lr-decay-steps, else
    --max-steps."""
    decay: str = "cosine"
    """Decay after warmup: "cosine", "linear", "constant" (stays at max_lr) or "wsd" (stays at
    max_lr until the last `decay_steps` before max_steps, which decay by `wsd_style`)."""
    decay_steps: int = 0
    """With decay "wsd": steps of the final decay, which ends at max_steps (unused otherwise)."""
    wsd_style: str = "linear"
    """With decay "wsd": the final decay's shape, one of `WSD_STYLES`."""
    ends_at: InitVar[str] = ""
    """The flag that set max_steps where it is not --max-steps ("--lr-decay-steps"), for the
    errors' wording; not a field (not in `state_dict`)."""

    def __post_init__(self, ends_at: str = ""):
        end = f"{ends_at} {self.max_steps}" if ends_at else ""
        span = end or f"the {counted(self.max_steps, 'training step')}"
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
                f"warmup of {counted(self.warmup_steps, 'step')} is longer than {span}; "
                f"lower --warmup-steps" + (f" or raise {ends_at}" if ends_at else "")
            )
        if self.decay != "wsd":
            return
        if self.wsd_style not in WSD_STYLES:
            raise ValueError(
                f"unknown WSD decay style {self.wsd_style!r}; expected one of {WSD_STYLES}"
            )
        if self.decay_steps < 1:
            raise ValueError(
                f"WSD needs a final decay of at least 1 step, got {self.decay_steps}; "
                f"give --lr-wsd-decay-steps N or --lr-wsd-decay-fraction F"
            )
        if self.warmup_steps + self.decay_steps > self.max_steps:
            raise ValueError(
                f"warmup of {counted(self.warmup_steps, 'step')} and WSD decay of "
                f"{counted(self.decay_steps, 'step')} are longer than {span}; lower "
                f"--warmup-steps or --lr-wsd-decay-steps / --lr-wsd-decay-fraction, or raise "
                f"{ends_at or '--max-steps'}"
            )

    def lr(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.max_lr * (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return self.max_lr
        start = self.max_steps - self.decay_steps if self.decay == "wsd" else self.warmup_steps
        if step < start:  # WSD's stable phase
            return self.max_lr
        span = self.max_steps - start
        progress = 1.0 if span == 0 else min(1.0, (step - start) / span)
        shape = self.wsd_style if self.decay == "wsd" else self.decay
        if shape == "linear":
            factor = 1.0 - progress
        elif shape == "sqrt":
            factor = 1.0 - math.sqrt(progress)
        elif shape == "exponential":
            factor = 2.0 * 0.5**progress - 1.0
        else:
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.max_lr - self.min_lr) * factor

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, d: dict) -> None:
        """Take a saved schedule; a field this megapar does not know (a newer one's) is named
        in a ValueError, not a TypeError of the constructor."""
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(LRScheduler)})
        if unknown:
            raise ValueError(
                f"the saved learning-rate schedule has {', '.join(unknown)}, which this megapar "
                f"does not know: it was written by a newer megapar; resume with that version"
            )
        restored = LRScheduler(**d)  # validates
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(restored, f.name))


def flags_schedule(cfg, lr: float, min_lr: float) -> LRScheduler:
    """The `LRScheduler` a TrainConfig's schedule flags describe, peaking at `lr` and ending at
    `min_lr`: the decay ends at --lr-decay-steps (else --max-steps); under --lr-decay wsd its
    final decay is --lr-wsd-decay-steps long (else --lr-wsd-decay-fraction of where it ends,
    rounded, at least 1) and shaped by --lr-wsd-decay-style."""
    end = cfg.lr_decay_steps or cfg.max_steps
    wsd = {}
    if cfg.lr_decay == "wsd":
        steps = cfg.lr_wsd_decay_steps or max(1, round(cfg.lr_wsd_decay_fraction * end))
        wsd = {"decay_steps": steps, "wsd_style": cfg.lr_wsd_decay_style}
    ends_at = "--lr-decay-steps" if cfg.lr_decay_steps else ""
    return LRScheduler(lr, min_lr, cfg.warmup_steps, end, cfg.lr_decay, **wsd, ends_at=ends_at)


def changed_fields(saved: dict, planned: dict) -> str:
    """The schedule fields (`LRScheduler.state_dict`) a resume changes, for the resume note:
    "max_steps 8 -> 12, ..."; WSD's decay_steps and wsd_style only where the planned decay is
    "wsd" (unused otherwise: a run leaving WSD would list "decay_steps 3 -> 0")."""
    unused = () if planned.get("decay") == "wsd" else ("decay_steps", "wsd_style")
    return ", ".join(
        f"{k} {saved.get(k)} -> {v}"
        for k, v in planned.items()
        if saved.get(k) != v and k not in unused
    )


def resume_change(
    saved: LRScheduler, planned: LRScheduler, step: int, position: int | None = None
) -> str:
    """What a resume at `step` (steps done) and schedule position `position` (the steps
    applied: `step` less the skipped ones; default `step`) under `planned` instead of the
    checkpoint's `saved` schedule does to the learning rate, for the resume note: "" where the
    next step's lr is the same, else that lr beside the saved schedule's, and where the
    checkpoint had already decayed in WSD (its stable phase cannot be extended from it), which
    checkpoint would."""
    at = step if position is None else position
    ours, theirs = planned.lr(at), saved.lr(at)
    if math.isclose(ours, theirs, rel_tol=1e-9, abs_tol=0.0):
        return ""
    said = f"; step {step + 1} trains at lr {ours:.4g}, not the checkpoint schedule's {theirs:.4g}"
    start = saved.max_steps - saved.decay_steps  # WSD: the last position at max_lr, 0-based
    if saved.decay == "wsd" and at - 1 > start and ours > saved.lr(at - 1):
        # the step of that position where the skipped steps came before it
        said += (
            f" (its WSD decay began at step {start + 2 + step - at}: to extend the stable "
            f"phase, --load a checkpoint saved before it)"
        )
    return said


OTHER_DECAY_NAMES = {
    "wsd": "--lr-decay wsd",
    "warmupstabledecay": "--lr-decay wsd",
    "cosinewithminlr": "--lr-decay cosine (with --min-lr)",
    "constantwithwarmup": "--lr-decay constant",
    "minussqrt": "--lr-wsd-decay-style sqrt",
    "1sqrt": "--lr-wsd-decay-style sqrt",
}
"""Megatron-LM's, transformers' and torchtitan's names for a decay megapar calls otherwise,
keyed by the name's lower-case letters and digits."""


def decay_named_elsewhere(value: str) -> str:
    """For a --lr-decay / --lr-wsd-decay-style value megapar does not take but another tool
    names (Megatron-LM's `WSD`, `minus_sqrt`; transformers' `1-sqrt`, `warmup_stable_decay`),
    what megapar calls it; "" for a name it does not know."""
    ours = OTHER_DECAY_NAMES.get("".join(ch for ch in str(value).lower() if ch.isalnum()))
    return f"{value!r} is megapar's {ours}" if ours else ""
