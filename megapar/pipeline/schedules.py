"""Pipeline schedules as data: each stage runs a flat list of `Action`s, in order.

A schedule function is pure: `schedule(pp, m, stage) -> list[Action]` returns the instruction list
of one pipeline stage for one step of `m` micro-batches (like DeepSpeed's instruction lists). The
executor walks the list and dispatches on `Action.kind`; it knows nothing about GPipe or 1F1B.

Vocabulary (`ACTION_KINDS`), for micro-batch `mb` of model chunk `chunk`:

- ``recv_act`` / ``send_act``: receive the input activation from stage s-1 / send the output
  activation to stage s+1. The first stage never receives activations; the last never sends them.
- ``forward``: run the stage's layers (the last stage also computes the loss).
- ``recv_grad`` / ``send_grad``: receive d(loss)/d(output) from stage s+1 / send d(loss)/d(input)
  to stage s-1. The last stage never receives gradients; the first never sends them.
- ``backward``: backward through the stage's layers.
- ``backward_input`` / ``backward_weight``: reserved for zero-bubble schedules (below).

Communication semantics (what the executor implements, and what `megapar.pipeline.simulate`
checks):

- Sends are NON-blocking (``isend``); the executor waits for all outstanding sends at the end of
  the step. Receives are BLOCKING.
- ``send_act`` mb i on stage s matches ``recv_act`` mb i on stage s+1; ``send_grad`` on stage s
  matches ``recv_grad`` on stage s-1.
- Point-to-point messages on one directed channel (s -> s+1 activations, s -> s-1 gradients) are
  matched in issue order, so the sender's and the receiver's micro-batch orders on each channel must
  be identical, and so must the message counts.
- Hence a schedule is deadlock-free iff simulating every stage in program order, where a receive
  completes only after the neighbour has issued the matching send, lets every stage finish.

Design note: the vocabulary already carries `chunk` and the split backward. Interleaved 1F1B (each
rank holds several model chunks; `chunk > 0` selects the virtual stage) and zero-bubble schedules
(``backward`` split into ``backward_input``, which produces the gradient to send upstream, and
``backward_weight``, which can be deferred to fill bubbles) are added as new schedule functions in
`SCHEDULES` without changing the executor's dispatch loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megapar.pipeline.timeline import short_label

ACTION_KINDS = ("recv_act", "forward", "send_act", "recv_grad", "backward", "send_grad",
                "backward_input", "backward_weight")
"""Every action kind a schedule may use; the last two are reserved for zero-bubble schedules."""


@dataclass(frozen=True)
class Action:
    """One instruction of a stage's schedule."""

    kind: str
    """One of `ACTION_KINDS`."""
    mb: int
    """Micro-batch index in [0, m)."""
    chunk: int = 0
    """Model chunk (virtual stage) on this rank; always 0 for non-interleaved schedules."""

    def __post_init__(self):
        if self.kind not in ACTION_KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; valid kinds: {', '.join(ACTION_KINDS)}")
        if self.mb < 0 or self.chunk < 0:
            raise ValueError(f"action {self.kind} needs mb >= 0 and chunk >= 0, "
                             f"got mb={self.mb} chunk={self.chunk}")

    def __str__(self) -> str:
        return short_label(self.kind, self.mb, self.chunk)


def format_schedule(actions: list[Action]) -> str:
    """One line, e.g. "F0 SA0 F1 SA1 RG0 B0 RG1 B1"."""
    return " ".join(str(a) for a in actions)


def _check_args(pp: int, m: int, stage: int) -> None:
    if not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pipeline size pp must be an integer >= 1, got {pp!r}")
    if not isinstance(m, int) or m < 1:
        raise ValueError(f"number of micro-batches m must be an integer >= 1, got {m!r}")
    if not isinstance(stage, int) or not 0 <= stage < pp:
        raise ValueError(f"stage must be an integer in [0, {pp}) for pp={pp}, got {stage!r}")


def _forward(mb: int, stage: int, pp: int) -> list[Action]:
    """recv_act (unless first stage), forward, send_act (unless last stage)."""
    actions = [] if stage == 0 else [Action("recv_act", mb)]
    actions.append(Action("forward", mb))
    if stage < pp - 1:
        actions.append(Action("send_act", mb))
    return actions


def _backward(mb: int, stage: int, pp: int) -> list[Action]:
    """recv_grad (unless last stage), backward, send_grad (unless first stage)."""
    actions = [] if stage == pp - 1 else [Action("recv_grad", mb)]
    actions.append(Action("backward", mb))
    if stage > 0:
        actions.append(Action("send_grad", mb))
    return actions


def gpipe(pp: int, m: int, stage: int) -> list[Action]:
    """GPipe: every forward, then every backward (micro-batches 0..m-1 in both phases).

    Simple, but all m micro-batches are in flight at once (activation memory grows with m).
    """
    _check_args(pp, m, stage)
    actions = []
    for mb in range(m):
        actions += _forward(mb, stage, pp)
    for mb in range(m):
        actions += _backward(mb, stage, pp)
    return actions


def one_f_one_b(pp: int, m: int, stage: int) -> list[Action]:
    """1F1B (PipeDream-flush / Megatron): same bubble as GPipe, at most pp - stage mbs in flight.

    Warmup fills the pipeline with forwards, the steady state alternates one forward with one
    backward, and cooldown drains the remaining backwards.
    """
    _check_args(pp, m, stage)
    num_warmup = min(pp - stage - 1, m)
    num_steady = m - num_warmup
    actions = []

    # Warmup: forwards only, until the first gradient can come back from the last stage.
    for mb in range(num_warmup):
        actions += _forward(mb, stage, pp)

    # Steady state: forward the next micro-batch, then backward the oldest one in flight.
    for i in range(num_steady):
        actions += _forward(num_warmup + i, stage, pp)
        actions += _backward(i, stage, pp)

    # Cooldown: backward the micro-batches still in flight.
    for mb in range(num_steady, m):
        actions += _backward(mb, stage, pp)
    return actions


SCHEDULES: dict[str, Callable[[int, int, int], list[Action]]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
}
"""Schedule functions by name (what `--pp-schedule` accepts)."""


def get_schedule(name: str) -> Callable[[int, int, int], list[Action]]:
    """The schedule function called `name`; ValueError listing the valid names otherwise."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown pipeline schedule {name!r}; valid schedules: "
                         f"{', '.join(sorted(SCHEDULES))}") from None


def in_flight_peak(actions: list[Action]) -> int:
    """Most micro-batches forwarded but not yet backwarded at any point of the schedule.

    This bounds the stored activations. A micro-batch leaves flight at its ``backward`` or, for
    zero-bubble schedules, at its ``backward_input`` (the weight gradient keeps only small inputs).
    """
    in_flight: set[tuple[int, int]] = set()
    peak = 0
    for a in actions:
        if a.kind == "forward":
            in_flight.add((a.mb, a.chunk))
            peak = max(peak, len(in_flight))
        elif a.kind in ("backward", "backward_input"):
            in_flight.discard((a.mb, a.chunk))
    return peak
