"""Cutting a model into pipeline stages, and building this rank's stage.

Stage 0 holds the embedding, the last stage the final norm and the head, and the blocks are
spread evenly by count (the first `num_layers % pp` stages take one extra: `stage_spec`,
`chunk_specs`, pure functions). `build_stage` builds the stage (or the model chunks) of a
rank from them, initialised the same in every layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from megapar.mesh import LayoutError, Mesh
from megapar.models import build_model, set_recompute
from megapar.models.stage import ModelChunks
from megapar.pipeline.placement import virtual_stage
from megapar.tensor_parallel import RNGTracker


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


def partition_layers(num_layers: int, pp: int) -> list[range]:
    """The block indices of each of `pp` stages."""
    if pp < 1:
        raise LayoutError(f"--pp must be >= 1, got {pp}")
    if num_layers < pp:
        raise LayoutError(
            f"{num_layers} layers cannot be cut into --pp {pp} stages "
            f"(each stage needs at least one layer); lower --pp"
        )
    base, extra = divmod(num_layers, pp)
    counts = [base + (1 if s < extra else 0) for s in range(pp)]
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


@lru_cache(maxsize=1024)
def _even_cut(num_layers: int, pp: int) -> tuple[range, ...]:
    """`partition_layers`, cached (the planner asks for each stage's
    chunks of thousands of layouts)."""
    return tuple(partition_layers(num_layers, pp))


def stage_spec(num_layers: int, pp: int, stage: int) -> StageSpec:
    """The StageSpec of pipeline rank `stage`."""
    ranges = partition_layers(num_layers, pp)
    return StageSpec(stage, ranges[stage], stage == 0, stage == pp - 1)


def chunk_specs(
    num_layers: int, pp: int, stage: int, virtual_stages: int, placement: str = "loop"
) -> list[StageSpec]:
    """The StageSpecs of the `virtual_stages` model chunks pipeline rank `stage` holds: the
    blocks are cut into pp * V slices as evenly as `partition_layers` cuts them into stages,
    and chunk c of rank r holds slice `virtual_stage(r, c, pp, placement)` (c * pp + r for
    Megatron's round-robin "loop" placement). Only the model's first slice holds the embedding
    and only its last the head."""

    total = pp * virtual_stages
    if num_layers < total and placement == "v":  # two chunks per rank, whatever V says
        raise LayoutError(
            f"{num_layers} layers cannot be cut into 2 x --pp {pp} = {total} model chunks "
            f"(zb-v and dualpipev place two per rank in a V; each needs at least one layer); "
            f"lower --pp to {num_layers // 2} or less, or use a schedule with one chunk per "
            f"rank (1f1b, zb-h1)"
        )
    if num_layers < total:
        raise LayoutError(
            f"{num_layers} layers cannot be cut into --pp {pp} x --virtual-stages "
            f"{virtual_stages} = {total} model chunks (each needs at least one "
            f"layer); lower --virtual-stages or --pp"
        )
    ranges = _even_cut(num_layers, total)
    specs = []
    for chunk in range(virtual_stages):
        vs = virtual_stage(stage, chunk, pp, placement)
        specs.append(StageSpec(stage, ranges[vs], vs == 0, vs == total - 1))
    return specs


def build_stage(
    config,
    mesh: Mesh,
    seed: int,
    recompute: str = "none",
    init: bool = True,
    virtual_stages: int = 1,
    placement: str = "loop",
):
    """This rank's stage of `config` (validated against the mesh first), seeded the same in
    every layout: the full model's weights do not depend on tp or pp.

    With `virtual_stages` V > 1 (interleaved schedules) the rank holds V model chunks, returned
    as a `ModelChunks` whose parameter names are the canonical ones."""
    config.validate(mesh.layout)
    if virtual_stages > 1:
        return _build_chunks(config, mesh, seed, recompute, init, virtual_stages, placement)
    spec = stage_spec(config.num_layers, mesh.pp, mesh.pp_rank)
    tracker = RNGTracker(seed, mesh) if mesh.device.type != "meta" else None
    model = build_model(config, mesh, spec.layers, spec.pre_process, spec.post_process, tracker)
    set_recompute(model, recompute)
    if init:
        model.init_weights(seed)
    return model


def _build_chunks(config, mesh, seed, recompute, init, virtual_stages, placement):
    tracker = RNGTracker(seed, mesh) if mesh.device.type != "meta" else None
    chunks = []
    for spec in chunk_specs(config.num_layers, mesh.pp, mesh.pp_rank, virtual_stages, placement):
        chunk = build_model(config, mesh, spec.layers, spec.pre_process, spec.post_process, tracker)
        set_recompute(chunk, recompute)
        if init:
            chunk.init_weights(seed)
        chunks.append(chunk)
    return ModelChunks(chunks)
