"""What an engine's checkpoint records beside its tensors, and reads back: the step, the loss
scale, the optimizer's and LR schedule's state, the run's settings and the model's provenance
(tokenizer, Hugging Face dtype and generation config)."""

from __future__ import annotations

import os

from megapar.checkpoint.distributed import RNG_NOT_RESTORED
from megapar.data.blended import absolute_data
from megapar.optim import LRScheduler

RESERVED_META = frozenset(
    {
        "step",
        "schedule_step",
        "scaler",
        "optimizer",
        "scheduler",
        "rng_note",
        "model",
        "layout",
        "tokenizer",
        "hf_dtype",
        "hf_generation_config",
        "hf_source_dir",
        "train_config",
        "batches_from_caller",
    }
)
"""Checkpoint metadata keys megapar writes itself (`save(extra=...)` may not use them)."""


def recorded_settings(engine) -> dict:
    """What `Engine.recorded_settings` documents."""
    cfg, schedule = engine.cfg, engine.scheduler
    settings = cfg.to_dict()
    settings["data"] = absolute_data(cfg.data)
    if cfg.tokenizer not in ("gpt2", "sentencepiece") and os.path.exists(
        os.path.expanduser(cfg.tokenizer)
    ):
        settings["tokenizer"] = os.path.abspath(os.path.expanduser(cfg.tokenizer))
    if schedule is None:
        settings.update(lr_decay="constant", warmup_steps=0, min_lr=cfg.lr)
    elif isinstance(schedule, LRScheduler) and schedule != engine.flags_schedule(cfg):
        unscale = cfg.lr / engine.scaled_lr(cfg)  # --lr-scale-with-batch reapplies
        settings.update(
            lr=schedule.max_lr * unscale,
            min_lr=schedule.min_lr * unscale,
            warmup_steps=schedule.warmup_steps,
            max_steps=schedule.max_steps,
            lr_decay=schedule.decay,
        )
        if schedule.decay == "wsd":
            settings.update(
                lr_wsd_decay_steps=schedule.decay_steps, lr_wsd_decay_style=schedule.wsd_style
            )
    if engine.batches_from_caller:  # megapar-train's defaults, which this engine never read
        unread = ["data", "seq_len"]
        unread += ["global_batch_size"] if engine.batch_rows is None else []  # not given
        unread += ["max_steps"] if schedule is None else []  # a megapar schedule's is its own
        for name in unread:
            settings.pop(name, None)
    return settings


def rng_notes(notes: list[str], draws_dropout: bool) -> list[str]:
    """A load's notes, those saying the RNG states are not restored ending, for a model without
    dropout, with what that leaves unaffected."""
    unaffected = " (this model has no dropout: its losses are unaffected)"
    return [
        note + unaffected if note.startswith(RNG_NOT_RESTORED) and not draws_dropout else note
        for note in notes
    ]


def resume_phrase(saved, layout, resharded: bool, trained: dict, cfg) -> str:
    """How a resume reaches `layout` from the checkpoint's `saved` layout, for its line:
    "resharded from tp=2 pp=2 dp=1" (`resharded`: its tensors split otherwise), "from ...",
    or "same layout"; then the settings it changes from `trained` (`setting_changes`), and for
    a run also given --from-hf (a requeued one) that the checkpoint's weights continue."""
    how = f"from {saved}" if saved != layout else "same layout"
    if resharded:
        how = f"resharded from {saved}"
    how += setting_changes(trained, cfg)
    return how + (f"; its weights, not --from-hf {cfg.from_hf}'s" if cfg.from_hf else "")


CHANGES_NAMED = (
    "zero",
    "expert_tensor_parallel_size",
    "cp_comm_type",
    "attention_mask_type",
    "reset_position_ids",
    "eod_mask_loss",
)
"""Settings whose change a --load run's resume line names: how the layout runs, which `Layout`
does not hold (never taken from the checkpoint), and the packed-document flags (taken from it
unless given: a change is one given on the command line)."""


def setting_changes(trained: dict, cfg) -> str:
    """The resume line's changes of `CHANGES_NAMED` from the checkpoint's recorded settings
    (`trained`, its train_config) to `cfg`'s: "; --zero 2 -> 0" each (a switch "off -> on"),
    in that order; "" where none changed or the checkpoint recorded none."""

    def shown(value) -> str:
        return ("on" if value else "off") if isinstance(value, bool) else str(value)

    return "".join(
        f"; --{name.replace('_', '-')} {shown(was)} -> {shown(now)}"
        for name in CHANGES_NAMED
        if (was := trained.get(name)) is not None and was != (now := getattr(cfg, name))
    )


def checkpoint_meta(engine, extra: dict | None) -> dict:
    """The metadata `Engine.save` writes: megapar's keys and the caller's `extra` (which may
    not use megapar's own, ValueError)."""
    clash = sorted(set(extra or {}) & RESERVED_META)
    if clash:
        raise ValueError(
            f"engine.save(extra=...): {clash} are megapar's own checkpoint "
            f"keys; rename yours (e.g. 'my_{clash[0]}')"
        )
    meta = {
        "step": engine.step,
        "schedule_step": engine.schedule_step,
        "scaler": engine.precision.state_dict(),
        "optimizer": engine.optimizer.state_json(),
        "train_config": recorded_settings(engine),
        **(extra or {}),
    }
    if engine.batches_from_caller:  # its train_config has no data, seq-len, batch, steps
        meta["batches_from_caller"] = True
    if engine.scheduler is not None:
        meta["scheduler"] = engine.scheduler.state_dict()
    if engine.tokenizer is not None:
        meta["tokenizer"] = engine.tokenizer
    if engine.source_dtype is not None:
        meta["hf_dtype"] = engine.source_dtype
    if engine.source_generation_config is not None:
        meta["hf_generation_config"] = engine.source_generation_config
    if engine.source_dir is not None:
        meta["hf_source_dir"] = engine.source_dir
    return meta


def restore_meta(engine, meta: dict) -> None:
    """Set what `checkpoint_meta` recorded back on `engine` (the optimizer's JSON state, the
    LR schedule and its position, the loss scale, the step and the provenance)."""
    if meta.get("optimizer"):
        engine.optimizer.load_state_json(meta["optimizer"])
    if meta.get("scheduler") and engine.scheduler is not None:
        engine.scheduler.load_state_dict(meta["scheduler"])
    elif meta.get("scheduler") and "initial_lr" not in engine.optimizer.param_groups[0]:
        # an engine prepared without lr_schedule and with no torch scheduler on its optimizer
        # (torch's set initial_lr) continues the checkpoint's schedule, not a constant lr
        engine.scheduler = engine.step_fn.scheduler = LRScheduler(**meta["scheduler"])
    if meta.get("scaler"):
        engine.precision.load_state_dict(meta["scaler"])
    engine.step = int(meta.get("step", 0))
    engine.schedule_step = int(meta.get("schedule_step", engine.step))  # older: no skips kept
    if engine.scheduler is not None:  # the next step's lr (the optimizer's state held the last)
        engine.optimizer.set_lr(engine.scheduler.lr(engine.schedule_step))
    engine.tokenizer = meta.get("tokenizer", engine.tokenizer)
    engine.source_dtype = meta.get("hf_dtype", engine.source_dtype)
    engine.source_generation_config = meta.get(
        "hf_generation_config", engine.source_generation_config
    )
    engine.source_dir = meta.get("hf_source_dir", engine.source_dir)
