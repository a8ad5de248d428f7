"""Which ranks a dry run rehearses.

By default a sample that covers every role a rank can have: every pipeline stage (each holds
other layers, the first the embedding, the last the head), every tp rank (its vocabulary slice,
its kv heads), and the dp ranks whose state differs: dp rank 0 (it writes the checkpoint files;
its ZeRO-1 slices start where the buckets start), the last (its slices hold the buckets'
padding) and, under ZeRO-1, one in the middle (slices that start inside parameters). Each stage
is rehearsed with dp rank 0, the rank that writes the stage's file (tp ranks cycling over the
stages, and any left over on further dp-rank-0 ranks); the other dp roles follow on the stages
and tp ranks in turn. With context parallelism all of it is at cp rank 0 (the one that writes
checkpoints), plus one rank at the last cp rank (its other half of every sequence).
`--dry-run-ranks all` takes every rank, or a comma-separated list names them.
"""

from __future__ import annotations

from megapar.mesh import Layout


def sample_ranks(layout: Layout, zero: int = 0) -> list[int]:
    """The default sample: every stage and tp rank with dp rank 0, then the other dp roles."""
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    ranks = [layout.rank(i % tp, i % pp, 0) for i in range(max(tp, pp))]
    others = [d for d in sorted({dp // 2, dp - 1} if zero else {dp - 1}) if d > 0]
    ranks += [layout.rank((i + 1) % tp, (i + 1) % pp, d) for i, d in enumerate(others)]
    if layout.cp > 1:
        ranks.append(layout.rank(0, pp - 1, 0, layout.cp - 1))
    return ranks


def parse_ranks(text: str, layout: Layout, zero: int = 0) -> list[int]:
    """--dry-run-ranks: "sample", "all" or "R1,R2,..."; ValueError naming the problem."""
    text = (text or "sample").strip()
    if text == "sample":
        return sample_ranks(layout, zero)
    if text == "all":
        return list(range(layout.world_size))
    ranks = []
    for item in text.split(","):
        try:
            rank = int(item)
        except ValueError:
            raise ValueError(f"--dry-run-ranks {text!r}: {item!r} is not a rank; give sample, "
                             f"all or ranks like 0,7,1023") from None
        if not 0 <= rank < layout.world_size:
            raise ValueError(f"--dry-run-ranks: rank {rank} is not in a job of "
                             f"{layout.world_size} ranks (0-{layout.world_size - 1})")
        ranks.append(rank)
    return sorted(set(ranks))
