"""megapar-plan --verify: dry-run the best layouts and print, rank by rank, where the plan's
bytes differ from the real tensors'."""

from __future__ import annotations

import sys

from megapar.dryrun.sample import MAX_REHEARSAL_S, rehearsal_seconds, sample_ranks
from megapar.dryrun.verify import verify_layout
from megapar.mesh import Layout
from megapar.wording import counted


def verify_estimates(estimates, problem) -> int:
    """Dry-run each layout and print where the plan's bytes differ (exit code 1 if anywhere);
    refused (exit code 2) when they would take longer than one dry run may."""

    seconds = sum(
        rehearsal_seconds(
            len(sample_ranks(Layout(c.tp, c.pp, c.dp, cp=c.cp), c.zero)), problem.gpus
        )
        for c in (e.candidate for e in estimates)
    )
    if seconds > MAX_REHEARSAL_S:
        print(
            f"megapar-plan: error: --verify {len(estimates)} would dry-run for about "
            f"{seconds / 60:,.0f} min here ({problem.gpus:,}-rank jobs), more than the "
            f"{MAX_REHEARSAL_S / 60:.0f} min a dry run may take; verify fewer layouts",
            file=sys.stderr,
        )
        return 2

    print(
        f"\nverifying the {len(estimates)} best layouts against dry runs (parameters, "
        f"weights, gradients, optimizer bytes, host copies, gathered units, full gradient "
        f"buffers, modelled activations, and the expert, context-parallel and ZeRO "
        f"data-parallel communication bytes of every sampled rank, and the modelled "
        f"activations and transient buffers of its stage):"
    )
    failed = False
    for i, e in enumerate(estimates, 1):
        result = verify_layout(problem, e.candidate)
        label = f"{i:>3} {e.candidate.label():<64}"
        if result.error:
            print(f"{label} megapar-train refuses it: {result.error}")
        elif result.differences:
            print(
                f"{label} {len({d[0] for d in result.differences})} of "
                f"{counted(result.ranks, 'rank')} "
                f"differ ({result.seconds:.1f} s):"
            )
            for rank, field, planned, dry in result.differences:
                print(
                    f"      rank {rank} {field}: plan {planned:,}, dry run {dry:,} "
                    f"({planned - dry:+,})"
                )
        else:
            print(
                f"{label} {counted(result.ranks, 'rank')}: equal, 0 bytes apart "
                f"({result.seconds:.1f} s)" + (f"; {result.note}" if result.note else "")
            )
        failed |= bool(result.error or result.differences)
    return 1 if failed else 0
