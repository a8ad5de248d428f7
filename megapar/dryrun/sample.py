"""Which ranks a dry run rehearses.

By default a sample that covers every role a rank can have: every pipeline stage (each holds
other layers, the first the embedding, the last the head), every tp rank (its vocabulary slice,
its kv heads) and dp ranks (ZeRO-1 slices differ; the last holds the buckets' padding): each
stage with dp rank 0, the rank that writes the stage's checkpoint file (tp ranks cycling over
the stages, and any left over on further dp-rank-0 ranks), then every other dp rank (at most
`MAX_DP_ROLES` - 1 of them, spread evenly, the last included) on the stages and tp ranks in
turn. `--dry-run-ranks all` takes every rank, or a comma-separated list names them.
"""

from __future__ import annotations

from megapar.mesh import Layout

MAX_DP_ROLES = 16
"""dp ranks the default sample covers (0 and MAX_DP_ROLES - 1 more, evenly spread)."""


def sample_ranks(layout: Layout) -> list[int]:
    """The default sample: every stage and tp rank with dp rank 0, then further dp ranks."""
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    ranks = [layout.rank(i % tp, i % pp, 0) for i in range(max(tp, pp))]
    others = range(1, dp)
    if len(others) > MAX_DP_ROLES - 1:
        n = MAX_DP_ROLES - 1
        others = sorted({1 + round(i * (dp - 2) / (n - 1)) for i in range(n)})
    ranks += [layout.rank(i % tp, i % pp, d) for i, d in enumerate(others)]
    return ranks


def parse_ranks(text: str, layout: Layout) -> list[int]:
    """--dry-run-ranks: "sample", "all" or "R1,R2,..."; ValueError naming the problem."""
    text = (text or "sample").strip()
    if text == "sample":
        return sample_ranks(layout)
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
