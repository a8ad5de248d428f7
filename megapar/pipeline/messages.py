"""When a pipeline stage issues its messages, and what each received message proves.

A schedule (`megapar.pipeline.schedules`) says which messages every compute consumes and
produces. This module turns the schedules of all stages into *programs*: each stage's computes
in schedule order with `MessageGroup`s between them, one ``batch_isend_irecv`` each. The
placement makes the programs correct under NCCL's rules, which are stricter than gloo's:

- a rank pair's messages pair up in issue order (tags are ignored), so for every ordered pair
  of ranks the sender's sends and the receiver's receives must list the same messages in the
  same order;
- a rank runs its point-to-point operations in issue order on one stream, and a large send
  finishes only while the matching receive runs; so if two neighbours each issue a send before
  the receive of the other's message, both wait forever (what 1F1B does when every message is
  issued on its own).

The rule that guarantees both is a global clock: simulate the step once with nominal costs
(forward 1, backward 2, or B 1 + W 1) and give every message the time its producing compute
ends. Each stage issues a message, send or receive, in the group at that time: after the
computes that start earlier, before the computes that start at or after it. Then the messages
exchanged at time t are in groups at time t on both sides, a compute only needs messages of
earlier times, and by induction over time every group finds its peers' groups issued
(`megapar.pipeline.simulate` checks this for every schedule). Adjacent groups with no compute
between them are merged (their messages progress together, which can only help). A compute
waits only for the receives it consumes, so a receive issued early lets the message land while
the stage computes.

The same programs run on gloo and NCCL (one code path); only the stage's own compute order comes
from the schedule, and it is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from megapar.pipeline.actions import MESSAGE_KINDS, SEND_KINDS, Action, MessageGroup, Step
from megapar.pipeline.placement import peer_of, placement_of, virtual_stage
from megapar.pipeline.schedules import stage_actions
from megapar.pipeline.simulate import Costs, action_times

FORWARD_KINDS = frozenset({"recv_act", "forward", "send_act"})
"""The actions an evaluation (forward-only) step keeps from the schedule."""
NOMINAL_COSTS = Costs(fwd_ms=1.0, bwd_ms=2.0)
"""The costs of the clock that orders messages (B and W take half a backward each)."""
CONSUMERS = {"recv_act": ("forward",), "recv_grad": ("backward", "backward_input")}
"""The compute kinds that consume a received message of each kind."""
CONSUMED = {compute: recv for recv, computes in CONSUMERS.items() for compute in computes}
"""The receive kind each consuming compute kind consumes (`CONSUMERS` inverted)."""
IN_FLIGHT_CHANGE = {"forward": 1, "backward": -1, "backward_input": -1}
"""How each compute kind changes its chunk's count of micro-batches in flight (a forward starts
one, a backward or B of a split backward ends it)."""


def consumes(compute: Action, recv: Action) -> bool:
    """Whether `compute` is the action that needs the message `recv` receives."""
    return compute.kind in CONSUMERS.get(recv.kind, ()) and (compute.mb, compute.chunk) == (
        recv.mb,
        recv.chunk,
    )


MessageId = tuple[str, int, int]
"""(what, mb, virtual stage of the sender): names one message on both of its sides."""


def _message_id(stage: int, a: Action, pp: int, placement: str) -> MessageId:
    """(what, mb, virtual stage of the sender): the same for a send and its receive."""
    vs = virtual_stage(stage, a.chunk, pp, placement)
    what = "act" if a.kind.endswith("act") else "grad"
    if a.kind.startswith("recv"):
        vs += -1 if what == "act" else 1
    return what, a.mb, vs


def group_messages(
    schedules: Sequence[Sequence[Action]], placement: str = "loop"
) -> list[list[Step]]:
    """Every stage's program: its computes in `schedules` order, its messages in groups issued
    on the nominal clock (see the module docstring)."""
    pp = len(schedules)
    times = action_times(schedules, NOMINAL_COSTS, placement)  # per stage, (start, end) of each
    ids: list[list[MessageId | None]] = []
    sent_at: dict[MessageId, float] = {}
    for stage, actions in enumerate(schedules):
        # (kind, chunk) -> the message id's what and sender, which depend on nothing else
        known: dict[tuple[str, int], tuple[str, int]] = {}
        stage_ids: list[MessageId | None] = []
        for a, (_, end) in zip(actions, times[stage]):
            if a.kind not in MESSAGE_KINDS:
                stage_ids.append(None)
                continue
            what_vs = known.get((a.kind, a.chunk))
            if what_vs is None:
                what, _, vs = _message_id(stage, a, pp, placement)
                what_vs = known[a.kind, a.chunk] = (what, vs)
            message = (what_vs[0], a.mb, what_vs[1])
            stage_ids.append(message)
            if a.kind in SEND_KINDS:
                sent_at[message] = end
        ids.append(stage_ids)
    programs: list[list[Step]] = []
    for stage, actions in enumerate(schedules):
        keyed = []  # (time, 0 = message / 1 = compute, program index, action)
        for i, (a, (start, _), sent) in enumerate(zip(actions, times[stage], ids[stage])):
            if sent is not None:  # a message, issued when it is sent
                keyed.append((sent_at[sent], 0, i, a))
            else:
                keyed.append((start, 1, i, a))
        program: list[Step] = []
        group: list[Action] = []
        keyed.sort()  # by (time, message before compute, program index): indices are unique
        for _, is_compute, _, a in keyed:
            if not is_compute:
                group.append(a)
                continue
            if group:
                program.append(MessageGroup(tuple(group)))
                group = []
            program.append(a)
        if group:
            program.append(MessageGroup(tuple(group)))
        programs.append(program)
    return programs


@lru_cache(maxsize=64)
def programs(
    name: str, pp: int, m: int, virtual_stages: int = 1, forward_only: bool = False
) -> tuple[tuple[Step, ...], ...]:
    """The program of every stage for schedule `name` (cached: every rank computes all stages').
    `forward_only`: an evaluation step (the schedule's forwards and their messages)."""
    schedules: Sequence[Sequence[Action]] = stage_actions(name, pp, m, virtual_stages)
    if forward_only:
        schedules = [[a for a in s if a.kind in FORWARD_KINDS] for s in schedules]
    return tuple(tuple(p) for p in group_messages(schedules, placement_of(name)))


def messages_of(program) -> list[Action]:
    """The program's messages in issue order (groups flattened)."""
    return [a for step in program if isinstance(step, MessageGroup) for a in step.messages]


def computes_of(program) -> list[Action]:
    """The program's compute actions in order."""
    return [step for step in program if isinstance(step, Action)]


def acknowledgements(programs_: tuple, me: int, peer_of) -> dict[tuple, list[tuple]]:
    """{(recv kind, mb, chunk): [(send kind, mb, chunk), ...]}: my sends proven received once I
    have that receive of mine in hand.

    Sends are waited for at the end of the step, so without this every sent buffer would live
    until then (all m activations, defeating 1F1B's memory bound). The peer waits for my message
    right before the compute that consumes it; any message it sends me from a later group was
    issued after that wait, so once I hold that message, my send has completed and waiting for
    it costs nothing. `peer_of(rank, action)` is the (pp rank, chunk) at the other end.
    """
    acks: dict[tuple, list[tuple]] = {}
    index: dict[int, tuple[dict, list]] = {}
    for send in messages_of(programs_[me]):
        if send.kind not in SEND_KINDS:
            continue
        peer, peer_chunk = peer_of(me, send)
        if peer not in index:
            index[peer] = _reply_index(programs_[peer], peer, me, peer_of)
        first, reply_after = index[peer]
        recv_kind = "recv" + send.kind[4:]
        consumer = None  # the first compute of the peer's that consumes this message
        for kind in CONSUMERS[recv_kind]:
            i = first.get((kind, send.mb, peer_chunk))
            if i is not None and (consumer is None or i < consumer):
                consumer = i
        if consumer is None:
            raise ValueError(f"no compute of stage {peer} consumes {send} of stage {me}")
        reply = reply_after[consumer + 1]
        if reply is not None:
            key = ("recv" + reply.kind[4:], reply.mb, peer_of(peer, reply)[1])
            acks.setdefault(key, []).append((send.kind, send.mb, send.chunk))
    return acks


def _reply_index(program, peer: int, me: int, peer_of) -> tuple[dict, list]:
    """For `acknowledgements`, in one pass over `peer`'s program: the position of each of its
    computes ((kind, mb, chunk) -> first index), and for every position the first message it
    sends `me` from there on (None when there is none), so finding a send's acknowledgement
    costs O(1) instead of a scan of the peer's program."""
    first: dict[tuple, int] = {}
    for i, step in enumerate(program):
        if isinstance(step, Action):
            first.setdefault((step.kind, step.mb, step.chunk), i)
    reply_after: list = [None] * (len(program) + 1)
    for i in range(len(program) - 1, -1, -1):
        step, found = program[i], reply_after[i + 1]
        if isinstance(step, MessageGroup):
            for a in step.messages:
                if a.kind in SEND_KINDS and peer_of(peer, a)[0] == me:
                    found = a
                    break
        reply_after[i] = found
    return first, reply_after


def held(programs_: tuple, stage: int, placement: str = "loop") -> frozenset:
    """What `stage` holds at every point of its program, run as the executor runs it: the
    distinct (micro-batches in flight per chunk, message buffers held). A micro-batch is in
    flight from its forward to its backward (B of a split backward); a message buffer from its
    group's issue until the receive is consumed, or until a later message proves the send
    received (`acknowledgements`). A sent output's storage is the send's (the executor frees
    the output itself), so the peak of activations is max(counts . chunk bytes + buffers x
    message bytes) over these."""
    return held_stages(programs_, placement, (stage,))[0]


def held_stages(programs_: tuple, placement: str = "loop", stages=None) -> list[frozenset]:
    """`held` of each of `stages` (default: every stage), sharing the work they have in
    common."""
    pp = len(programs_)
    chunks = 1 + max(
        (
            a.chunk
            for p in programs_
            for step in p
            for a in (step.messages if isinstance(step, MessageGroup) else (step,))
        ),
        default=0,
    )
    known: dict[tuple[int, str, int], tuple[int, int] | None] = {}

    def peer(rank, a):  # `peer_of`, which depends on the rank, the kind and the chunk only
        key = (rank, a.kind, a.chunk)
        found = known.get(key)
        if found is None:
            found = known[key] = peer_of(rank, a, pp, chunks, placement)
        return found

    return [
        _held(programs_, stage, chunks, peer) for stage in (range(pp) if stages is None else stages)
    ]


def _held(programs_: tuple, stage: int, chunks: int, peer) -> frozenset:
    """`held` of one stage, `chunks` per rank, `peer(rank, action)` as `peer_of`."""
    acks = acknowledgements(programs_, stage, peer) if len(programs_) > 1 else {}
    counts, buffers, seen = [0] * chunks, set(), set()
    for step in programs_[stage]:
        if isinstance(step, MessageGroup):
            buffers |= {(a.kind, a.mb, a.chunk) for a in step.messages}
        else:
            consumed = CONSUMED.get(step.kind)  # the receive this compute consumes, if any
            if consumed is not None:
                key = (consumed, step.mb, step.chunk)
                if key in buffers:
                    buffers.discard(key)
                    buffers.difference_update(acks.get(key, ()))
            change = IN_FLIGHT_CHANGE.get(step.kind)
            if change is not None:
                counts[step.chunk] += change
        seen.add((tuple(counts), len(buffers)))
    return frozenset(seen)
