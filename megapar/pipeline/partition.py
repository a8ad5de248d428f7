"""Cutting a model into pipeline stages.

Stage 0 holds the embedding, the last stage the final norm and the head, and the blocks are
spread evenly by count (the first `num_layers % pp` stages take one extra), unless an explicit
per-stage layer count is given. Pure functions: no model, no processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megapar.mesh import LayoutError


@dataclass(frozen=True)
class StageSpec:
    """What one pipeline stage holds."""

    stage: int
    """Pipeline rank of the stage."""
    layers: range
    """Global indices of the blocks on this stage."""
    pre_process: bool
    """Holds the embedding (first stage)."""
    post_process: bool
    """Holds the final norm and the head (last stage)."""


def partition_layers(num_layers: int, pp: int,
                     layers_per_stage: Sequence[int] | None = None) -> list[range]:
    """The block indices of each of `pp` stages."""
    if pp < 1:
        raise LayoutError(f"--pp must be >= 1, got {pp}")
    if num_layers < pp:
        raise LayoutError(f"{num_layers} layers cannot be cut into --pp {pp} stages "
                          f"(each stage needs at least one layer); lower --pp")
    if layers_per_stage is None:
        base, extra = divmod(num_layers, pp)
        counts = [base + (1 if s < extra else 0) for s in range(pp)]
    else:
        counts = list(layers_per_stage)
        if len(counts) != pp or sum(counts) != num_layers or min(counts) < 1:
            raise LayoutError(f"layers per stage {counts} must be {pp} counts >= 1 that add up "
                              f"to the model's {num_layers} layers")
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def stage_spec(num_layers: int, pp: int, stage: int,
               layers_per_stage: Sequence[int] | None = None) -> StageSpec:
    """The StageSpec of pipeline rank `stage`."""
    ranges = partition_layers(num_layers, pp, layers_per_stage)
    return StageSpec(stage, ranges[stage], stage == 0, stage == pp - 1)


def chunk_specs(num_layers: int, pp: int, stage: int, virtual_stages: int,
                placement: str = "loop") -> list[StageSpec]:
    """The StageSpecs of the `virtual_stages` model chunks pipeline rank `stage` holds: the
    blocks are cut into pp * V slices as evenly as `partition_layers` cuts them into stages,
    and chunk c of rank r holds slice `virtual_stage(r, c, pp, placement)` (c * pp + r for
    Megatron's round-robin "loop" placement). Only the model's first slice holds the embedding
    and only its last the head."""
    from megapar.pipeline.placement import virtual_stage

    total = pp * virtual_stages
    if num_layers < total:
        raise LayoutError(f"{num_layers} layers cannot be cut into --pp {pp} x --virtual-stages "
                          f"{virtual_stages} = {total} model chunks (each needs at least one "
                          f"layer); lower --virtual-stages or --pp")
    ranges = partition_layers(num_layers, total)
    specs = []
    for chunk in range(virtual_stages):
        vs = virtual_stage(stage, chunk, pp, placement)
        specs.append(StageSpec(stage, ranges[vs], vs == 0, vs == total - 1))
    return specs
