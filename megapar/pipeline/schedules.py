"""Pipeline schedules as data: each stage runs a flat list of `Action`s, in order.

A schedule function is pure: `schedule(pp, m, stage) -> list[Action]` returns the instruction list
of one pipeline stage for one step of `m` micro-batches (like DeepSpeed's instruction lists). The
executor walks the stage's program made from it (below) and dispatches each compute on
`Action.kind`; it knows nothing about GPipe or 1F1B.

The actions (`megapar.pipeline.actions`): ``recv_act`` / ``forward`` / ``send_act`` for the
forward of micro-batch `mb` on model chunk `chunk`, ``recv_grad`` / ``backward`` / ``send_grad``
for its backward, and ``backward_input`` / ``backward_weight`` for zero-bubble schedules (below).

A schedule function lists each message next to the compute it belongs to: a receive right
before the compute that consumes it, a send right after the compute that produces it.
``send_act`` mb i on stage s matches ``recv_act`` mb i on stage s+1; ``send_grad`` on stage s
matches ``recv_grad`` on stage s-1, and both sides list a rank pair's messages in the same order.

When the messages are *issued* is decided for all stages together (`megapar.pipeline.messages`):
they go out in `MessageGroup`s, each one ``batch_isend_irecv`` call whose sends and receives
progress together, placed so that NCCL's rules hold (messages of a rank pair pair up in issue
order, one ordered stream per rank, a large send finishes only while its receive runs). A stage's
*program* is its compute actions with those groups between them, printed as
``F0 [SA0] F1 [SA1 RG0] B0 ...`` (`format_schedule`).

Model chunks and the split backward: interleaved 1F1B (each rank holds several model chunks;
`chunk` selects one, `megapar.pipeline.placement` maps it to its virtual stage and neighbours) and
zero-bubble schedules (``backward`` split into ``backward_input``, which produces the gradient to
send upstream, and ``backward_weight``, deferred to fill bubbles) are schedule functions in
`SCHEDULES` like the others; the executor's dispatch loop is the same for all. Their compute orders
equal torch.distributed.pipelining's `ScheduleInterleaved1F1B` / `ScheduleInterleavedZeroBubble`,
and those of ZB-V and DualPipeV (two chunks per rank in the "v" placement) its
`ScheduleZBVZeroBubble` / `ScheduleDualPipeV`. Between two chunks of one rank (the V's turn) a
schedule lists no message: the executor hands the tensor over in memory.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import lru_cache

# The action types and chunk placement live in their own modules; the names imported elsewhere
# from here stay importable from here (the `X as X` form marks a re-export).
from megapar.pipeline.actions import ACTION_KINDS as ACTION_KINDS
from megapar.pipeline.actions import MESSAGE_KINDS as MESSAGE_KINDS
from megapar.pipeline.actions import Action as Action
from megapar.pipeline.actions import MessageGroup as MessageGroup
from megapar.pipeline.actions import action
from megapar.pipeline.actions import format_schedule as format_schedule
from megapar.pipeline.placement import CHUNKED_SCHEDULES as CHUNKED_SCHEDULES
from megapar.pipeline.placement import chunks_per_rank as chunks_per_rank
from megapar.pipeline.placement import one_stage_chunks_error as one_stage_chunks_error
from megapar.pipeline.placement import peer_of as peer_of
from megapar.pipeline.placement import placement_of as placement_of
from megapar.pipeline.placement import stage_location as stage_location
from megapar.pipeline.placement import virtual_stage as virtual_stage


def _check_args(pp: int, m: int, stage: int) -> None:
    if not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pipeline size pp must be an integer >= 1, got {pp!r}")
    if not isinstance(m, int) or m < 1:
        raise ValueError(f"number of micro-batches m must be an integer >= 1, got {m!r}")
    if not isinstance(stage, int) or not 0 <= stage < pp:
        raise ValueError(f"stage must be an integer in [0, {pp}) for pp={pp}, got {stage!r}")


def _forward(mb: int, stage: int, pp: int) -> list[Action]:
    """recv_act (unless first stage), forward, send_act (unless last stage)."""
    actions = [] if stage == 0 else [action("recv_act", mb)]
    actions.append(action("forward", mb))
    if stage < pp - 1:
        actions.append(action("send_act", mb))
    return actions


def _backward(mb: int, stage: int, pp: int) -> list[Action]:
    """recv_grad (unless last stage), backward, send_grad (unless first stage)."""
    actions = [] if stage == pp - 1 else [action("recv_grad", mb)]
    actions.append(action("backward", mb))
    if stage > 0:
        actions.append(action("send_grad", mb))
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


def _with_comms(
    compute: list[Action], pp: int, stage: int, num_chunks: int, placement: str = "loop"
) -> list[Action]:
    """Surround each compute action with its communication: receive right before, send right
    after (as `_forward` / `_backward` do for one chunk). ``backward_weight`` communicates
    nothing."""
    last = pp * num_chunks - 1

    def remote(vs):  # a neighbour on another rank (the V's turn is on this one: in memory)
        return 0 <= vs <= last and stage_location(vs, pp, placement)[0] != stage

    around = {}  # (kind, chunk) -> (receive before, send after), each None when in memory
    for chunk in {a.chunk for a in compute}:
        vs = virtual_stage(stage, chunk, pp, placement)
        for kind, recv, send in (
            ("forward", "recv_act", "send_act"),
            ("backward", "recv_grad", "send_grad"),
            ("backward_input", "recv_grad", "send_grad"),
        ):
            step = 1 if kind == "forward" else -1
            around[kind, chunk] = (
                recv if remote(vs - step) else None,
                send if remote(vs + step) else None,
            )
    out = []
    for a in compute:
        before, after = around.get((a.kind, a.chunk), (None, None))
        if before:
            out.append(action(before, a.mb, a.chunk))
        out.append(a)
        if after:
            out.append(action(after, a.mb, a.chunk))
    return out


def _v_compute(rank_ops: list[tuple[str, int, int]], m: int) -> list[Action]:
    """Actions from (kind, mb, chunk) triples, dropping micro-batches >= m (the V orders are
    built for at least 2 pp - 1 micro-batches and trimmed, as torch does)."""
    return [action(kind, mb, chunk) for kind, mb, chunk in rank_ops if mb < m]


def _zb_v_order(pp: int, m: int, stage: int) -> list[Action]:
    """Compute order of ZB-V (Qi et al. 2024, section 6; torch's ScheduleZBVZeroBubble).

    Chunk 0 is virtual stage `stage`, chunk 1 is 2 pp - 1 - stage. Warmup: 2 (pp - stage) - 1
    forwards of chunk 0, then `stage` pairs F chunk 1 / F chunk 0, then pp - stage rounds of
    F B W on chunk 1. Steady state: F B W on chunk 0, then F B W on chunk 1, until every
    forward is issued. Cooldown: B of both chunks, then B W of chunk 0, then every deferred W.
    Built for n = max(m, 2 pp - 1) micro-batches and trimmed to m."""
    n = max(m, 2 * pp - 1)
    nxt = {(k, c): 0 for k in ("forward", "backward_input", "backward_weight") for c in (0, 1)}
    ops: list[tuple[str, int, int]] = []

    def add(kind, chunk):
        ops.append((kind, nxt[kind, chunk], chunk))
        nxt[kind, chunk] += 1

    for _ in range(2 * (pp - stage) - 1):
        add("forward", 0)
    for _ in range(stage):
        add("forward", 1)
        add("forward", 0)
    for _ in range(pp - stage):
        add("forward", 1)
        add("backward_input", 1)
        add("backward_weight", 1)
    while nxt["forward", 1] < nxt["forward", 0] or nxt["forward", 0] < n:
        if nxt["forward", 0] < n:
            add("forward", 0)
        add("backward_input", 0)
        add("backward_weight", 0)
        add("forward", 1)
        add("backward_input", 1)
        add("backward_weight", 1)
    for _ in range(stage):
        add("backward_input", 0)
        add("backward_input", 1)
    for _ in range(pp - stage):
        add("backward_input", 0)
        add("backward_weight", 0)
    for chunk in (1, 0):
        while nxt["backward_weight", chunk] < nxt["backward_input", chunk]:
            add("backward_weight", chunk)
    return _v_compute(ops, m)


def _dualpipev_order(pp: int, m: int, stage: int) -> list[Action]:
    """Compute order of DualPipeV (DeepSeek-V3's DualPipe folded onto pp ranks; torch's
    ScheduleDualPipeV). Its overlapped "F of one chunk with B of the other" pairs are listed as
    the forward followed by the full backward (one stream: see docs/guides/schedules.md); the
    last ranks' first backwards and the tail use the split B / W to fill the bubble. Needs
    m >= 2 pp."""
    nxt: dict[tuple[str, int], int] = {}
    pending_w: list[tuple[int, int]] = []  # (chunk, mb) of B without its W yet, oldest first
    ops: list[tuple[str, int, int]] = []

    def count(kind, chunk):
        k = nxt.get((kind, chunk), 0)
        nxt[kind, chunk] = k + 1
        return k

    def add(kind, chunk):
        mb = count("backward_input" if kind == "backward" else kind, chunk)
        ops.append((kind, mb, chunk))
        if kind == "backward_input":
            pending_w.append((chunk, mb))

    def weight():
        if pending_w:
            chunk, mb = pending_w.pop(0)
            ops.append(("backward_weight", mb, chunk))

    def overlap(f_chunk, b_chunk):  # torch's OVERLAP_F_B, run as F then B
        add("forward", f_chunk)
        add("backward", b_chunk)

    for _ in range(2 * (pp - stage - 1)):
        add("forward", 0)
    for _ in range(stage + 1):
        add("forward", 0)
        add("forward", 1)
    for _ in range(pp - stage - 1):
        add("backward_input", 1)
        weight()
        add("forward", 1)
    for _ in range(m - 2 * pp + stage + 1):
        overlap(0, 1)  # on the last rank the first one is not overlapped: same order
        overlap(1, 0)
    for _ in range(pp - stage - 1):
        add("backward", 1)
        overlap(1, 0)
    split = False
    for i in range(stage + 1):
        if i == (stage + 1) // 2 and stage % 2 == 1:
            split = True
        add("backward_input" if split else "backward", 1)
        if i == (stage + 1) // 2 and stage % 2 == 0:
            split = True
        add("backward_input" if split else "backward", 0)
    for _ in range(pp - stage - 1):
        weight()
        add("backward_input" if split else "backward", 0)
    for _ in range(stage + 1):
        weight()
    return [action(kind, mb, chunk) for kind, mb, chunk in ops]


def _check_v(pp: int, what: str) -> None:
    if pp < 2:
        raise ValueError(f"{what} needs --pp >= 2 (with one stage use --schedule 1f1b)")


def zb_v(pp: int, m: int, stage: int) -> list[Action]:
    """ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 6): two model
    chunks per rank placed in a V (rank r holds virtual stages r and 2 pp - 1 - r, so the
    first stage's input and the last stage's loss are both on rank 0, and the turn from
    virtual stage pp - 1 to pp is handed over in memory on rank pp - 1), each backward split
    into B and W. With t_F = t_B = t_W the bubble is near zero with 1F1B's count of activations
    (2 pp micro-batch-chunks, each half a stage, in flight on rank 0). Any m >= 1; needs
    pp >= 2 and a model of at least 2 pp layers."""
    _check_args(pp, m, stage)
    _check_v(pp, "ZB-V")
    return _with_comms(_zb_v_order(pp, m, stage), pp, stage, 2, "v")


def dualpipev(pp: int, m: int, stage: int) -> list[Action]:
    """DualPipeV (DeepSeek-V3's DualPipe on pp ranks in the V placement of `zb_v`): in the
    steady state each rank runs a forward of one chunk next to the backward of the other
    (F&B overlap, meant to hide one micro-batch's communication behind the other's compute on
    separate CUDA streams), the tail splits B and W to fill the drain. Needs pp >= 2,
    m >= 2 pp and a model of at least 2 pp layers."""
    _check_args(pp, m, stage)
    _check_v(pp, "DualPipeV")
    if m < 2 * pp:
        raise ValueError(
            f"DualPipeV needs at least 2 x pp = {2 * pp} micro-batches (one per "
            f"virtual stage), got m = {m}; use more micro-batches, or the zb-v schedule, "
            f"which takes any m"
        )
    return _with_comms(_dualpipev_order(pp, m, stage), pp, stage, 2, "v")


def interleaved_rounds(pp: int, m: int) -> int:
    """Micro-batches per round (torch's flexible rule; Megatron's is m % pp == 0); a ValueError
    naming the valid m otherwise. Cheap: the planner checks every candidate with it."""
    rounds = max(1, m // pp)
    if m % rounds:

        def valid(k: int) -> bool:
            return k % max(1, k // pp) == 0

        below = next(k for k in range(m - 1, 0, -1) if valid(k))
        above = next(k for k in range(m + 1, m + pp + 1) if valid(k))  # a multiple of pp is
        raise ValueError(
            f"interleaved 1F1B runs the {m} micro-batches in max(1, m // pp) = {rounds} rounds "
            f"of equal size, so m must be divisible by {rounds}; the nearest valid m are {below} "
            f"and {above} (every m <= pp and every multiple of pp is valid, and some others)"
        )
    return m // rounds


def _looped(pp: int, m: int, stage: int, num_chunks: int, zero_bubble: bool) -> list[Action]:
    """Compute order of interleaved 1F1B (Megatron / Narayanan et al. 2021), and with
    `zero_bubble` of its zero-bubble variant (Qi et al. 2024; ZB-H1 when num_chunks == 1).

    Forwards go round by round: `per_round` micro-batches through chunk 0, then the same ones
    through chunk 1, ...; backwards visit the chunks in reverse. Warmup runs the forwards that
    must happen before the first gradient can come back; the steady state pairs one forward with
    one backward; cooldown drains the backwards. Zero-bubble: the backward is split into B
    (input gradient, sent upstream at once) and W (weight gradient), and W of the oldest pending
    micro-batch follows each B once `stage` Bs have been issued, the rest at the end.
    """
    per_round = m if num_chunks == 1 else interleaved_rounds(pp, m)
    total = num_chunks * m
    factor = 1 if zero_bubble else 2
    warmup = min((num_chunks - 1) * per_round + factor * (pp - 1 - stage), total)
    backward = "backward_input" if zero_bubble else "backward"
    f_next, b_next, w_next = [0] * num_chunks, [0] * num_chunks, [0] * num_chunks
    done_b: list[int] = []  # chunk of every B issued, in order (W follows the same order)
    out: list[Action] = []

    def forward(k):
        chunk = (k // per_round) % num_chunks
        out.append(action("forward", f_next[chunk], chunk))
        f_next[chunk] += 1

    def backward_(k):  # k-th backward of this rank
        chunk = num_chunks - 1 - (k // per_round) % num_chunks
        out.append(action(backward, b_next[chunk], chunk))
        b_next[chunk] += 1
        done_b.append(chunk)
        if zero_bubble and k >= stage:
            weight()

    def weight():
        chunk = done_b[sum(w_next)]
        out.append(action("backward_weight", w_next[chunk], chunk))
        w_next[chunk] += 1

    # Warmup: forwards only.
    for k in range(warmup):
        forward(k)
    # Steady state: one forward, one backward (plus a W once the pipe is full).
    for k in range(total - warmup):
        forward(warmup + k)
        backward_(k)
    # Cooldown: the remaining backwards, then the deferred weight gradients.
    for k in range(total - warmup, total):
        backward_(k)
    while zero_bubble and sum(w_next) < total:
        weight()
    return out


def _check_chunks(pp: int, virtual_stages: int, what: str) -> None:
    if pp < 2:
        raise ValueError(f"{what} needs --pp >= 2 (with one stage use --schedule 1f1b)")
    if not isinstance(virtual_stages, int) or virtual_stages < 2:
        raise ValueError(
            f"{what} needs --virtual-stages >= 2 model chunks per rank, got "
            f"{virtual_stages!r}{' (its default is 1)' if virtual_stages == 1 else ''} (with "
            f"one chunk per rank use --schedule 1f1b)"
        )


def interleaved_1f1b(pp: int, m: int, stage: int, virtual_stages: int = 2) -> list[Action]:
    """Interleaved 1F1B: each rank holds `virtual_stages` (V) model chunks, assigned round-robin
    (rank r holds virtual stages r, r + pp, ...). The bubble shrinks V-fold to
    (pp-1)/(V m + pp-1) at the price of V times more point-to-point messages.

    Constraints: pp >= 2, V >= 2, and m divisible by max(1, m // pp) (any m <= pp, any multiple
    of pp). The model needs at least pp * V layers (one per virtual stage).
    """
    _check_args(pp, m, stage)
    _check_chunks(pp, virtual_stages, "interleaved 1F1B")
    return _with_comms(_looped(pp, m, stage, virtual_stages, False), pp, stage, virtual_stages)


def zb_h1(pp: int, m: int, stage: int) -> list[Action]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B's warmup and
    activation memory, with each backward split into B (d loss / d input, sent upstream at once)
    and W (d loss / d weights), W deferred into what would otherwise be the bubble. Bubble about
    a third of 1F1B's when t_F = t_B = t_W: (pp-1)(t_F + t_B - t_W) per stage."""
    _check_args(pp, m, stage)
    return _with_comms(_looped(pp, m, stage, 1, True), pp, stage, 1)


SCHEDULES: dict[str, Callable[..., list[Action]]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "zb-h1": zb_h1,
    "zb-v": zb_v,
    "dualpipev": dualpipev,
}
"""Schedule functions by name (what `--schedule` accepts), called (pp, m, stage), with the
number of chunks per rank after those for the "loop" `CHUNKED_SCHEDULES`."""

OTHER_NAMES: dict[str, str] = {
    "gpipe": "--schedule gpipe",
    "1f1b": "--schedule 1f1b",
    "pipedreamflush": "--schedule 1f1b (PipeDream-flush is 1F1B)",
    "forwardbackwardpipeliningwithoutinterleaving": "--schedule 1f1b",
    "interleaved": "--schedule interleaved --virtual-stages V",
    "interleaved1f1b": "--schedule interleaved --virtual-stages V",
    "forwardbackwardpipeliningwithinterleaving": "--schedule interleaved --virtual-stages V",
    "forwardbackwardnopipelining": "Megatron's schedule without a pipeline (every "
    "micro-batch's forward and backward on one stage), which megapar runs at --pp 1 whatever "
    "the --schedule: there drop --schedule; at --pp 2 or more choose one of its pipelines",
    "interleavedzerobubble": "--schedule zb-h1 (torch's ScheduleInterleavedZeroBubble with one "
    "stage per rank; with several chunks per rank it is not built)",
    "zerobubble": "--schedule zb-h1",
    "zbh1": "--schedule zb-h1",
    "zb1p": "--schedule zb-h1",
    "zbv": "--schedule zb-v",
    "zbvzerobubble": "--schedule zb-v",
    "dualpipev": "--schedule dualpipev",
    "dualpipe": "--schedule dualpipev (DualPipe on p ranks in a V; two-copy DualPipe is not built)",
    "loopedbfs": "no such schedule here (torch's ScheduleLoopedBFS, breadth-first over the "
    "chunks, is not built); the depth-first one is --schedule interleaved --virtual-stages V",
    "zbh2": "no such schedule here (ZB-H2 is not built); the nearest are --schedule zb-h1 and "
    "--schedule zb-v",
    "vhalf": "no such schedule here (V-Half is not built); its V placement is --schedule zb-v",
    "vmin": "no such schedule here (V-Min is not built); its V placement is --schedule zb-v",
}
"""Other tools' and papers' names for pipeline schedules (torch.distributed.pipelining's
classes, Megatron's functions, the papers' names), spelt without case, separators or a
"Schedule" prefix: what to give megapar instead (`schedule_named_elsewhere`)."""


def schedule_named_elsewhere(value: str, keywords: bool = False) -> str:
    """For a `--schedule` value megapar does not take but another tool or paper names
    (`ScheduleInterleaved1F1B`, `ZB-V`, `1F1B`, `zb_h1`), what megapar calls it: "'X' is
    megapar's --schedule interleaved --virtual-stages V" (with `keywords`, in the Python API's
    terms: "schedule='interleaved', virtual_stages=V"); "" for a name it does not know."""
    key = "".join(ch for ch in str(value).lower() if ch.isalnum())
    key = key.removeprefix("schedule")
    ours = OTHER_NAMES.get(key)
    if ours is None:
        return ""
    named = ours.startswith("--")
    if keywords:
        ours = re.sub(r"--schedule ([\w-]+)", r"schedule='\1'", ours)
        ours = ours.replace(" --virtual-stages V", ", virtual_stages=V")
    return f"{value!r} is megapar's {ours}" if named else f"{value!r}: {ours}"


SPLIT_BACKWARD = frozenset({"zb-h1", "zb-v", "dualpipev"})
"""Schedules that split every backward into B (``backward_input``) and W
(``backward_weight``): every stage has a W for each micro-batch, whatever the size."""


def schedule_actions(
    name: str, pp: int, m: int, stage: int, virtual_stages: int = 1
) -> list[Action]:
    """The action list of `stage` for schedule `name` with `virtual_stages` chunks per rank."""
    fn = get_schedule(name)
    chunks = chunks_per_rank(name, virtual_stages)
    if placement_of(name) == "loop" and name in CHUNKED_SCHEDULES:
        return fn(pp, m, stage, chunks)
    return fn(pp, m, stage)


@lru_cache(maxsize=8)
def stage_actions(
    name: str, pp: int, m: int, virtual_stages: int = 1
) -> tuple[tuple[Action, ...], ...]:
    """`schedule_actions` of every stage, as tuples, cached: the planner and the message
    programs ask for the same lists several times per (schedule, pp, m, V)."""
    return tuple(tuple(schedule_actions(name, pp, m, stage, virtual_stages)) for stage in range(pp))


def check_schedule(name: str, pp: int, m: int, virtual_stages: int = 1) -> None:
    """Raise a ValueError naming the problem if (pp, m, V) do not suit schedule `name`."""
    schedule_actions(name, pp, m, 0, virtual_stages)


def schedule_takes(name: str, pp: int, m: int, virtual_stages: int = 1) -> bool:
    """Whether schedule `name` runs `m` micro-batches at `pp` stages and V `virtual_stages`
    (`check_schedule` without its reason: for searching the m, or the sizes, that it takes)."""
    try:
        check_schedule(name, pp, m, virtual_stages)
    except ValueError:
        return False
    return True


def get_schedule(name: str) -> Callable[..., list[Action]]:
    """The schedule function called `name`; ValueError listing the valid names otherwise (and
    megapar's name for it where another tool's spelling is given)."""
    try:
        return SCHEDULES[name]
    except KeyError:
        elsewhere = schedule_named_elsewhere(name)
        raise ValueError(
            f"unknown pipeline schedule {name!r}; valid schedules: {', '.join(sorted(SCHEDULES))}"
            + (f"; {elsewhere}" if elsewhere else "")
        ) from None


@lru_cache(maxsize=4096)
def loss_in_flight(name: str, pp: int, m: int, virtual_stages: int = 1) -> int:
    """Most micro-batches whose loss is forwarded but not yet backwarded at once on the rank
    that computes it (the last virtual stage's chunk, `in_flight_peak` of its actions alone):
    1 where each loss's backward follows its forward (1F1B, ZB-H1, any schedule at pp 1 but
    GPipe's), m for GPipe. The chunked loss makes its gradients in the forward only where
    this is 1: it holds the head's fp32 weight gradient per loss in flight."""
    chunks = chunks_per_rank(name, virtual_stages)
    rank, chunk = stage_location(pp * chunks - 1, pp, placement_of(name))
    actions = schedule_actions(name, pp, m, rank, virtual_stages)  # that rank's alone
    return in_flight_peak([a for a in actions if a.chunk == chunk])


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
