"""Where the first non-finite value of a failed step appeared: the module, forward or backward,
the micro-batch and the rank.

A step whose loss or gradients are not finite is never applied, so the weights, the optimizer
state and the gradient buffer's layout after it are those it started from. The engine keeps, per
step, only what else that step needs to run again (`KeptStep`: its micro-batches, which it holds
anyway, the RNG state at its start and its loss scale). When the run stops on such a step,
`locate` runs it again on every rank with a `ModuleTrace` attached (the same program, the same
messages, no data-parallel reduction) and finds the earliest non-finite event over all ranks
with three small collectives. Good steps pay nothing but the RNG state's copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megapar.diagnostics.module_trace import NONE, ModuleTrace
from megapar.diagnostics.replay import StepRecorder, record_paths
from megapar.faults.status import set_action
from megapar.mesh import broadcast_text


@dataclass
class KeptStep:
    """What a step needs to run again: kept by `Engine.run_step` for the last step."""

    micro_batches: list
    """This rank's micro-batches of the step."""
    rng: dict
    """The RNG state at the step's start (`Engine.rng_state`)."""
    step: int
    """The step's number (1 = the first)."""
    loss_scale: float
    """The scale its backward used (`Precision.backward_scale`: fp16's loss scale over
    dp)."""
    loss_weight: Any = None
    """Its micro-batches' loss weight under --loss-mean token (`training.step.loss_weight`;
    set once the step has run), else None."""


def locate(engine, kept: KeptStep | None) -> str:
    """Re-run `kept` (the failed step) with every module watched; returns one line naming the
    first non-finite value over all ranks. Collective: every rank calls it."""
    if kept is None:
        return "no step kept to re-run"
    set_action(f"re-running step {kept.step} with per-module checks (the first non-finite value)")
    trace = ModuleTrace(engine.model, engine.config, engine.mesh)
    save = getattr(engine.cfg, "save", None)
    recorder = None
    if save:  # the failed step leaves its record for --replay
        first = kept.micro_batches[0]["input_ids"].shape[0]
        recorder = StepRecorder(
            engine, len(kept.micro_batches) * first * engine.mesh.dp, trace, grads=False
        )
    where = first_over_ranks(rerun(engine, kept, trace), engine.mesh, kept.step)
    if recorder is not None:
        assert save is not None  # a recorder is made only with --save
        set_action(f"writing the record of step {kept.step}")
        recorder.write(save, kept.step)
        where += f"; its record for --replay: {record_paths(save, kept.step)[0]}"
    return where


def rerun(engine, kept: KeptStep, trace: ModuleTrace) -> ModuleTrace:
    """Run the kept step's forward and backward again with `trace` attached, without the
    data-parallel reduction and without an optimizer step; the RNG state is put back after."""
    executor = engine.executor_for(kept.micro_batches[0]["input_ids"].shape[1])
    after = engine.rng_state()
    traced, executor.trace = executor.trace, False  # keep the failed step's timeline
    engine.set_rng_state(kept.rng)
    engine.grad_sync.begin_step()  # zeroed gradients; never armed, so nothing is reduced
    engine.grad_sync.in_step = False  # nor by ZeRO-2, which reduces every micro-batch in a step
    try:
        with (
            torch.compiler.set_stance("force_eager"),  # --compile: hooks inside the blocks fire
            engine.injecting(executor, kept.step),
            trace.attached(executor),
            engine.precision.autocast(),
        ):
            executor.run(
                kept.micro_batches,
                grad_sync=None,
                loss_scale=kept.loss_scale,
                loss_weight=kept.loss_weight,
            )
    finally:
        engine.grad_sync.in_step = False
        executor.trace = traced
        engine.set_rng_state(after)
    return trace


def first_over_ranks(trace: ModuleTrace, mesh, step: int) -> str:
    """The earliest non-finite event of every rank's `trace`, as one line (the same on every
    rank): a MIN all-reduce of the keys, one of the ranks holding it, its description."""
    key = trace.first.clone()
    world = dist.is_initialized() and mesh.layout.world_size > 1
    if world:
        dist.all_reduce(key, op=dist.ReduceOp.MIN)
    first = int(key.item())
    if first == NONE:
        return (
            f"step {step} re-run with per-module checks found every module's values "
            f"finite (a fault outside the modules, one that did not repeat: a transient "
            f"hardware error, or a kernel that is not deterministic)"
        )
    mine = torch.where(trace.first == first, mesh.rank, mesh.layout.world_size)
    if world:
        dist.all_reduce(mine, op=dist.ReduceOp.MIN)
    src = int(mine.item())
    text = broadcast_text(trace.describe(first) if mesh.rank == src else "", mesh, src)
    tp, cp, pp, dp = mesh.layout.coords4(src)
    return (
        f"first non-finite value (step {step} re-run with per-module checks): {text}, "
        f"rank {src} (tp={tp} cp={cp} pp={pp} dp={dp})"
    )
