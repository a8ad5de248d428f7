"""Mixed precision: autocast for the forward, fp32 master weights, fp16 loss scaling.

Parameters, gradients and optimizer state stay fp32 in every mode; `autocast()` runs matmuls in
bf16 / fp16. In fp16 the loss is multiplied by a scale before backward (the executor takes it
as `loss_scale`; dynamic, or static under --loss-scale), divided by the dp ranks whose average
the gradients become (`backward_scale`); after backward `unscale_and_check` divides the
gradients by that and finds infs / NaNs. The found-inf flag is all-reduced with MAX
over the whole world, so every rank (every tp, pp and dp coordinate) skips the same step and
changes its scale the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

COMM_DTYPES = ["auto", "fp32", "bf16", "fp16"]
"""Choices of --p2p-dtype and --grad-reduce-dtype ("auto": Megatron's default for the mode)."""


def comm_dtypes(
    mode: str, p2p: str = "auto", grad_reduce: str = "auto"
) -> tuple[torch.dtype, torch.dtype]:
    """(pipeline message dtype, data-parallel gradient reduction dtype) for precision `mode`.

    "auto" follows Megatron-LM: pipeline messages travel in the compute dtype (its
    `pipeline_dtype` is the parameters' dtype: bf16 / fp16 under mixed precision); gradients
    are reduced in fp32 under bf16 ("bfloat16 requires gradient accumulation and all-reduce to
    be done in fp32") and in fp16 under fp16 (loss-scaled). Only the wire changes: received
    activations / gradients are cast back, and gradients are accumulated and stepped in fp32.
    """
    for name, value in (("--p2p-dtype", p2p), ("--grad-reduce-dtype", grad_reduce)):
        if value not in COMM_DTYPES:
            raise ValueError(f"{name} {value!r} is invalid: choose one of {', '.join(COMM_DTYPES)}")
    wire = PRECISIONS[mode] if p2p == "auto" else PRECISIONS[p2p]
    if grad_reduce == "auto":
        reduce = torch.float16 if mode == "fp16" else torch.float32
    else:
        reduce = PRECISIONS[grad_reduce]
    return wire, reduce


@dataclass
class DynamicLossScaler:
    """Loss scale that is lowered after overflows and doubled after a run of clean steps:
    Megatron-LM's DynamicGradScaler (and DeepSpeed's dynamic scaler without
    consecutive_hysteresis). At hysteresis 1 (the default) every overflow lowers the scale, as
    torch.amp.GradScaler does; at hysteresis H the first H - 1 overflows since the last growth
    (or the start) only skip their step, and every one after them lowers the scale."""

    init_scale: float = 2.0**16
    """Starting loss scale."""
    growth_factor: float = 2.0
    """Multiplier after `growth_interval` consecutive steps without inf / NaN."""
    backoff_factor: float = 0.5
    """Multiplier on an overflow once the hysteresis is used up (every overflowed step is
    skipped)."""
    growth_interval: int = 1000
    """Clean steps needed before growing the scale."""
    min_scale: float = 1.0
    """The scale never drops below this."""
    hysteresis: int = 1
    """Overflows since the last growth (or the start) before one lowers the scale."""
    dynamic: bool = True
    """False: a static scale (Megatron-LM's --loss-scale, DeepSpeed's loss_scale > 0):
    `init_scale` always; overflowed steps are still skipped."""
    scale: float | None = None
    """Current loss scale (init_scale at start)."""
    clean_steps: int = 0
    """Consecutive steps without overflow since the last overflow or change of scale."""
    hysteresis_left: int | None = None
    """Overflows still allowed before one lowers the scale (`hysteresis` at the start and
    after each growth; 0 once used up)."""

    def __post_init__(self):
        if self.scale is None:
            self.scale = float(self.init_scale)
        if self.hysteresis_left is None:
            self.hysteresis_left = self.hysteresis
        if not (self.growth_factor > 1 and 0 < self.backoff_factor < 1):
            raise ValueError(
                f"need growth_factor > 1 and 0 < backoff_factor < 1, got "
                f"{self.growth_factor} and {self.backoff_factor}"
            )
        if not (self.hysteresis >= 1 and self.growth_interval >= 1):
            raise ValueError(
                f"need hysteresis >= 1 and growth_interval >= 1, got {self.hysteresis} and "
                f"{self.growth_interval}"
            )
        if not 0 < self.min_scale <= self.init_scale:
            raise ValueError(
                f"need 0 < min_scale <= init_scale, got {self.min_scale} and {self.init_scale}"
            )

    def update(self, found_inf: bool) -> None:
        assert self.scale is not None and self.hysteresis_left is not None  # __post_init__
        if not self.dynamic:
            return
        if found_inf:
            self.clean_steps = 0
            self.hysteresis_left = max(self.hysteresis_left - 1, 0)
            if self.hysteresis_left == 0:
                self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0
            self.hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, d: dict) -> None:
        """Take the scale and its counters from `d` (a `state_dict`); the settings (initial
        and minimum scale, growth interval, hysteresis) stay this scaler's, as Megatron-LM's
        scaler restores only its scale and trackers. A checkpoint without the hysteresis
        counter resumes with it used up. A static scaler keeps its scale. A scale below this
        scaler's minimum (a resume given a higher --min-loss-scale) starts at the minimum."""
        if not self.dynamic:
            return
        self.scale = max(self.min_scale, float(d["scale"]))
        self.clean_steps = int(d.get("clean_steps", 0))
        left = d.get("hysteresis_left")
        self.hysteresis_left = min(int(left), self.hysteresis) if left is not None else 0


class Precision:
    """The numeric mode of training: "fp32", "bf16" or "fp16"."""

    def __init__(
        self, mode: str, device: torch.device | str, scaler: DynamicLossScaler | None = None
    ):
        if mode not in PRECISIONS:
            raise ValueError(f"unknown precision {mode!r}; expected one of {sorted(PRECISIONS)}")
        self.mode = mode
        self.device = torch.device(device)
        self.dtype = PRECISIONS[mode]
        self.scaler = (scaler or DynamicLossScaler()) if mode == "fp16" else None

    def autocast(self):
        """Context for the forward (and the executor's interleaved backward)."""
        if self.mode == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    @property
    def loss_scale(self) -> float:
        if self.scaler is None:
            return 1.0
        assert self.scaler.scale is not None  # set by DynamicLossScaler.__post_init__
        return self.scaler.scale

    def backward_scale(self, dp: int) -> float:
        """The scale a step's losses are backpropagated with: in fp16 the loss scale over the
        `dp` ranks whose average the gradients become, so each rank's m micro-batches weigh
        as one process's m x dp do and its fp16 backward holds one process's values (and
        overflows where one process's does); 1 in fp32 and bf16."""
        return self.loss_scale / dp if self.scaler is not None else 1.0

    @torch.no_grad()
    def unscale_and_check(self, params: Iterable[torch.Tensor], scale: float) -> bool:
        """Divide gradients by `scale` (`backward_scale`'s); True if any rank anywhere has an
        inf / NaN.

        Collective over the whole world in fp16 (every rank must call it); free otherwise.
        """
        if self.scaler is None:
            return False
        grads = [p.grad for p in params if p.grad is not None]
        flag = torch.zeros(1, dtype=torch.float32, device=self.device)
        inv = torch.full((1,), 1.0 / scale, dtype=torch.float32, device=self.device)
        if grads:  # one fused kernel: multiply by 1/scale and flag any inf / NaN
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def update(self, found_inf: bool) -> None:
        """After the step: change the loss scale (fp16 only)."""
        if self.scaler is not None:
            self.scaler.update(found_inf)

    def state_dict(self) -> dict:
        return {
            "mode": self.mode,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def load_state_dict(self, d: dict) -> None:
        """Restore the loss scale; a checkpoint of another mode (a switch on resume) has none."""
        if self.scaler is not None and d.get("scaler"):
            self.scaler.load_state_dict(d["scaler"])
