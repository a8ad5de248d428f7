"""`--profile-steps A:B`: a torch.profiler trace of optimizer steps A..B (1-based, inclusive) on
every rank, written as a Chrome trace (chrome://tracing, https://ui.perfetto.dev) per rank:
``DIR/trace_rank{R}.json``.
"""

from __future__ import annotations

import os

import torch
from torch.profiler import ProfilerActivity, profile


def parse_steps(spec: str) -> tuple[int, int]:
    """ "A:B" -> (A, B); "A" -> (A, A)."""
    try:
        first, _, last = spec.partition(":")
        a, b = int(first), int(last or first)
    except ValueError:
        raise ValueError(
            f"--profile-steps {spec!r}: expected A:B, e.g. 5:7 (steps 5 to 7)"
        ) from None
    if not 1 <= a <= b:
        raise ValueError(f"--profile-steps {spec!r}: need 1 <= A <= B")
    return a, b


class StepProfiler:
    """Starts a torch.profiler before step A and writes its trace after step B."""

    def __init__(self, spec: str | None, out_dir: str, rank: int, device: torch.device):
        self.steps = parse_steps(spec) if spec else None
        self.path = os.path.join(os.path.expanduser(out_dir), f"trace_rank{rank}.json")
        self.device = device
        self.prof: profile | None = None

    def before_step(self, step: int) -> None:
        """Call with the 1-based number of the step about to run."""
        if self.steps and step == self.steps[0] and self.prof is None:
            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self.prof = profile(activities=activities, record_shapes=True)
            self.prof.__enter__()

    def after_step(self, step: int) -> str | None:
        """Call with the number of the step just run; returns the trace path once written."""
        if self.prof is None:
            return None
        assert self.steps is not None  # a profile is started only on one of `steps`
        if step < self.steps[1]:
            return None
        self.prof.__exit__(None, None, None)
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self.prof.export_chrome_trace(self.path)
        self.prof = None
        return self.path
