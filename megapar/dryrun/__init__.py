"""Rehearse a cluster job on one CPU process: `megapar-train --dry-run --world-size N`.

For a sample of the job's ranks (or all of them), one after another in this process, the real
start-up and one step's bookkeeping run on torch's fake process group and fake tensors
(`world.py`): no communication, no tensor memory, the real mesh and rank order, model stage,
partition, ZeRO slices and ZeRO-3 units, gradient buckets, pipeline schedule and checkpoint files
(`rank.py`; the rehearsed micro-batch, its collectives counted: `watch.py`; the layers between
the first and last of a stack of identical ones replay their recorded effect: `replay.py`).
Which ranks: `sample.py`. What is printed: `report.py`. `megapar-plan --verify` compares the
planner's bytes with these.

The package sits above `training` (it runs the engine) beside `plan` on one layer, reading the
planner's activation model; only the command-line tools import it. `dry_run`: the sampled
ranks rehearsed and their reports returned, as `megapar-plan --verify` calls it (megapar-train's
`--dry-run` prints them as it goes: `command.py`).
"""

from megapar.dryrun.rank import NOT_RUN, RankReport, rehearse_rank
from megapar.dryrun.sample import parse_ranks, sample_ranks

__all__ = ["NOT_RUN", "RankReport", "dry_run", "parse_ranks", "rehearse_rank", "sample_ranks"]


def dry_run(
    cfg, config, layout, ranks=None, gpus_per_node: int = 8, dataset=None, order=None
) -> list[RankReport]:
    """Rehearse `ranks` (default: `sample_ranks`) of a job of `layout` running `cfg`
    on model `config` (`dataset`, `order`: `rehearse_rank`'s)."""
    return [
        rehearse_rank(cfg, config, layout, rank, gpus_per_node, dataset, order)
        for rank in (sample_ranks(layout, cfg.zero) if ranks is None else ranks)
    ]
