"""Where model chunks live: how many chunks each rank holds for a schedule, virtual stages <->
(pipeline rank, chunk) round-robin ("loop") or in a V, and the neighbour a chunk's message goes to
or comes from."""

from __future__ import annotations

from megapar.pipeline.actions import Action
from megapar.wording import or_list

PLACEMENTS = ("loop", "v")
"""How a rank's chunks map to virtual stages. "loop" (Megatron's interleaving): chunk c of rank r
is virtual stage c * pp + r, so activations go 0 -> 1 -> ... -> pp-1 -> 0 for the next chunk.
"v" (ZB-V, two chunks): chunk 0 of rank r is virtual stage r, chunk 1 is 2 * pp - 1 - r."""


def virtual_stage(rank: int, chunk: int, pp: int, placement: str = "loop") -> int:
    """The virtual stage (index into the model's layer slices) of `chunk` on pp rank `rank`."""
    if placement == "v":
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return chunk * pp + rank


def stage_location(vs: int, pp: int, placement: str = "loop") -> tuple[int, int]:
    """(pp rank, chunk) holding virtual stage `vs`; inverse of `virtual_stage`."""
    if placement == "v":
        return (vs, 0) if vs < pp else (2 * pp - 1 - vs, 1)
    return vs % pp, vs // pp


def peer_of(
    rank: int, action: Action, pp: int, num_chunks: int, placement: str = "loop"
) -> tuple[int, int] | None:
    """(pp rank, chunk) a send goes to or a receive comes from; None for compute actions or
    beyond the ends of the model."""
    vs = virtual_stage(rank, action.chunk, pp, placement)
    step = {"send_act": 1, "recv_grad": 1, "recv_act": -1, "send_grad": -1}.get(action.kind)
    if step is None or not 0 <= vs + step < pp * num_chunks:
        return None
    return stage_location(vs + step, pp, placement)


CHUNKED_SCHEDULES = {"interleaved": "loop", "zb-v": "v", "dualpipev": "v"}
"""Schedules running several model chunks per rank, with their chunk placement: "loop" ones
take `virtual_stages` chunks, "v" ones exactly two (`chunks_per_rank`)."""


def chunks_per_rank(
    name: str,
    virtual_stages: int = 1,
    api: bool = False,
    flags: str = "both",
    layers: int | None = None,
    pp: int = 1,
) -> int:
    """Model chunks each rank holds for schedule `name`: `virtual_stages` for interleaved, 2 for
    the V schedules (where `virtual_stages` may be left at 1, or given as 2), 1 otherwise.
    ValueError with one line naming the fix where `virtual_stages` does not apply, worded for
    megapar-train's flags and megapar.prepare's keywords, or with `api` for the keywords only;
    `flags`: "given" / "default" for megapar-train's flags only, its --schedule given or its
    default. With the model's `layers` at `pp` stages, the fix offered is a number of chunks
    those layers hold (a chunk needs a layer), or leaving --virtual-stages out."""
    v = virtual_stages
    python = "" if flags != "both" else f" (in Python: virtual_stages={v}, schedule={name!r})"
    schedule = f"--schedule {name}" + (" (the default)" if flags == "default" else "")
    if CHUNKED_SCHEDULES.get(name) == "v":
        if v not in (1, 2):
            raise ValueError(
                f"virtual_stages={v} does not apply to schedule={name!r}: it places exactly "
                f"two model chunks per rank in a V; leave virtual_stages out, or give 2"
                if api
                else f"--virtual-stages {v} does not apply to {schedule}{python}: it places "
                f"exactly two model chunks per rank in a V (rank r holds virtual stages r and "
                f"2 pp - 1 - r); leave --virtual-stages"
                f"{' / virtual_stages' if python else ''} out, or give 2"
            )
        return 2
    if name in CHUNKED_SCHEDULES:
        return v
    if v != 1:
        most = v if layers is None else min(v, layers // max(pp, 1))  # a layer or more a chunk
        if most < v:  # the chunks the model's layers hold at this pp (a chunk needs a layer)
            held = (
                f"the model's {layers} layers at pp={pp} hold"
                if api
                else f"the model's {layers} layers at --pp {pp} hold"
            )
            if api:
                fix = "leave virtual_stages out" + (
                    f", or give schedule={' or '.join(map(repr, schedules_taking(most)))} with "
                    f"virtual_stages={most}"
                    if most >= 2
                    else ""
                )
                start = f"virtual_stages={v} with schedule={name!r}"
            else:
                fix = (
                    f"give --schedule {or_list(schedules_taking(most))} with --virtual-stages "
                    f"{most}, or leave --virtual-stages out"
                    if most >= 2
                    else "leave --virtual-stages out"
                ) + NOT_BUILT_OVER_CHUNKS.get(name, "")
                start = f"--virtual-stages {v} with {schedule}{python}"
            amount = f"{most} per rank at most" if most >= 2 else "no more than one per rank"
            raise ValueError(
                f"{start}: {name} runs one model chunk per rank, and {held} {amount}; {fix}"
            )
        takers = schedules_taking(v)
        give = "give it" if len(takers) == 1 else "give one of them"
        raise ValueError(
            f"virtual_stages={v} needs schedule={' or '.join(map(repr, takers))}; schedule="
            f"{name!r} runs one model chunk per rank: {give}, or leave virtual_stages out"
            if api
            else f"--virtual-stages {v} with {schedule}{python} needs --schedule "
            f"{or_list(takers)}: {name} runs one model chunk per rank; {give}, or leave "
            f"--virtual-stages out{NOT_BUILT_OVER_CHUNKS.get(name, '')}"
        )
    return 1


def one_stage_chunks_error(
    name: str, virtual_stages: int, pp: int, api: bool = False, layers: int | None = None
) -> str | None:
    """The one line for `virtual_stages` > 1 at `pp` 1 under a one-chunk schedule `name`
    (`chunks_per_rank` would ask for an interleaved schedule, which needs pp > 1 in turn):
    drop it; worded for megapar-train's flags, or with `api` for megapar.prepare's keywords.
    A model of `layers` layers too few for pp 2 x V chunks is offered the V it takes (no
    interleaving at all under 4). None where it does not apply."""
    v = virtual_stages
    if pp != 1 or v <= 1 or name in CHUNKED_SCHEDULES:
        return None
    most = v if layers is None else min(v, layers // 2)  # pp 2 x V chunks of a layer or more
    if api:
        fits = (
            "pp=2 or more with schedule='interleaved'"
            if layers is None
            else "pp=2, schedule='interleaved'"
            + (f", virtual_stages={most}" if most < v else "")
            + f": pp x virtual_stages at most the model's {layers} layers"
        )
        return (
            f"virtual_stages={v} cuts each pipeline stage into model chunks, and pp=1 runs no "
            f"pipeline: drop virtual_stages" + (f" (or pass {fits})" if most >= 2 else "")
        )
    fits = (
        "--pp 2 or more with --schedule interleaved"
        if layers is None
        else f"--pp 2 --schedule interleaved{f' --virtual-stages {most}' if most < v else ''}: "
        f"--pp x --virtual-stages at most the model's {layers} layers"
    )
    return (
        f"--virtual-stages {v} cuts each pipeline stage into model chunks, and --pp 1 runs no "
        f"pipeline: drop --virtual-stages" + (f" (or give {fits})" if most >= 2 else "")
    )


NOT_BUILT_OVER_CHUNKS = {
    "gpipe": " (torch's ScheduleLoopedBFS, GPipe's order over several chunks per rank, is not "
    "built)",
    "zb-h1": " (torch's ScheduleInterleavedZeroBubble over several chunks per rank is not "
    "built; zb-v is the zero-bubble schedule with two)",
}
"""What a one-chunk schedule over several chunks per rank is in torch, said where
--virtual-stages is given to it."""


def schedules_taking(virtual_stages: int) -> list[str]:
    """The schedules that run `virtual_stages` (>= 2) model chunks per rank: the "loop" ones
    any number, the V ones exactly two."""
    return [
        name
        for name, placement in CHUNKED_SCHEDULES.items()
        if placement == "loop" or virtual_stages == 2
    ]


def placement_of(name: str) -> str:
    """The chunk placement of schedule `name` ("loop" unless it places chunks in a V)."""
    return CHUNKED_SCHEDULES.get(name, "loop")
