"""The instructions of a pipeline schedule: `Action` (one compute or message of one micro-batch
and chunk), `MessageGroup` (messages issued together) and a `Step` of a stage's program.

Vocabulary (`ACTION_KINDS`), for micro-batch `mb` of model chunk `chunk`:

- ``recv_act`` / ``send_act``: receive the input activation from stage s-1 / send the output
  activation to stage s+1. The first stage never receives activations; the last never sends them.
- ``forward``: run the stage's layers (the last stage also computes the loss).
- ``recv_grad`` / ``send_grad``: receive d(loss)/d(output) from stage s+1 / send d(loss)/d(input)
  to stage s-1. The last stage never receives gradients; the first never sends them.
- ``backward``: backward through the stage's layers.
- ``backward_input`` / ``backward_weight``: the backward split in two for zero-bubble schedules
  (`megapar.pipeline.schedules`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from megapar.pipeline.timeline import short_label

ACTION_KINDS = (
    "recv_act",
    "forward",
    "send_act",
    "recv_grad",
    "backward",
    "send_grad",
    "backward_input",
    "backward_weight",
)
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
            raise ValueError(
                f"unknown action kind {self.kind!r}; valid kinds: {', '.join(ACTION_KINDS)}"
            )
        if self.mb < 0 or self.chunk < 0:
            raise ValueError(
                f"action {self.kind} needs mb >= 0 and chunk >= 0, "
                f"got mb={self.mb} chunk={self.chunk}"
            )

    def __str__(self) -> str:
        return short_label(self.kind, self.mb, self.chunk)


@cache
def action(kind: str, mb: int, chunk: int = 0) -> Action:
    """`Action(kind, mb, chunk)`, one shared instance per value (an Action is immutable): a
    schedule of a large pipeline is millions of actions, and looking one up costs a fraction of
    making it. The values are bounded by the kinds x micro-batches x chunks a process plans."""
    return Action(kind, mb, chunk)


MESSAGE_KINDS = frozenset({"send_act", "recv_act", "send_grad", "recv_grad"})
"""Action kinds that are point-to-point messages (the others are compute)."""
SEND_KINDS = frozenset({"send_act", "send_grad"})
"""The message kinds that send (their names start with "send")."""
RECEIVE_KINDS = frozenset({"recv_act", "recv_grad"})
"""The message kinds that receive (their names start with "recv")."""


@dataclass(frozen=True)
class MessageGroup:
    """Messages a stage issues together as one ``batch_isend_irecv`` (an NCCL group call).

    The sends and receives of a group progress concurrently, so two neighbours that exchange
    messages in one group each never wait for each other, and the group's receives are waited
    for only by the computes that consume them."""

    messages: tuple[Action, ...]
    """The group's messages in issue order (`MESSAGE_KINDS` only)."""

    def __post_init__(self):
        if not self.messages or any(a.kind not in MESSAGE_KINDS for a in self.messages):
            raise ValueError(
                f"a MessageGroup holds one or more of {sorted(MESSAGE_KINDS)}, "
                f"got {[a.kind for a in self.messages]}"
            )

    @property
    def name(self) -> str:
        """Megatron's name for what the group does, e.g. "send_forward_recv_backward"."""
        kinds = {a.kind for a in self.messages}
        parts = []
        for verb in ("send", "recv"):
            ways = [
                way
                for way, what in (("forward", "act"), ("backward", "grad"))
                if f"{verb}_{what}" in kinds
            ]
            if ways:
                parts.append("_".join([verb, *ways]))
        return "_".join(parts)

    def __str__(self) -> str:
        return "[" + " ".join(str(a) for a in self.messages) + "]"


Step = Action | MessageGroup
"""One item of a stage's program: a compute `Action` or a `MessageGroup`."""


def format_schedule(steps: Sequence[Step]) -> str:
    """One line, e.g. "F0 SA0 F1 SA1 RG0 B0" (a schedule) or "F0 [SA0] F1 [SA1 RG0] B0" (a
    program, one bracket per message group)."""
    return " ".join(str(a) for a in steps)
