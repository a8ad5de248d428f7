"""Build this rank's pipeline stage of a model: the right layers, tp shards, initialised weights."""

from __future__ import annotations

from typing import Sequence

from megapar.mesh import Mesh
from megapar.models import build_model, set_recompute
from megapar.pipeline.partition import stage_spec
from megapar.tensor_parallel import RNGTracker


def build_stage(config, mesh: Mesh, seed: int, recompute: str = "none",
                layers_per_stage: Sequence[int] | None = None, init: bool = True,
                virtual_stages: int = 1, placement: str = "loop"):
    """This rank's stage of `config` (validated against the mesh first), seeded the same in
    every layout: the full model's weights do not depend on tp or pp.

    With `virtual_stages` V > 1 (interleaved schedules) the rank holds V model chunks, returned
    as a `ModelChunks` whose parameter names are the canonical ones."""
    config.validate(mesh.layout)
    if virtual_stages > 1:
        if layers_per_stage is not None:
            raise ValueError("layers_per_stage cannot be combined with virtual stages")
        return _build_chunks(config, mesh, seed, recompute, init, virtual_stages, placement)
    spec = stage_spec(config.num_layers, mesh.pp, mesh.pp_rank, layers_per_stage)
    tracker = RNGTracker(seed, mesh) if mesh.device.type != "meta" else None
    model = build_model(config, mesh, spec.layers, spec.pre_process, spec.post_process, tracker)
    set_recompute(model, recompute)
    if init:
        model.init_weights(seed)
    return model


def _build_chunks(config, mesh, seed, recompute, init, virtual_stages, placement):
    from megapar.models.stage import ModelChunks
    from megapar.pipeline.partition import chunk_specs

    tracker = RNGTracker(seed, mesh) if mesh.device.type != "meta" else None
    chunks = []
    for spec in chunk_specs(config.num_layers, mesh.pp, mesh.pp_rank, virtual_stages, placement):
        chunk = build_model(config, mesh, spec.layers, spec.pre_process, spec.post_process,
                            tracker)
        set_recompute(chunk, recompute)
        if init:
            chunk.init_weights(seed)
        chunks.append(chunk)
    return ModelChunks(chunks)
