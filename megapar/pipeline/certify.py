"""The certificate of the pipeline's message programs: for every schedule in `SCHEDULES` over
a grid of (pp, m, V), what the executor runs (`messages.programs`) is checked against NCCL's
rules and against the schedule's own published claims.

`certify(schedule, pp, m, virtual_stages, forward_only)` checks the programs of all stages of
one training (or evaluation) step and returns a `Certificate` with one `Check` per property:

- ``computes``: each program runs its schedule's computes, in the schedule's order;
- ``data order``: every message is sent once and received once; a send comes after the compute
  that produces its tensor, a receive before the compute that consumes it;
- ``paired``: for every ordered rank pair, the k-th send pairs with the peer's k-th receive and
  both describe the same message (kind, micro-batch, chunk): NCCL pairs by issue order and
  ignores tags (`nccl_rules.check`);
- ``progress``: every rank's group calls complete under zero buffering, a send finishing only
  while its receive runs, one group at a time per rank (`nccl_rules.check`): no deadlock;
- ``pairs``: the messages a rank holds per peer (sends not yet proven received, receives not
  yet consumed, as the executor holds them) stay within `PAIR_BOUND`;
- ``activations``: the micro-batches in flight per rank (forward done, backward not), counted
  on the program as the executor holds them (`messages.held`), equal `schedules.in_flight_peak`
  of the schedule and stay within the schedule's published bound (`IN_FLIGHT_BOUNDS`).

`certify_real.check_real_steps(certificates)` adds ``real step``: each certified step run on
real processes, its issued groups compared with the certified programs and held to NCCL's rules
with their real sizes. `certify_grid` / `format_table` are what ``megapar-bubble --certify``
prints; docs/guides/certificate.md says what this proves and what it does not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from megapar.pipeline import messages, nccl_rules
from megapar.pipeline.actions import Action, MessageGroup
from megapar.pipeline.placement import chunks_per_rank, peer_of, placement_of
from megapar.pipeline.schedules import (
    MESSAGE_KINDS,
    SCHEDULES,
    check_schedule,
    in_flight_peak,
    interleaved_rounds,
    schedule_actions,
    schedule_takes,
)
from megapar.wording import counted

Bound = Callable[[int, int, int, int], int]

IN_FLIGHT_BOUNDS: dict[str, tuple[str, Bound]] = {
    "gpipe": ("m", lambda pp, m, s, v: m),
    "1f1b": ("min(m, pp - s)", lambda pp, m, s, v: min(m, pp - s)),
    "zb-h1": ("min(m, pp - s)", lambda pp, m, s, v: min(m, pp - s)),
    "interleaved": (
        "min(V m, (V-1) r + 2 (pp-1-s) + 1), r micro-batches per round",
        lambda pp, m, s, v: min(v * m, (v - 1) * interleaved_rounds(pp, m) + 2 * (pp - 1 - s) + 1),
    ),
    "zb-v": (
        "min(2m, 2 pp): 1F1B's pp whole-stage micro-batches in half-stage chunks",
        lambda pp, m, s, v: min(2 * m, 2 * pp),
    ),
    "dualpipev": (
        "min(2m, 2 pp + 1): DualPipe's PP+1 per device, PP = 2 pp stages",
        lambda pp, m, s, v: min(2 * m, 2 * pp + 1),
    ),
}
"""Each schedule's published bound on the micro-batches in flight on stage s, counted per
model chunk (a micro-batch in flight on two chunks counts twice): (the formula, as text; the
function of (pp, m, s, V)). GPipe, 1F1B and interleaved: Narayanan et al. 2021 (Megatron's
warmup count plus one); ZB-H1: 1F1B's (Qi et al. 2024); ZB-V: 1F1B's memory (Qi et al. 2024);
DualPipeV: DeepSeek's DualPipe table. A schedule without an entry fails the certificate."""

PAIR_BOUND = (
    "per peer: sends, receives <= A(s) + C; in an evaluation step, a rank whose sends no "
    "message comes back to acknowledge holds them to the step's end, and its receives alone "
    "are bounded"
)
"""The stated bound on the messages stage s holds for one peer, each way: A(s) is the
schedule's activation bound (`IN_FLIGHT_BOUNDS`), C the model chunks per rank. A send is held
until a later message proves it received (`messages.acknowledgements`) or until the step's
end, a receive until its compute takes it. In an evaluation step most ranks get no message
back (a V placement's turn and interleaved's loop at pp 2 do), so their sends are all held to
the end: counted, not bounded (any bound on them would be their number, and could not fail);
every receive is still held to A(s) + C."""

CHECKS = ("computes", "data order", "paired", "progress", "pairs", "activations")
"""The checks `certify` makes, in order (`certify_real.check_real_steps` adds "real step")."""

GRID_PP = (2, 3, 4, 8)
GRID_M = (1, 2, 3, 4, 5, 6, 8, 16)
GRID_V = (1, 2, 3)
"""The default grid: every schedule at every (pp, m, V) of these that it accepts."""


@dataclass
class Check:
    """One property of one certificate: whether it holds, and what was found."""

    ok: bool
    detail: str = ""


@dataclass
class Certificate:
    """What was checked about one (schedule, pp, m, V) step's programs, and the numbers."""

    schedule: str
    pp: int
    m: int
    virtual_stages: int
    forward_only: bool
    checks: dict[str, Check] = field(default_factory=dict)
    """By name (`CHECKS`, and "real step" once `check_real_steps` ran)."""
    in_flight: tuple[int, ...] = ()
    """Per rank, the peak micro-batches in flight, per chunk (training steps)."""
    in_flight_bound: tuple[int, ...] = ()
    """Per rank, the published bound on them."""
    pair_sends: int = 0
    """Most sends any rank holds for one peer."""
    pair_recvs: int = 0
    """Most receives any rank holds from one peer."""
    programs: tuple = ()
    """The certified programs (`messages.programs`), one per stage."""

    @property
    def ok(self) -> bool:
        """Every check made holds (and at least one was made)."""
        return bool(self.checks) and all(c.ok for c in self.checks.values())

    @property
    def failures(self) -> list[str]:
        """ "name: detail" of every failed check."""
        return [f"{name}: {c.detail}" for name, c in self.checks.items() if not c.ok]

    @property
    def chunks(self) -> int:
        """Model chunks per rank (`placement.chunks_per_rank`: 2 for the V schedules whatever
        `virtual_stages` says)."""
        return chunks_per_rank(self.schedule, self.virtual_stages)

    @property
    def name(self) -> str:
        v = f" V={self.chunks}" if self.chunks > 1 else ""
        return f"{self.schedule}{v} pp={self.pp} m={self.m}" + (
            " eval" if self.forward_only else ""
        )


def certify(
    schedule: str, pp: int, m: int, virtual_stages: int = 1, forward_only: bool = False
) -> Certificate:
    """The certificate of the programs the executor runs for this step (see the module
    docstring); a ValueError if the schedule refuses (pp, m, V)."""
    check_schedule(schedule, pp, m, virtual_stages)
    programs = messages.programs(schedule, pp, m, virtual_stages, forward_only)
    return certify_programs(programs, schedule, pp, m, virtual_stages, forward_only)


def certify_programs(
    programs, schedule: str, pp: int, m: int, virtual_stages: int = 1, forward_only: bool = False
) -> Certificate:
    """The certificate of `programs` (one per stage) for that step: `certify` on programs given
    rather than built, e.g. a deliberately broken one."""
    cert = Certificate(schedule, pp, m, virtual_stages, forward_only, programs=tuple(programs))
    placement = placement_of(schedule)
    chunks = 1 + max((a.chunk for p in programs for a in program_actions(p)), default=0)

    def peer(rank, a):
        return peer_of(rank, a, pp, chunks, placement)

    schedules = [schedule_actions(schedule, pp, m, s, virtual_stages) for s in range(pp)]
    if forward_only:
        schedules = [[a for a in s if a.kind in messages.FORWARD_KINDS] for s in schedules]
    cert.checks["computes"] = _computes(programs, schedules)
    cert.checks["data order"] = _data_order(programs, peer)
    try:
        nccl_rules.check(nccl_rules.program_streams(programs, placement))
        cert.checks["paired"] = Check(True, "k-th send = peer's k-th receive, every pair")
        cert.checks["progress"] = Check(True, "every group completes with zero buffering")
    except nccl_rules.CommMismatchError as exc:
        cert.checks["paired"] = Check(False, str(exc))
        cert.checks["progress"] = Check(False, "not checked: the messages do not pair")
    except nccl_rules.DeadlockError as exc:
        cert.checks["paired"] = Check(True, "k-th send = peer's k-th receive, every pair")
        cert.checks["progress"] = Check(False, str(exc))
    if not (cert.checks["data order"].ok and cert.checks["paired"].ok):
        reason = "not checked: the programs' messages are inconsistent"
        cert.checks["pairs"] = cert.checks["activations"] = Check(False, reason)
        return cert
    bound = IN_FLIGHT_BOUNDS.get(schedule)
    if bound is None:
        missing = (
            f"schedule {schedule!r} states no bound on its activations in flight; add "
            f"its published one to megapar.pipeline.certify.IN_FLIGHT_BOUNDS"
        )
        cert.checks["pairs"] = cert.checks["activations"] = Check(False, missing)
        return cert
    cert.in_flight_bound = tuple(bound[1](pp, m, s, virtual_stages) for s in range(pp))
    cert.checks["pairs"] = _pairs(cert, programs, peer, chunks)
    cert.checks["activations"] = (
        Check(True, "no backward: nothing is kept for one")
        if forward_only
        else _activations(cert, programs, schedules, placement, bound[0])
    )
    return cert


def program_actions(step_or_program):
    """The actions of a step or program, its message groups opened."""
    for step in step_or_program:
        yield from step.messages if isinstance(step, MessageGroup) else (step,)


def _computes(programs, schedules) -> Check:
    for stage, (program, actions) in enumerate(zip(programs, schedules)):
        want = [a for a in actions if a.kind not in MESSAGE_KINDS]
        if messages.computes_of(program) != want:
            return Check(
                False,
                f"stage {stage}'s program runs its computes in another order than its schedule",
            )
    return Check(True, "the schedule's computes, in its order")


def _producer(kind: str) -> tuple[str, ...]:
    """The compute kinds whose result a send of `kind` carries (those that consume the
    matching receive on the other side)."""
    return messages.CONSUMERS["recv" + kind[4:]]


def _data_order(programs, peer) -> Check:
    for rank, program in enumerate(programs):
        done, issued = set(), set()
        for step in program:
            if isinstance(step, MessageGroup):
                for a in step.messages:
                    key = (a.kind, a.mb, a.chunk)
                    if key in issued:
                        return Check(False, f"rank {rank} issues {a} twice")
                    issued.add(key)
                    if peer(rank, a) is None or peer(rank, a)[0] == rank:
                        return Check(
                            False, f"rank {rank} issues {a}, which has no peer on another rank"
                        )
                    if a.kind.startswith("send") and not any(
                        (kind, a.mb, a.chunk) in done for kind in _producer(a.kind)
                    ):
                        return Check(
                            False, f"rank {rank} issues {a} before the compute that produces it"
                        )
                continue
            for recv in messages.CONSUMERS:
                message = Action(recv, step.mb, step.chunk)
                other = peer(rank, message)
                if (
                    messages.consumes(step, message)
                    and other is not None
                    and other[0] != rank  # a hand-off between chunks of one rank: no message
                    and (recv, step.mb, step.chunk) not in issued
                ):
                    return Check(
                        False,
                        f"rank {rank} runs {step} before issuing {message}, the "
                        f"receive it consumes",
                    )
            done.add((step.kind, step.mb, step.chunk))
    return Check(True, "sent after produced, received before consumed, each once")


def _pairs(cert: Certificate, programs, peer, chunks: int) -> Check:
    """Messages held per (rank, peer), walked as the executor holds them (`PAIR_BOUND`)."""
    held_to_end = False  # an evaluation step's rank whose sends no message acknowledges
    for rank, program in enumerate(programs):
        acks = messages.acknowledgements(programs, rank, peer)
        sends: dict[int, set] = {}
        recvs: dict[int, set] = {}
        most = [0, 0]  # sends, receives held for one peer
        for step in program:
            if isinstance(step, MessageGroup):
                for a in step.messages:
                    held = sends if a.kind.startswith("send") else recvs
                    held.setdefault(peer(rank, a)[0], set()).add((a.kind, a.mb, a.chunk))
            else:
                for held_recvs in recvs.values():
                    for kind in messages.CONSUMERS:
                        key = (kind, step.mb, step.chunk)
                        if key in held_recvs and messages.consumes(step, Action(*key)):
                            held_recvs.discard(key)
                            for held_sends in sends.values():
                                held_sends.difference_update(acks.get(key, ()))
            most = [
                max(most[0], *map(len, sends.values()), 0),
                max(most[1], *map(len, recvs.values()), 0),
            ]
        cert.pair_sends, cert.pair_recvs = (
            max(cert.pair_sends, most[0]),
            max(cert.pair_recvs, most[1]),
        )
        limit = cert.in_flight_bound[rank] + chunks
        unacked = cert.forward_only and not acks  # its sends are held to the step's end
        held_to_end |= unacked
        for what, n in zip(("sends", "receives"), most):
            if n > limit and not (what == "sends" and unacked):
                return Check(
                    False,
                    f"rank {rank} holds {n} {what} for one peer, more than the "
                    f"stated {limit} ({PAIR_BOUND})",
                )
    to_end = " (sends to the step's end where no message comes back)" if held_to_end else ""
    return Check(
        True,
        f"at most {cert.pair_sends} sends and {cert.pair_recvs} receives held per peer{to_end}",
    )


def _activations(cert: Certificate, programs, schedules, placement: str, formula: str) -> Check:
    peaks = []
    for stage, actions in enumerate(schedules):
        held = messages.held(tuple(programs), stage, placement)
        peak = max((sum(counts) for counts, _ in held), default=0)
        published = in_flight_peak(actions)
        if peak != published:
            return Check(
                False,
                f"stage {stage}: {peak} micro-batches in flight as the program "
                f"runs, {published} by the schedule (in_flight_peak)",
            )
        if peak > cert.in_flight_bound[stage]:
            return Check(
                False,
                f"stage {stage}: {peak} micro-batches in flight, more than the "
                f"published {formula} = {cert.in_flight_bound[stage]}",
            )
        peaks.append(peak)
    cert.in_flight = tuple(peaks)
    return Check(True, f"per stage {list(peaks)} <= {formula}")


# --- the grid -------------------------------------------------------------------------------
def grid(schedules=None, pps=GRID_PP, ms=GRID_M, vs=GRID_V) -> list[tuple[str, int, int, int]]:
    """Every (schedule, pp, m, V) of the grid the schedule accepts (`check_schedule`), for
    every schedule in `SCHEDULES` unless `schedules` names some; a V-placement schedule (always
    two chunks) once, at V 1."""
    points = []
    for name in schedules or SCHEDULES:
        for v in vs:
            if placement_of(name) == "v" and v != 1 and 1 in vs:
                continue  # two chunks whatever V says: V 1 and 2 are the same programs
            for pp in pps:
                for m in ms:
                    if schedule_takes(name, pp, m, v):
                        points.append((name, pp, m, v))
    return points


def certify_grid(points) -> list[Certificate]:
    """`certify` at every point, for a training step and an evaluation step."""
    return [
        certify(name, pp, m, v, forward_only)
        for name, pp, m, v in points
        for forward_only in (False, True)
    ]


def missing_schedules(points, schedules=None) -> list[str]:
    """Schedules of `SCHEDULES` (or of `schedules`, where it names some) with no point in
    `points` (the grid certifies nothing of them)."""
    return [name for name in schedules or SCHEDULES if not any(p[0] == name for p in points)]


def format_table(certs: list[Certificate]) -> str:
    """One row per (schedule, V, pp): the m certified, each check's verdict over them, the
    activation peaks and held messages. V is the model chunks per rank
    (`placement.chunks_per_rank`: 2 for the V schedules)."""
    rows: dict[tuple, list[Certificate]] = {}
    for c in certs:
        rows.setdefault((c.schedule, c.chunks, c.pp), []).append(c)
    names = [*CHECKS, "real step"]
    head = (
        f"{'schedule':12} {'V':>2} {'pp':>3} {'m':18} | "
        + " ".join(f"{n:>11}" for n in names)
        + f" | {'in flight <= bound':22} | "
        f"held per peer: training | eval"
    )
    lines = [head, "-" * len(head)]
    for (name, v, pp), group in rows.items():
        ms = sorted({c.m for c in group})
        verdicts = []
        for n in names:
            made = [c.checks[n] for c in group if n in c.checks]
            verdicts.append(
                "-"
                if not made
                else "ok"
                if all(k.ok for k in made)
                else f"FAIL {sum(not k.ok for k in made)}"
            )
        train = [c for c in group if not c.forward_only and c.in_flight]
        top = max(train, key=lambda c: c.m, default=None)
        flight = "-"
        if top:
            s = max(range(pp), key=lambda s: top.in_flight[s])
            flight = f"{top.in_flight[s]} <= {top.in_flight_bound[s]} (m={top.m}, s={s})"
        pairs = " | ".join(
            f"{max((c.pair_sends for c in part), default=0)}S "
            f"{max((c.pair_recvs for c in part), default=0)}R"
            for part in (
                [c for c in group if not c.forward_only],
                [c for c in group if c.forward_only],
            )
        )
        lines.append(
            f"{name:12} {v:2d} {pp:3d} {','.join(map(str, ms)):18} | "
            + " ".join(f"{x:>11}" for x in verdicts)
            + f" | {flight:22} | {pairs}"
        )
    failed = [c for c in certs if not c.ok]
    lines.append(
        f"{len(certs) - len(failed)} of {counted(len(certs), 'step')} certified (training and "
        f"evaluation); in flight: the stage with the most micro-batches in flight (per "
        f"chunk) at the largest m; held per peer: the most sends (S) / receives (R) a "
        f"rank holds for one peer (in evaluation, sends no message acknowledges are held to "
        f"the step's end: counted, not bounded)"
    )
    for c in failed:
        for failure in c.failures:
            lines.append(f"FAIL {c.name}: {failure}")
    return "\n".join(lines)
