"""The rehearsed micro-batch: the schedule run on fake tensors with every collective counted.

`run_micro_batch` runs the executor on this rank's first micro-batch while watching the
gradient sync's launches (`_watch_launches`) and, under ZeRO-3, `ShardedParams`' gathers
(`_watch_gathers`): which counted calls happen once a micro-batch and which once a step, and
the most bytes of gathered units and full gradient buffers held at once.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch

from megapar.comm_count import Call, count_collectives
from megapar.data import collate
from megapar.dryrun.replay import replay_layers
from megapar.mesh import Layout
from megapar.pipeline.placement import chunks_per_rank
from megapar.plan.state import whole_grads
from megapar.training.batch_check import BERT_KEYS, DECODER_KEYS
from megapar.training.engine import Engine


def _micro_batch(cfg, config, dataset, first_batch):
    """The first micro-batch this rank trains on (real data), or zeros of its shapes."""

    if dataset is not None:
        return collate([dataset[i] for i in first_batch[0]])
    keys = BERT_KEYS if config.model_type == "bert" else DECODER_KEYS
    return {k: torch.zeros(cfg.micro_batch_size, cfg.seq_len, dtype=torch.long) for k in keys}


def run_micro_batch(
    cfg, config, engine: Engine, layout: Layout, m: int, dataset, first_batch
) -> tuple[list[Call], set[int], set[int], dict[str, Any]]:
    """Run the schedule on this rank's first micro-batch with every collective counted, the
    grad sync's launches watched: (the calls, the indices of those made once a step, the
    indices of the bucket reductions made once a micro-batch, ZeRO-3's peaks: `gathered`,
    `grad_buffers`)."""
    sync = engine.grad_sync
    per_step: set[int] = set()  # the bucket reductions: once a step, whatever m
    per_micro_batch_buckets: set[int] = set()  # ZeRO-2's (and ZeRO-3's per micro-batch): once a
    # micro-batch (not the deferred ones)
    run_calls: list[Call]  # the schedule's calls, recorded below
    restore = _watch_launches(sync, lambda: run_calls, per_step, per_micro_batch_buckets)
    sharded = engine.sharded_params
    peak: dict[str, Any] = {"gathered": 0, "grad_buffers": 0}
    sample = None
    if sharded is not None:  # ZeRO-3: its gathers, and the gathered units' peak
        sample = _watch_gathers(
            sharded, lambda: run_calls, per_step, per_micro_batch_buckets, peak, m
        )
    casts = engine.step_fn.fp8_weight_casts
    if casts is not None:  # --fp8: the weights' casts, once a step
        restore_casts = _watch_weight_casts(casts, lambda: run_calls, per_step)
    # identical layers: the first and last run, the ones between replay them (`replay.py`)
    restore_layers = replay_layers(
        engine, lambda: run_calls, lambda: per_step | per_micro_batch_buckets
    )
    try:
        with count_collectives() as run_calls, ExitStack() as scope:
            scope.enter_context(engine.precision.autocast())
            scope.enter_context(engine.step_fn.weights_scope())
            per_step.update(range(len(run_calls)))  # its collectives (ZeRO-3's float8 casts)
            engine.executor.run(
                [_micro_batch(cfg, config, dataset, first_batch)],
                grad_sync=sync,
                loss_scale=engine.precision.backward_scale(engine.mesh.dp),
            )
    finally:
        restore()
        restore_layers()
        if casts is not None:
            restore_casts()
    if sample is not None:  # the backward's end: every full gradient buffer not yet freed
        sample()
        if whole_grads(
            cfg.schedule,
            layout.pp,
            m,
            chunks_per_rank(cfg.schedule, cfg.virtual_stages),
            cfg.zero3_reduce,
        ):
            # the step's m micro-batches accumulate in every buffer the rehearsed one made
            peak["grad_buffers"] = max(peak["grad_buffers"], sum(peak["made"].values()))
    return run_calls, per_step, per_micro_batch_buckets, peak


def _watch_weight_casts(cache, calls, per_step: set):
    """Under --fp8 a step's first micro-batch casts each weight to float8 and the others reuse
    the cast (`Fp8WeightCache`): the calls a cast makes (its amax all-reduce over tp) go to
    `per_step`; returns the function that puts the cache's own `cast` back."""
    cast = cache.cast

    def watched(slot, make):
        before = len(calls())
        try:
            return cast(slot, make)
        finally:
            per_step.update(range(before, len(calls())))

    cache.cast = watched
    return lambda: delattr(cache, "cast")


def _watch_launches(sync, calls, per_step: set, per_micro_batch: set):
    """Rehearse the grad sync's reductions as on a GPU (NCCL reduces and gathers a sharded
    bucket whole; the fake tensors live on the CPU, where the real code would take gloo's
    bounded pieces, `shard_comm`) and watch its launches: the calls of each reduction go to
    `per_micro_batch` where the sync reduces every micro-batch (not the deferred buckets, nor
    what a W pass's report launches: that waits for the step's last W), else to `per_step`;
    returns the function that puts the sync's own launch and report back."""
    sync.host_waits = False
    launch, report = sync._launch, sync.grads_ready
    reporting: list[bool] = []  # inside a W pass's report

    def launched(bucket):
        before = len(calls())
        launch(bucket)
        every = sync.reduces_every_micro_batch and not bucket.deferred and not reporting
        (per_micro_batch if every else per_step).update(range(before, len(calls())))

    def reported(params):
        reporting.append(True)
        try:
            report(params)
        finally:
            reporting.pop()

    def restore() -> None:
        sync._launch, sync.grads_ready = launch, report

    sync._launch, sync.grads_ready = launched, reported
    return restore


def _watch_gathers(sharded, calls, per_step: set, per_micro_batch: set, peak: dict, m: int = 1):
    """Rehearse ZeRO-3's `ShardedParams` as on a GPU (each collective whole and async, as NCCL
    runs it, not gloo's synchronous pieces) and watch it: the calls of each unit's all-gather
    go to `per_micro_batch` (twice a micro-batch: forward and backward) or, for the persistent
    unit and with --zero3-keep-params (gathered once a step), to `per_step`; `peak["gathered"]`
    is the most bytes of units gathered at once (their full buffers' storages) and
    `peak["grad_buffers"]` of their full gradient buffers, held by the unit or by its
    reduce-scatter in flight (`peak["made"]`: each unit's buffer
    seen, by unit; with `m` > 1 micro-batches, the deferred units' buffers, made in the step's
    first micro-batch and kept, count as alive throughout); returns the function that samples
    them (the hooks call it)."""
    sharded.host_waits, sharded.piece = False, None
    gather, prefetch, launch = sharded.gather, sharded.prefetch, sharded._launch
    made = peak.setdefault("made", {})

    def held() -> None:
        peak["gathered"] = max(peak["gathered"], sharded.gathered_bytes())
        alive = {
            id(u): u.grad_full.untyped_storage().nbytes()
            for u in sharded.units
            if u.grad_full is not None
        }
        made.update(alive)
        flight = [u.reduce_handle.flat for u in sharded.units if u.reduce_handle is not None]
        kept = sum(
            u.padded * u.shard.element_size()
            for u in sharded.units
            if m > 1 and u.deferred and u.grad_full is None and u.reduce_handle is None
        )
        peak["grad_buffers"] = max(
            peak["grad_buffers"],
            sum(alive.values())
            + kept
            + sum(t.untyped_storage().nbytes() for t in flight if t is not None),
        )

    def launched(u) -> None:  # the unit's full gradient is complete: held until waited for
        held()
        launch(u)

    def watched(fn):
        def call(u):
            before = len(calls())
            fn(u)
            once = sharded.keep or u is sharded.persistent
            (per_step if once else per_micro_batch).update(range(before, len(calls())))
            held()

        return call

    sharded.gather, sharded.prefetch, sharded._launch = watched(gather), watched(prefetch), launched
    return held
