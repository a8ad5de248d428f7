"""The diagnostics a run wires into its engine, built from their settings: straggler detection,
`--inject-slow` and `--inject-corrupt`."""

from __future__ import annotations

from typing import NamedTuple

from megapar.diagnostics import inject
from megapar.diagnostics.straggler import StragglerDetector
from megapar.faults.slow import Slowdown, SlowRank
from megapar.mesh import Mesh


class Probes(NamedTuple):
    """One rank's diagnostics; each None when off (or, for a slowdown, on another rank)."""

    straggler: StragglerDetector | None
    """Every rank's compute and wait time per step, compared once per log interval."""
    slowdown: Slowdown | None
    """`--inject-slow` (a testing tool): this rank's forwards slowed."""
    injector: inject.CorruptInjector | None
    """`--inject-corrupt` (a testing tool): the hooks that corrupt one module output."""


def build_probes(
    model,
    model_config,
    mesh: Mesh,
    straggler_factor: float,
    inject_slow: str | None,
    inject_corrupt: str | None,
) -> Probes:
    """The `Probes` of stage `model` on `mesh` for these settings (bad ones raise ValueError)."""
    if straggler_factor != 0 and not straggler_factor > 1:
        raise ValueError(
            f"straggler_factor={straggler_factor} is invalid: give a factor "
            f"> 1 (the default is 1.5), or 0 to turn straggler detection off"
        )
    straggler = (
        StragglerDetector(mesh, straggler_factor)
        if straggler_factor > 0 and mesh.layout.world_size > 1
        else None
    )
    spec = inject.from_settings(inject_corrupt)
    injector = (
        inject.CorruptInjector(
            inject.check(spec, model_config, mesh.layout), model, model_config, mesh
        )
        if spec
        else None
    )
    return Probes(straggler, _slowdown(model, mesh, inject_slow), injector)


def _slowdown(model, mesh: Mesh, spec: str | None) -> Slowdown | None:
    """--inject-slow: the named rank's forwards slowed, else None."""
    if not spec:
        return None
    slow = SlowRank.parse(spec)
    slow.check_world(mesh.layout.world_size)
    if slow.rank != mesh.rank:
        return None
    return Slowdown(slow, getattr(model, "chunks", [model]), mesh.device)
