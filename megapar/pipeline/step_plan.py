"""The plan of one pipeline stage's step: what the executor's walk runs, worked out once per step
size (`plan_step`) so that a step does no peer or label arithmetic and no text formatting.

A stage's program (`messages.programs`) is the schedule's compute `Action`s with `MessageGroup`s
between them. The plan turns each program step into a planned one, every field named: a
`PlannedGroup` (its `PlannedMessage`s with their peers' ranks and the slots they read) or a
`PlannedCompute` (its handler's kind, the `PlannedRecv` it waits for or the V's in-memory
hand-over). The walk (`StepPlan.walk`, `walk_of`) is one `WalkStep` per compute, the group
before it folded in; it holds them as plain tuples in their types' field order, which the
executor's walk unpacks rather than reading attributes (its host work per step is what
`benchmarks/executor_instructions.py` counts).

The plan also holds the step's trace: a traced step writes clock stamps into a list the plan
sized, one where an event ends and the next starts, each at the index the plan gave its step
(`PlannedGroup.sent_at`, `WalkStep.stamp`); which stamps bound which event is worked out here
once (`trace_events`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from megapar.faults.status import encode_action
from megapar.pipeline import messages
from megapar.pipeline.schedules import Action, MessageGroup, peer_of, virtual_stage

if TYPE_CHECKING:
    from torch import nn

AUTOGRAD_KINDS = frozenset({"backward", "backward_input"})
"""Actions whose autograd backward accumulates parameter gradients; `before_last_backward`
precedes the last one, so the data-parallel buckets launch as gradients become final."""

SEND_ACT, SEND_GRAD, RECV = 0, 1, 2
"""`PlannedMessage.code`: what the walk does with a message."""

MESSAGE_KINDS = ("send_act", "send_grad", "recv_act", "recv_grad")
"""The message actions' kinds (`PlannedMessage.uid`)."""


@dataclass(frozen=True)
class StagePlace:
    """Where this rank's stage sits in the pipeline: what planning a step asks of the layout."""

    pp_rank: int
    pp: int
    chunks: int
    """Model chunks per rank (virtual stages)."""
    placement: str
    """How chunks are placed (`schedules.placement_of`: round-robin or a V)."""
    stage_rank: Callable[[int], int]
    """pp stage -> global rank (`Mesh.stage_rank`)."""

    def slot(self, mb: int, chunk: int) -> int:
        """The key of micro-batch `mb`'s state in model chunk `chunk`: ``mb * chunks + chunk``."""
        return mb * self.chunks + chunk

    def peer(self, rank: int, a: Action) -> tuple[int, int]:
        """(pp stage, chunk) that message action `a` of pp stage `rank` pairs with."""
        peer = peer_of(rank, a, self.pp, self.chunks, self.placement)
        assert peer is not None, f"{a} of pp stage {rank} has no peer"  # programs pair them
        return peer

    def virtual_stage(self, chunk: int) -> int:
        """The virtual stage of this rank's model chunk `chunk`."""
        return virtual_stage(self.pp_rank, chunk, self.pp, self.placement)


class PlannedMessage(NamedTuple):
    """One message of a group as `p2p.issue` takes it, with what the walk does with it (kept
    as a plain tuple in this field order, which the walk unpacks)."""

    uid: int
    """The message action as one int in the step (``slot * 4 + kind``): what the set of
    receives issued so far holds (an int hashes for nothing)."""
    code: int
    """SEND_ACT (the output of `slot` travels), SEND_GRAD (its input gradient) or RECV."""
    slot: int
    """The slot (`StagePlace.slot`) of the action's (mb, chunk)."""
    key: tuple
    """(kind, mb, chunk) of the message action."""
    peer: int
    """The peer's global rank."""
    carries: tuple
    """What travels: ("act" / "grad", mb, the receiver's chunk)."""
    label: str
    """The action as text, for error messages."""


class PlannedGroup(NamedTuple):
    """A message group as the walk issues it (one ``batch_isend_irecv``)."""

    messages: tuple
    """Its `PlannedMessage`s (plain tuples), in the group's order."""
    said: bytes
    """What the rank is doing while the group is issued, encoded (`status.encode_action`)."""
    sent_acts: tuple
    """The slot of every activation the group sends (its output's storage is freed)."""
    sends: tuple
    """(kind, mb, chunk) of every send, for the trace."""
    sent_at: int | None = None
    """A group that sends: the index of the clock reading at its end in the step's stamps."""
    issue: tuple | None = None
    """A group of receives only: what `p2p.issue` takes for it where no receive is posted
    ahead (NCCL: the same every step, so the walk builds nothing for it), else None."""


class PlannedRecv(NamedTuple):
    """The received message a compute waits for (a plain tuple in `WalkStep.recv`)."""

    key: tuple
    """(kind, mb, chunk) of the receive."""
    peer: int
    """The sender's global rank."""
    said: bytes
    """What the wait is, encoded (`status.encode_action`)."""
    acks: tuple
    """(kind, mb, chunk) of the sends its arrival proves received."""
    slot: int
    """The slot of (mb, chunk): where the received tensor is kept."""
    is_act: bool
    """An activation (the compute's input leaf), else an output gradient."""


class PlannedCompute(NamedTuple):
    """A compute action and the message it waits for, as planned."""

    position: int
    """Its index in the program (a field named ``index`` would shadow `tuple.index`)."""
    action: Action
    kind: str
    """The action's kind: its handler (`PipelineExecutor.handlers`)."""
    key: tuple
    """(kind, mb, chunk) of the action: its trace entry."""
    recv: PlannedRecv | None
    """The message it waits for, or None when it consumes no message."""
    hand_over: tuple | None
    """(kind, slot of the same micro-batch in the source chunk) where the compute takes its
    input from another chunk of this rank (the V's turn: no message), else None."""
    said: bytes
    """What the rank is doing while the compute runs, encoded (`status.encode_action`)."""


class WalkStep(NamedTuple):
    """A compute and the message group before it, as the walk runs them: kept as a plain tuple
    in this field order, which the walk unpacks. A group that no compute follows gets a step
    of its own, `kind` None."""

    group: tuple | None
    """The `PlannedGroup` (a plain tuple) issued before the compute, or None."""
    action: Action | None
    kind: str | None
    """Its handler (`PipelineExecutor.handlers`)."""
    recv: tuple | None
    """The `PlannedRecv` (a plain tuple) it waits for, or None."""
    hand_over: tuple | None
    """`PlannedCompute.hand_over`."""
    said: bytes | None
    """`PlannedCompute.said`."""
    stamp: int | None
    """The index of the clock reading at its start in the step's stamps (its end is the next;
    the reading before its `grad_sync` call, where it has one, the one before)."""
    sync_at: int | None
    """Its index in the program where `grad_sync` may be called before it (`StepPlan.arm_at`,
    `StepPlan.last_backward`), else None."""
    report_at: int | None
    """Its index where it is a chunk's last weight-gradient action (`StepPlan.report_at`),
    else None."""


@dataclass(frozen=True)
class StepPlan:
    """What a step needs from this rank's program (`plan_step`)."""

    program: tuple
    """The computes and message groups, in order (`messages.programs`)."""
    walk: tuple
    """What the walk runs: per compute (with the group before it), the plain tuple of its
    `WalkStep` (`walk_of`)."""
    last_backward: int | None
    """Index of the last action whose backward accumulates parameter gradients."""
    arm_at: dict
    """Index of a model chunk's last backward (before the stage's last) -> the parameters whose
    gradients are final after it (those of no chunk with a later last backward): armed there
    (`grad_sync.arm`), so their buckets reduce while the other chunks' backwards run."""
    report_at: frozenset
    """Indices of each model chunk's last action that adds to its weight gradients, where it
    is a `backward_weight` (zero bubble) or a whole backward applying deferred products
    (DualPipeV): it reports the weights it finishes to `grad_sync.grads_ready`."""
    split_backward: bool
    """Whether the backward is split into B and W (the linear layers store (X, dY))."""
    posts: dict
    """Per peer rank, this rank's receives from it in program order (`PlannedMessage`s):
    what gloo posts ahead."""
    longest: int
    """The longest encoded status text of the plan (`status.action_line`)."""
    events: tuple
    """The events of a traced step, in the order they end: ((kind, mb, chunk), index of its
    start stamp, index of its end stamp) (`trace_events`)."""
    readings: int
    """How many clock readings a step takes (the length of its list of stamps)."""


def plan_step(program: tuple, programs: tuple | None, place: StagePlace, chunks) -> StepPlan:
    """The plan of `program` (this rank's), on `place`; `programs` (every stage's, for the
    acknowledgements) is None when there is no peer; `chunks` are this rank's model chunks."""
    actions = [(i, a) for i, a in enumerate(program) if isinstance(a, Action)]
    acks = (
        {} if programs is None else messages.acknowledgements(programs, place.pp_rank, place.peer)
    )
    # a program of forwards alone is an evaluation's: its actions say so where a rank stops
    said = "" if any(a.kind in AUTOGRAD_KINDS for _, a in actions) else "evaluation: "
    steps = tuple(
        plan_group(step, place, said)
        if isinstance(step, MessageGroup)
        else plan_compute(i, step, acks, place, said)
        for i, step in enumerate(program)
    )
    posts: dict[int, list] = {}
    for step in steps:
        for message in (
            map(PlannedMessage._make, step.messages) if isinstance(step, PlannedGroup) else ()
        ):
            if message.code == RECV:
                posts.setdefault(message.peer, []).append(message)
    last_backward = max((i for i, a in actions if a.kind in AUTOGRAD_KINDS), default=None)
    arm_at = chunk_arming(actions, last_backward, chunks)
    report_at = report_points(actions)
    syncs_at = frozenset(arm_at) | ({last_backward} if last_backward is not None else set())
    events, at, readings = trace_events(steps, syncs_at)
    walk = walk_of(steps, at, syncs_at, report_at)
    saids = [step.said for step in steps]
    saids += [
        step.recv.said
        for step in steps
        if isinstance(step, PlannedCompute) and step.recv is not None
    ]
    return StepPlan(
        program=program,
        walk=walk,
        last_backward=last_backward,
        arm_at=arm_at,
        report_at=report_at,
        split_backward=any(a.kind == "backward_input" for _, a in actions),
        posts={rank: tuple(recvs) for rank, recvs in posts.items()},
        longest=max((len(said) for said in saids), default=0),
        events=events,
        readings=readings,
    )


def plan_group(group: MessageGroup, place: StagePlace, said: str = "") -> PlannedGroup:
    """A message group with every message's peer rank, payload and slot worked out (`said`
    begins what the rank is doing: "evaluation: " in an evaluation's program)."""
    codes = {"send_act": SEND_ACT, "send_grad": SEND_GRAD}
    planned = []
    for a in group.messages:
        peer, peer_chunk = place.peer(place.pp_rank, a)
        send = a.kind.startswith("send")
        slot = place.slot(a.mb, a.chunk)
        planned.append(
            PlannedMessage(
                slot * 4 + MESSAGE_KINDS.index(a.kind),
                codes.get(a.kind, RECV),
                slot,
                (a.kind, a.mb, a.chunk),
                place.stage_rank(peer),
                (a.kind[5:], a.mb, peer_chunk if send else a.chunk),
                str(a),
            )
        )
    peers = sorted({message.peer for message in planned})
    doing = (
        f"{said}{group.name} {group} on pp stage {place.pp_rank} (with rank"
        f"{'s' if len(peers) > 1 else ''} {', '.join(map(str, peers))})"
    )
    receives_only = all(message.code == RECV for message in planned)
    return PlannedGroup(
        tuple(tuple(message) for message in planned),
        encode_action(doing),
        tuple(message.slot for message in planned if message.code == SEND_ACT),
        tuple(message.key for message in planned if message.code != RECV),
        issue=tuple((m.key, None, m.peer, m.carries, m.label) for m in planned)
        if receives_only
        else None,
    )


def plan_compute(
    i: int, a: Action, acks: dict, place: StagePlace, said: str = ""
) -> PlannedCompute:
    """Compute `a` (at index `i`) with the message it waits for, or the V's hand-over
    (`said`: as `plan_group`'s)."""
    doing = f"{said}{a.kind} of micro-batch {a.mb} on pp stage {place.pp_rank}"
    planned = PlannedCompute(
        i, a, a.kind, (a.kind, a.mb, a.chunk), None, None, encode_action(doing)
    )
    last = place.pp * place.chunks - 1
    if a.kind == "forward" and place.virtual_stage(a.chunk) != 0:
        kind = "recv_act"
    elif a.kind in AUTOGRAD_KINDS and place.virtual_stage(a.chunk) != last:
        kind = "recv_grad"
    else:
        return planned
    key = (kind, a.mb, a.chunk)
    peer_stage, peer_chunk = place.peer(place.pp_rank, Action(*key))
    if peer_stage == place.pp_rank:  # the V's turn: in memory
        return planned._replace(hand_over=(kind, place.slot(a.mb, peer_chunk)))
    peer = place.stage_rank(peer_stage)
    waiting = f"{said}{kind} of micro-batch {a.mb} on pp stage {place.pp_rank} (from rank {peer})"
    return planned._replace(
        recv=PlannedRecv(
            key,
            peer,
            encode_action(waiting),
            tuple(acks.get(key, ())),
            place.slot(a.mb, a.chunk),
            kind == "recv_act",
        )
    )


def walk_of(steps: tuple, at: tuple, syncs_at: frozenset, report_at: frozenset) -> tuple:
    """`StepPlan.walk` of the planned `steps` (`at`: each step's stamp, `trace_events`)."""
    walk, group = [], None
    for step, stamp in zip(steps, at):
        if isinstance(step, PlannedGroup):
            if group is not None:  # a group that no compute follows
                walk.append(tuple(WalkStep(group, *(None,) * 8)))
            group = tuple(step._replace(sent_at=stamp))
            continue
        walk.append(
            tuple(
                WalkStep(
                    group,
                    step.action,
                    step.kind,
                    step.recv and tuple(step.recv),
                    step.hand_over,
                    step.said,
                    stamp,
                    step.position if step.position in syncs_at else None,
                    step.position if step.position in report_at else None,
                )
            )
        )
        group = None
    if group is not None:
        walk.append(tuple(WalkStep(group, *(None,) * 8)))
    return tuple(walk)


def report_points(actions: list) -> frozenset:
    """`StepPlan.report_at`: per chunk, its last backward or W, where the step splits the
    backward (only then are weight products deferred)."""
    if not any(a.kind == "backward_input" for _, a in actions):
        return frozenset()
    last = {}
    for i, a in actions:
        if a.kind in ("backward", "backward_weight"):
            last[a.chunk] = i
    return frozenset(last.values())


def chunk_arming(actions: list, last_backward: int | None, chunks) -> dict:
    """`StepPlan.arm_at`: with several model chunks, each chunk's last backward before the
    stage's last, and the parameters it leaves final (a parameter two chunks share is
    final only after the later one)."""
    last_of = {}
    for i, a in actions:
        if a.kind in AUTOGRAD_KINDS:
            last_of[a.chunk] = i
    if len(last_of) < 2:
        return {}
    # id(param) -> (index of its last backward, param)
    owner: dict[int, tuple[int, nn.Parameter]] = {}
    for chunk, index in last_of.items():
        for p in chunks[chunk].parameters():
            if p.requires_grad and index > owner.get(id(p), (-1, None))[0]:
                owner[id(p)] = (index, p)
    arm_at: dict[int, list] = {}
    for index, p in owner.values():
        if index != last_backward:
            arm_at.setdefault(index, []).append(p)
    return {index: tuple(params) for index, params in arm_at.items()}


def check_chunks(program, chunks: int, schedule: str) -> None:
    """Raise where `program` uses more model chunks than the rank holds."""
    used = {
        a.chunk
        for step in program
        for a in (step.messages if isinstance(step, MessageGroup) else (step,))
    }
    if max(used, default=0) >= chunks:
        raise NotImplementedError(
            f"schedule {schedule!r} uses model chunks {sorted(used)}, but this rank holds "
            f"{chunks} chunk(s); build the stage with as many virtual stages as the schedule "
            f"uses"
        )


def trace_events(steps: tuple, syncs_at: frozenset = frozenset()) -> tuple:
    """`StepPlan.events` of the planned `steps`: which stamps of a traced step bound which event.

    A traced step reads the clock once at each point where one event ends and the next starts:
    before the walk (stamp 0), right before and right after each compute's handler, after each
    group that sends, after the wait for outstanding sends, and around the loss broadcast; and
    before the `grad_sync` call of each compute in `syncs_at` (program indices). A compute is
    the interval of its handler; the wait for the message it consumes runs from the previous
    stamp to the compute's start, or to the stamp before its `grad_sync` call (so it holds the
    issue of receive-only groups and the step's bookkeeping in between: time that is no
    compute), and each send of a group from the previous stamp to the group's end. Returns
    ((kind, mb, chunk), start, end) per event in the order they end, the indices into the
    step's stamps; per step, the index of the reading it takes (a compute: at its start; a group
    that sends: at its end; else None); and how many readings a step takes (the last three: the
    sends' wait's end, the loss broadcast's start and end)."""
    at: list[int | None] = []
    events, last, n = [], 0, 1
    for step in steps:
        if isinstance(step, PlannedGroup):
            if step.sends:
                events += [(key, last, n) for key in step.sends]
                at.append(n)
                last, n = n, n + 1
            else:
                at.append(None)
            continue
        syncs = step.position in syncs_at
        if syncs:
            n += 1
        if step.recv is not None:
            events.append((step.recv.key, last, n - 1 if syncs else n))
        events.append((step.key, n, n + 1))
        at.append(n)
        last, n = n + 1, n + 2
    events += [(("wait", None, 0), last, n), (("loss_broadcast", None, 0), n + 1, n + 2)]
    return tuple(events), tuple(at), n + 3
