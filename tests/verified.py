"""`verified(problem, candidate, ranks)`: what `megapar-plan --verify` finds for a layout, with
the reports of the dry run it compared against the plan, for tests that check those reports
further instead of rehearsing the same ranks of the same job a second time."""

from __future__ import annotations

from unittest import mock


def verified(problem, c, ranks=None):
    """(`verify_layout(problem, c, ranks)`, the `RankReport`s of the one dry run it made). The
    dry run is checked to be `dry_run(train_config(problem, c), problem.config, Layout(c.tp,
    c.pp, c.dp, cp=c.cp, ep=c.ep), ranks or sample_ranks(layout, c.zero))`: the job's own."""
    import megapar.dryrun.verify as verify
    from megapar.dryrun import sample_ranks
    from megapar.mesh import Layout

    calls = []
    real = verify.dry_run

    def recorded(*args, **kwargs):
        calls.append((args, kwargs, real(*args, **kwargs)))
        return calls[-1][2]

    with mock.patch.object(verify, "dry_run", recorded):
        result = verify.verify_layout(problem, c, ranks)
    [(args, _, reports)] = calls
    layout = Layout(c.tp, c.pp, c.dp, cp=c.cp, ep=c.ep)
    assert args[:4] == (verify.train_config(problem, c), problem.config, layout,
                        sample_ranks(layout, c.zero) if ranks is None else ranks)
    assert [r.rank for r in reports] == list(args[3])
    return result, reports
