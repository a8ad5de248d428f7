"""`megapar-train --dry-run`: rehearse the validated job rank by rank and print what each holds.

`megapar.cli.train` validates the run exactly as for a real job (the same checks, the same
one-line errors, exit code 2) with the job's --world-size as the world, then hands over here.
A rank whose start-up or step fails in the rehearsal fails the way a worker of the job would:
one line naming the rank and the error (exit code 1; --debug adds the traceback).
"""

from __future__ import annotations

import json
import sys
import time
import traceback

from megapar.checkpoint.distributed import missing_rng_note, other_layout_rng_note
from megapar.checkpoint.format import RNG_FILE
from megapar.checkpoint.manifest import read_manifest
from megapar.dryrun import parse_ranks, rehearse_rank, report
from megapar.dryrun.modelled import planned_bubble
from megapar.dryrun.sample import describe_choice
from megapar.mesh import Layout
from megapar.models.config import config_from_dict
from megapar.optim.scheduler import LRScheduler, changed_fields, resume_change
from megapar.plan.params import model_params
from megapar.training.data import build_datasets, continue_order, make_sampler
from megapar.training.engine import Engine
from megapar.training.loop import tp_across_nodes
from megapar.training.resume import resume_phrase, rng_notes


def first_save_step(cfg, start: int) -> int:
    """The step the run's first save writes, as the training loop saves: the first multiple of
    --save-interval after `start` (the step a resumed run starts from) and before --max-steps,
    else --max-steps (the save at the end)."""
    if cfg.save_interval > 0:
        step = (start // cfg.save_interval + 1) * cfg.save_interval
        if step < cfg.max_steps:
            return step
    return cfg.max_steps


def resume_notes(cfg, config, layout: Layout, manifest: dict) -> list[str]:
    """The lines a run resumed from --load starts with (`Trainer._resume`), from its manifest:
    the layout it comes from and the settings it changes, the RNG states it cannot restore,
    and a learning-rate schedule the flags change."""
    meta, step = manifest.get("meta") or {}, int(manifest["step"])
    saved = Layout(**manifest["layout"])
    resharded = (saved.tp, saved.pp) != (layout.tp, layout.pp)  # as `load_checkpoint` finds
    how = resume_phrase(saved, layout, resharded, meta.get("train_config") or {}, cfg)
    notes = []  # in the run's order: the schedule, the resume, the RNG states
    schedule, planned = meta.get("scheduler"), Engine.flags_schedule(cfg)
    if schedule and schedule != planned.state_dict():
        notes.append(
            "learning-rate schedule follows the flags, not the checkpoint: "
            + changed_fields(schedule, planned.state_dict())
            + resume_change(
                LRScheduler(**schedule), planned, step, int(meta.get("schedule_step", step))
            )
        )
    notes.append(f"dry run: the run resumes from {cfg.load} at step {step} ({how})")
    if RNG_FILE not in manifest["files"]:
        notes.append(missing_rng_note(meta))
    elif resharded or saved != layout:
        notes.append(other_layout_rng_note(saved, layout))
    return rng_notes(notes, config.draws_dropout)


def rehearse(cfg, layout, plan, notes: list[str]) -> int:
    """Rehearse the ranks --dry-run-ranks names; print each as it is done. Returns the exit code."""

    config = config_from_dict(plan.model_config)
    try:
        ranks = parse_ranks(cfg.dry_run_ranks, layout, cfg.zero)
    except ValueError as exc:
        print(f"megapar-train: error: {exc}", file=sys.stderr)
        return 2
    dataset = None
    if plan.prefix is not None:
        dataset, _ = build_datasets(cfg, plan.prefix, config.model_type)
        if plan.sampler_state:  # resuming: the batches are the checkpoint's next ones
            sampler = make_sampler(cfg, dataset, layout.dp, 0)
            notes.extend(continue_order(cfg, sampler, plan.sampler_state))
            epoch, sample = sampler.position
            notes.append(
                f"dry run: the first batch shown is the one the resumed run trains on next "
                f"(--load's data order: sample {sample} of epoch {epoch})"
            )
    if cfg.load and plan.checked_load is not None:  # resuming
        notes.extend(resume_notes(cfg, config, layout, read_manifest(plan.checked_load)))
    spans = tp_across_nodes(layout, cfg.gpus_per_node, " (--gpus-per-node)")
    if spans:
        notes.append(f"dry run: {spans}")
    mask = report.documents_note(cfg)
    for note in notes + ([mask] if mask else []):
        print(f"megapar-train: {note}", file=sys.stderr)
    step_dir = f"{cfg.save or '<--save>'}/step_{first_save_step(cfg, plan.start_step):08d}"
    out = sys.stdout
    bubble = planned_bubble(cfg, config, layout) if layout.pp > 1 else None
    if not cfg.json:
        print(
            report.describe_job(
                cfg,
                config,
                layout,
                cfg.gpus_per_node,
                model_params(config),
                describe_choice(cfg.dry_run_ranks, ranks, layout, cfg.zero),
            ),
            file=out,
            flush=True,
        )
        if bubble is not None:
            print(report.describe_bubble(*bubble, cfg.schedule), file=out, flush=True)
    start, reports = time.perf_counter(), []
    for rank in ranks:
        try:
            r = rehearse_rank(
                cfg, config, layout, rank, cfg.gpus_per_node, dataset, plan.sampler_state
            )
        except Exception as exc:  # noqa: BLE001 - what the job's worker would die of, one line
            print(
                f"megapar-train: error: rank {rank} ({layout.place(rank)}) failed in the "
                f"rehearsal: {type(exc).__name__}: {exc}",
                file=sys.stderr,
            )
            if cfg.debug:
                traceback.print_exc()
            return 1
        reports.append(r)
        print(
            json.dumps(
                {
                    **r.to_json(),
                    "fits_gpu": report.fits(r, cfg.gpu_memory_gb),
                    **({} if bubble is None else report.bubble_json(*bubble)),
                }
            )
            if cfg.json
            else report.describe_rank(r, step_dir, cfg.gpu_memory_gb),
            file=out,
            flush=True,
        )
    if not cfg.json:
        print(report.describe_checkpoint(reports, layout, step_dir), file=out)
        print(report.footer(time.perf_counter() - start, len(reports), layout.world_size), file=out)
    over = report.over_gpu_memory(reports, cfg.gpu_memory_gb)
    if over:
        print(f"megapar-train: {over}", file=sys.stderr)
    return 0
