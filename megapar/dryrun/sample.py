"""Which ranks a dry run rehearses.

By default a sample that covers every role a rank can have: every pipeline stage (each holds
other layers, the first the embedding, the last the head), every tp rank (its vocabulary slice,
its kv heads), and the dp ranks whose state differs: dp rank 0 (it writes the checkpoint files;
its ZeRO slices start where the buckets start), the last (its slices hold the buckets'
padding) and, under ZeRO (any stage), one in the middle (slices that start inside parameters). Each
stage is rehearsed with dp rank 0, the rank that writes the stage's file (tp ranks cycling over the
stages, and any left over on further dp-rank-0 ranks); the other dp roles follow on the stages
and tp ranks in turn. With context parallelism all of it is at cp rank 0 (the one that writes
checkpoints), plus one rank at the last cp rank (its other half of every sequence). Expert
parallelism adds no ranks and no role of its own: its ep ranks are dp x cp ranks holding
different experts of equal shapes (as a stage's tp ranks hold equal shapes), so the sample is
the layout's without experts, each dp role naming its ep rank (`sample_roles`; pp 2 x dp 2 with
ep 2: ranks 0, 1 and 3, ep ranks 0 and 1). The dry run prints which ranks and why
(`describe_choice`). `--dry-run-ranks all` takes every rank, or a comma-separated list of ranks
and ranges names them.

Rehearsals are bounded (`check_world`, `parse_ranks`). A rehearsed rank is estimated at
`S_PER_RANK` seconds (its model and schedule) plus `S_PER_RANK_OF_JOB` per rank of the job,
whose process groups it all builds (`rehearsal_seconds`; the measurements behind them:
docs/guides/planner.md, "megapar-train --dry-run"). A job of more than `MAX_DRY_RUN_WORLD`
ranks, or a choice of ranks estimated to take more than `MAX_REHEARSAL_S`, is refused with the
way to rehearse it in parts.
"""

from __future__ import annotations

from collections.abc import Collection

from megapar.mesh import Layout

MAX_DRY_RUN_WORLD = 1 << 20
"""Largest job a dry run rehearses: 1,048,576 ranks (what one rank of it costs:
docs/guides/planner.md, "megapar-train --dry-run")."""
MAX_REHEARSAL_S = 3600.0
"""Longest a dry run's ranks are estimated to take (`rehearsal_seconds`)."""
S_PER_RANK, S_PER_RANK_OF_JOB = 0.5, 30e-6
"""A rehearsed rank's measured cost here: its own, and per rank of the job (its groups)."""


def rehearsal_seconds(ranks: int, world_size: int) -> float:
    """About how long rehearsing `ranks` ranks of a `world_size`-rank job takes here."""
    return ranks * (S_PER_RANK + S_PER_RANK_OF_JOB * world_size)


def check_world(world_size: int) -> None:
    """ValueError when a job is larger than a dry run rehearses (`MAX_DRY_RUN_WORLD`)."""
    if world_size > MAX_DRY_RUN_WORLD:
        raise ValueError(
            f"--world-size {world_size} is more than a dry run rehearses ({MAX_DRY_RUN_WORLD:,}"
            f" ranks): each rehearsed rank builds all of the job's process groups (30 s and 1 GB"
            f" per rank at {MAX_DRY_RUN_WORLD:,} ranks here, growing with the size); rehearse "
            f"the same --tp / --cp / --pp with fewer dp ranks (keep --global-batch-size / dp: "
            f"every figure but the dp groups' size and ZeRO-1's slices stays the same)"
        )


def _estimate(seconds: float) -> str:
    return f"{seconds / 3600:,.1f} h" if seconds >= 3600 else f"{seconds / 60:,.0f} min"


def sample_roles(layout: Layout, zero: int = 0) -> list[tuple[int, str]]:
    """The default sample, each rank with why it is in it: every stage and tp rank with dp
    rank 0, then the other dp roles (under ep each names its ep rank: the experts it holds),
    then under cp the last cp rank."""
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    roles = [
        (
            layout.rank(i % tp, i % pp, 0),
            "dp rank 0, every stage and tp rank: the shard files' writers",
        )
        for i in range(max(tp, pp))
    ]
    others = [d for d in sorted({dp // 2, dp - 1} if zero else {dp - 1}) if d > 0]
    for i, d in enumerate(others):
        if d < dp - 1:
            why = "a middle dp rank: ZeRO slices that start inside parameters"
        elif zero:
            why = "the last dp rank: ZeRO slices holding the buckets' padding"
        else:
            why = "the last dp rank: one that writes no file"
        if layout.ep > 1:
            why += f"; ep rank {layout.ep_coords(d, 0)[0]} of {layout.ep}, its experts"
        roles.append((layout.rank((i + 1) % tp, (i + 1) % pp, d), why))
    if layout.cp > 1:
        roles.append(
            (
                layout.rank(0, pp - 1, 0, layout.cp - 1),
                "the last cp rank: the other half of every sequence",
            )
        )
    return roles


def sample_ranks(layout: Layout, zero: int = 0) -> list[int]:
    """The default sample (`sample_roles`' ranks)."""
    return [rank for rank, _ in sample_roles(layout, zero)]


def spans(ranks: list[int]) -> str:
    """Sorted ranks as a --dry-run-ranks list: runs of consecutive ranks as ranges (0-3,7)."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def describe_choice(text: str, ranks: list[int], layout: Layout, zero: int = 0) -> str:
    """Which ranks a dry run rehearses and why: the default sample's ranks grouped by their
    role (`sample_roles`), or the ranks --dry-run-ranks names."""
    n, world = len(ranks), layout.world_size
    head = f"{n:,} of {world:,} rank{'' if world == 1 else 's'}"
    if (text or "sample").strip() != "sample":
        return f"{head}: {spans(ranks)} (--dry-run-ranks {text.strip()})"
    grouped: dict[str, list[int]] = {}
    for rank, why in sample_roles(layout, zero):
        grouped.setdefault(why, []).append(rank)
    listed = "; ".join(f"{spans(sorted(r))} ({why})" for why, r in grouped.items())
    return f"{head}, the default sample: {listed}"


def parse_ranks(text: str, layout: Layout, zero: int = 0) -> list[int]:
    """--dry-run-ranks: "sample", "all" or "R1,R2,A-B,..." (ranges inclusive); ValueError
    naming the problem, also when they would take longer than `MAX_REHEARSAL_S`."""
    text = (text or "sample").strip()
    world = layout.world_size
    ranks: Collection[int]
    if text == "sample":
        ranks = sample_ranks(layout, zero)
    elif text == "all":
        ranks = range(world)
    else:
        spans = []
        for item in text.split(","):
            first, sep, last = item.partition("-")
            try:
                low = int(first)
                high = int(last) if sep else low
            except ValueError:
                raise ValueError(
                    f"--dry-run-ranks {text!r}: {item!r} is not a rank; give sample, "
                    f"all or ranks and ranges like 0,7,1023 or 0-127"
                ) from None
            for rank in (low, high):
                if not 0 <= rank < world:
                    raise ValueError(
                        f"--dry-run-ranks: rank {rank} is not in a job of "
                        f"{world} ranks (0-{world - 1})"
                    )
            if high < low:
                raise ValueError(f"--dry-run-ranks: range {item!r} is empty; write it low-high")
            spans.append(range(low, high + 1))
        listed = sum(map(len, spans))  # overlaps counted twice: a bound, before making any set
        ranks = (
            {r for span in spans for r in span}
            if rehearsal_seconds(listed, world) <= MAX_REHEARSAL_S
            else range(listed)
        )
    n = len(ranks)
    if rehearsal_seconds(n, world) > MAX_REHEARSAL_S:
        most = max(1, int(MAX_REHEARSAL_S // rehearsal_seconds(1, world)))
        shown = text if len(text) <= 40 else text[:37] + "..."
        what = "the default sample" if text == "sample" else f"--dry-run-ranks {shown}"
        fix = (
            "" if text == "sample" else "the default sample (every stage, tp rank and dp role), or "
        )
        raise ValueError(
            f"{what} is {n:,} ranks of a {world:,}-rank job, rehearsed one after another: about "
            f"{_estimate(rehearsal_seconds(n, world))} here ({S_PER_RANK:g} s per rank, plus "
            f"{S_PER_RANK_OF_JOB * 1e6:g} us per rank of the job for its process groups); one "
            f"dry run rehearses ranks for at most {_estimate(MAX_REHEARSAL_S)}, {most:,} of this "
            f"job; give {fix}fewer ranks per run, e.g. --dry-run-ranks 0-{most - 1}, then "
            f"{most}-{min(2 * most, world) - 1}, ..."
        )
    return sorted(ranks)
