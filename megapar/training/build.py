"""Build this rank's pipeline stage of a model: the right layers, tp shards, initialised weights."""

from __future__ import annotations

from typing import Sequence

from megapar.mesh import Mesh
from megapar.models import build_model, set_recompute
from megapar.pipeline.partition import stage_spec
from megapar.tensor_parallel import RNGTracker


def build_stage(config, mesh: Mesh, seed: int, recompute: str = "none",
                layers_per_stage: Sequence[int] | None = None, init: bool = True):
    """This rank's stage of `config` (validated against the mesh first), seeded the same in
    every layout: the full model's weights do not depend on tp or pp."""
    config.validate(mesh.layout)
    spec = stage_spec(config.num_layers, mesh.pp, mesh.pp_rank, layers_per_stage)
    tracker = RNGTracker(seed, mesh) if mesh.device.type != "meta" else None
    model = build_model(config, mesh, spec.layers, spec.pre_process, spec.post_process, tracker)
    set_recompute(model, recompute)
    if init:
        model.init_weights(seed)
    return model
