"""NCCL's point-to-point rules, modelled without processes.

gloo buffers a send and pairs messages by tag, so a wrong order can pass every CPU test and
still hang or swap tensors on GPUs. This model holds issued operations to NCCL's rules, as its
user guide states them (Point-to-point communication; Group calls):

- a rank runs its point-to-point operations in issue order, one group call at a time (one
  stream per rank);
- the operations of one group progress together; the group ends when all of them have;
- zero buffering: a send finishes only while the matching receive runs, and a receive only
  while the matching send runs;
- tags are ignored: the k-th send from rank a to rank b pairs with the k-th receive on b from a.

`check(streams)` runs every rank's stream of groups under these rules and raises
`CommMismatchError` when a pair of messages does not describe the same tensor (or one is never
matched), `DeadlockError` when no rank can go on, naming the ranks, groups and messages. It
works on any issued operations: programs built from schedules (`check_programs`) or what the
executor really issued in a step (`megapar.pipeline.p2p.StageP2P.issued`).
"""

from __future__ import annotations

from dataclasses import dataclass

from megapar.pipeline.actions import MessageGroup
from megapar.pipeline.placement import peer_of, placement_of
from megapar.pipeline.simulate import CommMismatchError, DeadlockError, ScheduleError

__all__ = [
    "CommMismatchError",
    "DeadlockError",
    "Op",
    "ScheduleError",
    "check",
    "check_programs",
    "program_streams",
]


@dataclass(frozen=True)
class Op:
    """One issued point-to-point operation."""

    send: bool
    """A send (True) or a receive."""
    peer: int
    """The rank at the other end."""
    message: tuple
    """What the message carries, the same on both sides, e.g. ("act", mb, receiving chunk)."""
    label: str = ""
    """How the issuing rank names it (e.g. "SA1@1"), for error messages."""
    nbytes: int = 0
    """Payload bytes (compared between the two sides when both give them)."""


def check(streams: dict[int, list[list[Op]]]) -> None:
    """Raise if the ranks' group calls (`streams[rank]`, in issue order) would deadlock or pair
    mismatched messages under NCCL's rules; return None if every group finishes."""
    where = {}  # (src, dst, k, is_send) -> (rank, group, op)
    for rank, groups in streams.items():
        counts: dict[tuple[tuple[int, int], bool], int] = {}
        for g, group in enumerate(groups):
            for o, op in enumerate(group):
                pair = (rank, op.peer) if op.send else (op.peer, rank)
                k = counts.get((pair, op.send), 0)
                counts[pair, op.send] = k + 1
                where[(*pair, k, op.send)] = (rank, g, o)
    partner = {}
    for (src, dst, k, is_send), loc in where.items():
        other = where.get((src, dst, k, not is_send))
        if other is None:
            rank, g, o = loc
            op = streams[rank][g][o]
            missing = (
                f"rank {dst} issues no matching receive"
                if is_send
                else f"rank {src} issues no matching send"
            )
            raise CommMismatchError(
                f"rank {rank}'s {op.label or op.message} (message {k} from rank {src} to rank "
                f"{dst}, group {g} {_show(streams[rank][g])}) is never paired: {missing}"
            )
        partner[loc] = other
        if is_send:
            sent, got = (streams[loc[0]][loc[1]][loc[2]], streams[other[0]][other[1]][other[2]])
            if sent.message != got.message or (
                sent.nbytes and got.nbytes and sent.nbytes != got.nbytes
            ):
                raise CommMismatchError(
                    f"message {k} from rank {src} to rank {dst} pairs rank {src}'s "
                    f"{sent.label or sent.message} ({sent.nbytes} bytes, group {loc[1]}) with rank "
                    f"{dst}'s {got.label or got.message} ({got.nbytes} bytes, group {other[1]}): "
                    f"NCCL pairs by issue order, so the receiver would get the wrong tensor"
                )
    pc = {rank: 0 for rank in streams}  # each rank's current group
    pending = {}  # rank -> ops of its current group not finished yet
    work = list(streams)
    while work:
        rank = work.pop()
        while pc[rank] < len(streams[rank]):
            if rank not in pending:  # the group starts: pair with peers' running groups
                g = pc[rank]
                pending[rank] = set(range(len(streams[rank][g])))
                for o in sorted(pending[rank]):
                    peer, pg, po = partner[rank, g, o]
                    if pc[peer] == pg and po in pending.get(peer, ()):
                        pending[rank].discard(o)
                        pending[peer].discard(po)
                        if not pending[peer]:
                            work.append(peer)
            if pending[rank]:
                break
            del pending[rank]
            pc[rank] += 1
    stuck = {rank: g for rank, g in pc.items() if g < len(streams[rank])}
    if stuck:
        raise DeadlockError(
            "the issued messages deadlock under NCCL's rules: "
            + "; ".join(
                _blocked(streams, rank, g, pending.get(rank, ()), partner, pc)
                for rank, g in sorted(stuck.items())
            )
        )


def _show(group: list[Op]) -> str:
    return "[" + " ".join(op.label or str(op.message) for op in group) + "]"


def _blocked(streams, rank, g, pending, partner, pc) -> str:
    waits = []
    for o in sorted(pending):
        peer, pg, _ = partner[rank, g, o]
        waits.append(
            f"{streams[rank][g][o].label} needs rank {peer}'s group {pg} "
            f"{_show(streams[peer][pg])}, but rank {peer} is at group {pc[peer]}"
            + (
                f" {_show(streams[peer][pc[peer]])}"
                if pc[peer] < len(streams[peer])
                else " (finished)"
            )
        )
    return f"rank {rank} blocked in group {g} {_show(streams[rank][g])}: " + ", ".join(waits)


def program_streams(programs, placement: str = "loop") -> dict[int, list[list[Op]]]:
    """The group calls of each stage's program (`megapar.pipeline.messages.programs`), with
    pipeline ranks as ranks. A message is (what it carries, micro-batch, receiving chunk)."""
    pp = len(programs)
    chunks = 1 + max(
        (
            a.chunk
            for p in programs
            for step in p
            for a in (step.messages if isinstance(step, MessageGroup) else (step,))
        ),
        default=0,
    )
    streams = {}
    for rank, program in enumerate(programs):
        groups = []
        for step in program:
            if isinstance(step, MessageGroup):
                group = []
                for a in step.messages:
                    located = peer_of(rank, a, pp, chunks, placement)
                    if located is None:
                        raise CommMismatchError(
                            f"rank {rank}'s {a} has no peer: it is beyond an end of the model"
                        )
                    peer, peer_chunk = located
                    send = a.kind.startswith("send")
                    group.append(
                        Op(send, peer, (a.kind[5:], a.mb, peer_chunk if send else a.chunk), str(a))
                    )
                groups.append(group)
        streams[rank] = groups
    return streams


def check_programs(programs, schedule: str = "1f1b") -> None:
    """`check` on the programs of every stage of schedule `schedule`."""
    check(program_streams(programs, placement_of(schedule)))
