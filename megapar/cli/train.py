"""megapar-train: the command users run.

    megapar-train                                  # small GPT-2 on the shipped Shakespeare sample
    megapar-train --tp 2 --pp 2 --model gpt2-tiny  # starts 4 local workers itself
    torchrun --nproc-per-node 8 -m megapar.cli.train --tp 2 --pp 2   # dp = 8 / 4 = 2

Everything that can be checked before a worker starts is checked here, so a mistake gives
one clear message instead of N stack traces or a hung process group.
"""

from __future__ import annotations

import os
import shlex
import sys
import traceback

from megapar.checkpoint.lock import SaveLock, SaveLockError, check_unlocked
from megapar.checkpoint.publish import has_checkpoint
from megapar.data import IndexedDataset
from megapar.device import DeviceError, check_gpus, share_host_arena
from megapar.diagnostics import inject
from megapar.dryrun.command import rehearse
from megapar.dryrun.sample import check_world
from megapar.faults.report import log_dir_for, worker_failure
from megapar.faults.stop import install_stop_handlers, parse_signals
from megapar.launcher import (
    WorkerError,
    check_local_workers,
    launched_local_size,
    launched_world_size,
    run_workers,
    under_launcher,
)
from megapar.mesh import Layout, LayoutError
from megapar.models.config import ConfigError
from megapar.optim import LRScheduler
from megapar.pipeline.partition import chunk_specs
from megapar.pipeline.schedules import check_schedule, chunks_per_rank, placement_of
from megapar.training.config import TrainConfig, parse_args
from megapar.training.data import (
    DataPlan,
    build_datasets,
    discard_tokenized,
    max_samples,
    prepare_data,
    resolve_model,
)
from megapar.training.loop import train
from megapar.training.profiling import parse_steps
from megapar.training.validate import (
    UsageError,
    adapt_defaults,
    check_cp_seq_len,
    check_inject_slow,
    check_load_path,
    check_newer_steps,
    check_outputs,
    check_resumable,
    check_same_data,
    check_settings,
    checkpoint_manifest,
    explicit,
    fit_batch_to_data,
    settings_from_checkpoint,
)


def plan_run(cfg: TrainConfig, notes: list[str] | None = None) -> tuple[Layout, DataPlan]:
    """Validate the run and resolve its data and model; raises with a clear message.
    Settings the user did not give may adapt to the ones they gave (said in `notes`)."""
    notes = [] if notes is None else notes
    manifest = None
    if cfg.load:
        check_load_path(cfg)  # a file, or a step that is not there: never a fresh start
    if cfg.load and cfg.load_strict and not has_checkpoint(cfg.load):
        what = ("no checkpoint there" if os.path.isdir(os.path.expanduser(cfg.load))
                else "no such checkpoint directory")
        raise UsageError(f"--load {cfg.load}: {what} (--load-strict); pass a directory written "
                         f"by --save (or one of its step_* directories), or drop --load-strict "
                         f"to start fresh when there is none")
    if cfg.load and has_checkpoint(cfg.load):
        # the checkpoint, checked once; settings not given are the checkpoint's
        manifest = checkpoint_manifest(cfg.load)
        notes.extend(settings_from_checkpoint(cfg, manifest))
    check_settings(cfg)
    if cfg.dry_run:  # the job's size as given, on this one process
        world = cfg.world_size or cfg.tp * cfg.cp * cfg.pp * (cfg.dp or 1)
        check_world(world)
        if world > cfg.gpus_per_node and world % cfg.gpus_per_node:
            raise UsageError(f"--world-size {world} spans several nodes of --gpus-per-node "
                             f"{cfg.gpus_per_node} but is not a multiple of it (torchrun starts "
                             f"the same number of processes on every node); give a multiple "
                             f"of {cfg.gpus_per_node}, or the --gpus-per-node each node really "
                             f"uses")
        layout = Layout.infer(world, cfg.tp, cfg.pp, cfg.dp, cfg.rank_order, cfg.cp)
    elif under_launcher():
        layout = Layout.infer(launched_world_size(), cfg.tp, cfg.pp, cfg.dp, cfg.rank_order,
                              cfg.cp)
        check_gpus(launched_local_size())  # every process of this node: a GPU each
    else:
        layout = Layout(cfg.tp, cfg.pp, cfg.dp or 1, cfg.rank_order, cfg.cp)
        check_gpus(layout.world_size)
        if not cfg.oversubscribe:
            cp = f" x --cp {layout.cp}" if layout.cp > 1 else ""
            check_local_workers(layout.world_size, f"--tp {layout.tp}{cp} x --pp {layout.pp} x "
                                f"--dp {layout.dp}")
    check_inject_slow(cfg, layout.world_size)
    notes.extend(adapt_defaults(cfg, layout.dp))
    per_step = cfg.micro_batch_size * layout.dp
    if cfg.micro_batch_size < 1 or cfg.global_batch_size % per_step:
        raise ValueError(f"global batch size {cfg.global_batch_size} is not divisible by "
                         f"micro-batch size {cfg.micro_batch_size} x dp {layout.dp} = {per_step}; "
                         f"choose a multiple of {per_step}")
    if cfg.profile_steps:
        first, last = parse_steps(cfg.profile_steps)
        start = int(manifest.get("step", 0)) if manifest else 0
        if last > cfg.max_steps:
            raise UsageError(f"--profile-steps {cfg.profile_steps} goes beyond --max-steps "
                             f"{cfg.max_steps}: the trace would never be written; profile steps "
                             f"within {start + 1}:{cfg.max_steps} or raise --max-steps")
        if first <= start:
            raise UsageError(f"--profile-steps {cfg.profile_steps} starts at or before step "
                             f"{start}, where --load resumes; profile steps within "
                             f"{start + 1}:{cfg.max_steps}")
    parse_signals(cfg.exit_signals)  # a typo is an error now, not when the signal comes
    if cfg.save_interval < 0 or cfg.max_steps < 1:
        raise ValueError("--max-steps must be >= 1 and --save-interval >= 0")
    if cfg.sequence_parallel and cfg.seq_len % layout.tp:
        raise ValueError(f"--seq-len {cfg.seq_len} is not divisible by --tp {layout.tp}, which "
                         f"--sequence-parallel needs; choose a multiple of {layout.tp}")
    check_cp_seq_len(cfg.seq_len, layout, cfg.sequence_parallel)

    LRScheduler(cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.max_steps, cfg.lr_decay)  # checks
    # the model and the layout: before any data is read or anything written
    config = resolve_model(cfg, notes, manifest)
    config.validate(layout)
    chunks = chunks_per_rank(cfg.schedule, cfg.virtual_stages)  # one line if V does not apply
    if placement_of(cfg.schedule) == "v" and config.num_layers < 2 * layout.pp:
        raise ValueError(f"--schedule {cfg.schedule} cuts the model into 2 x --pp {layout.pp} = "
                         f"{2 * layout.pp} virtual stages of at least one layer each, but it has "
                         f"{config.num_layers}; lower --pp or use --schedule zb-h1")
    if chunks > 1:
        chunk_specs(config.num_layers, layout.pp, 0, chunks)  # enough layers?
    _check_injection(cfg, config, layout, per_step, manifest)
    _check_replay(cfg, manifest)
    if not cfg.dry_run:
        most = max_samples(cfg, config.model_type)  # before a schedule of that many micro-batches
        if cfg.global_batch_size > most and "global_batch_size" in explicit(cfg):
            raise ValueError(f"--data holds fewer than one global batch of "
                             f"{cfg.global_batch_size}: at most {most:,} samples of "
                             f"{cfg.seq_len} tokens by its size; use more data, a shorter "
                             f"--seq-len or a smaller --global-batch-size")

    try:
        check_schedule(cfg.schedule, layout.pp, cfg.global_batch_size // per_step,
                       cfg.virtual_stages)
    except ValueError as exc:
        try:  # 2 pp micro-batches suit every schedule: if they pass, the error is about m
            check_schedule(cfg.schedule, layout.pp, 2 * layout.pp, cfg.virtual_stages)
        except ValueError:
            raise exc from None  # about --pp or --virtual-stages: m is not the problem
        raise ValueError(f"{exc}; m is --global-batch-size / (--micro-batch-size x dp) = "
                         f"{cfg.global_batch_size} / {per_step}") from None
    if not cfg.dry_run:  # a rehearsal writes nothing (its --save is the cluster's path)
        check_outputs(cfg)  # an unwritable --save is not found after the run
        if cfg.save and _takes_save_lock():
            check_unlocked(cfg.save)  # another run writing --save: refused before tokenizing
        check_newer_steps(cfg, manifest)  # steps a resumed or fresh run would overwrite
    plan = prepare_data(cfg, notes, manifest, config)
    if plan.prefix is None:  # a rehearsal without the data
        return layout, plan
    # ids outside the vocabulary: refused at any tp
    IndexedDataset(plan.prefix, cfg.tokenizer).check_vocab(config.vocab_size)
    try:
        train, split_notes = _training_split(cfg, plan, config.model_type, layout, notes)
        if len(train) < cfg.global_batch_size:
            fix = (f"fewer data-parallel ranks (dp {layout.dp} needs {layout.dp} samples)"
                   if len(train) < layout.dp else "a smaller --global-batch-size")
            raise ValueError(f"the training split has {len(train)} samples of {cfg.seq_len} "
                             f"tokens, fewer than one global batch of {cfg.global_batch_size}; "
                             f"use more data, a shorter --seq-len or {fix}")
    except ValueError:
        discard_tokenized(plan)  # too little text to train on: its fresh copy in the cache goes
        raise
    notes.extend(split_notes)
    if manifest is not None:
        check_resumable(cfg, manifest, len(train))
        check_same_data(cfg, manifest, plan.data_fingerprint)
    return layout, plan


def _check_injection(cfg: TrainConfig, config, layout: Layout, per_step: int,
                     manifest: dict | None) -> None:
    """--inject-corrupt (or MEGAPAR_INJECT_CORRUPT): a spec the run can carry out."""
    cfg.inject_corrupt = inject.from_settings(cfg.inject_corrupt) or None
    if not cfg.inject_corrupt:
        return
    flag = "--inject-corrupt" if "inject_corrupt" in explicit(cfg) else inject.ENV
    spec = inject.check(cfg.inject_corrupt, config, layout, cfg.global_batch_size // per_step,
                        flag)
    start = int(manifest.get("step", 0)) if manifest else 0
    if not start < spec.step <= cfg.max_steps:
        raise UsageError(f"{flag}: step={spec.step} is not run (this run trains steps "
                         f"{start + 1}-{cfg.max_steps}); choose a step in that range")


def _check_replay(cfg: TrainConfig, manifest: dict | None) -> None:
    """--record-step, --replay, --replay-against: a step this run reaches, a place to write."""
    start = int(manifest.get("step", 0)) if manifest else 0
    if cfg.record_step and not cfg.save:
        raise UsageError(f"--record-step {cfg.record_step} writes SAVE/records/: give --save")
    if cfg.record_step and not start < cfg.record_step <= cfg.max_steps:
        raise UsageError(f"--record-step {cfg.record_step} is not run (this run trains steps "
                         f"{start + 1}-{cfg.max_steps}); choose a step in that range")
    if cfg.replay_against and not cfg.replay:
        raise UsageError("--replay-against is the record --replay compares with: give --replay")
    if not cfg.replay:
        return
    if manifest is None:
        raise UsageError(f"--replay {cfg.replay} re-runs a step from a checkpoint: give --load "
                         f"CKPT (one saved at or before step {cfg.replay - 1})")
    if not start < cfg.replay <= cfg.max_steps:
        raise UsageError(f"--replay {cfg.replay}: the checkpoint is at step {start} and the run "
                         f"ends at --max-steps {cfg.max_steps}; replay a step in "
                         f"{start + 1}-{cfg.max_steps} (or --load an earlier checkpoint)")
    if cfg.replay_against and not os.path.exists(os.path.expanduser(cfg.replay_against)):
        raise UsageError(f"--replay-against {cfg.replay_against}: no such record; give the "
                         f"records/step_{cfg.replay:08d}.json --record-step wrote")


def _training_split(cfg: TrainConfig, plan: DataPlan, model_type: str, layout: Layout,
                    notes: list[str]):
    """(training split, notes on the split): a global batch the user did not give shrinks to
    what the data holds (said in `notes`); errors name the user's --data, not its cache."""

    def fits(gbs: int, mbs: int) -> bool:
        try:
            check_schedule(cfg.schedule, layout.pp, gbs // (mbs * layout.dp), cfg.virtual_stages)
        except ValueError:
            return False
        return True

    for _ in range(4):  # a smaller batch can change the validation split: until it settles
        split_notes: list[str] = []
        try:
            train, _ = build_datasets(cfg, plan.prefix, model_type, split_notes)
        except ValueError as exc:
            raise ValueError(_name_user_data(str(exc), cfg)) from None
        note = fit_batch_to_data(cfg, len(train), layout.dp, fits)
        if note is None:
            return train, split_notes
        notes.append(note)
    return train, split_notes


def _name_user_data(message: str, cfg: TrainConfig) -> str:
    """A dataset error that names a tokenized copy in --data-cache names the user's file."""
    cache = os.path.abspath(os.path.expanduser(cfg.data_cache))
    first, sep, rest = message.partition(": ")
    if not sep or os.path.dirname(os.path.abspath(first)) != cache:
        return message
    items = cfg.data if isinstance(cfg.data, list) else [cfg.data]
    stem = os.path.basename(first).rsplit("-", 1)[0]
    users = [p for p in items if p and os.path.splitext(os.path.basename(
        os.path.expanduser(str(p)).rstrip("/")))[0] == stem]
    data = users[0] if users else (cfg.data or "the shipped sample")
    return f"--data {data} (tokenized with --tokenizer {cfg.tokenizer}): {rest}"


def _takes_save_lock() -> bool:
    """The process that locks --save: the launching one, or global rank 0 under torchrun /
    Slurm (if it is refused, it exits 2 and torchrun stops the other ranks)."""
    return not under_launcher() or \
        int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0


def _worker(cfg: TrainConfig, plan: DataPlan):
    restore = install_stop_handlers(cfg.exit_signals)
    try:
        return train(cfg, plan)
    finally:
        restore()


def main(argv=None) -> int:
    share_host_arena()  # before any thread (the tokenizer's) allocates: workers inherit it
    notes: list[str] = []
    lock = None
    try:
        cfg = parse_args(argv)
        layout, plan = plan_run(cfg, notes)
        if cfg.save and _takes_save_lock() and not cfg.dry_run:  # held until this exits
            command = shlex.join(["megapar-train", *(sys.argv[1:] if argv is None else argv)])
            lock = SaveLock(cfg.save, command).acquire()
            notes.extend(filter(None, [lock.taken_over]))
    except (UsageError, LayoutError, ConfigError, ValueError, FileNotFoundError,
            SaveLockError, DeviceError) as exc:
        print(f"megapar-train: error: {exc}", file=sys.stderr)
        return 2
    try:
        return _run(cfg, layout, plan, notes)
    finally:
        if lock is not None:
            lock.release()


def _run(cfg: TrainConfig, layout: Layout, plan: DataPlan, notes: list[str]) -> int:
    """Start the workers (or run this rank) and turn a failure into one line."""
    cfg.dp = layout.dp
    if cfg.dry_run:
        return rehearse(cfg, layout, plan, notes)
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    if under_launcher() and rank != 0:
        cfg.progress = False
    for note in notes if rank == 0 else []:
        print(f"megapar-train: {note}", file=sys.stderr)
    forward = tuple(s.name for s in parse_signals(cfg.exit_signals)) + ("SIGINT",)
    try:
        run_workers(_worker, layout.world_size, cfg, plan, collective_timeout_s=cfg.timeout_s,
                    forward=forward, nccl_timeout_s=cfg.nccl_timeout_s)
    except Exception as exc:  # noqa: BLE001 - one line here, the traceback in the rank's log
        if isinstance(exc, WorkerError):
            text, failed = str(exc), None
        elif getattr(exc, "no_traceback", False):  # a clean stop in this process: one line
            text, failed = str(exc), rank
        else:  # a rank run in this process (one worker, or under torchrun)
            text, failed = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}", rank
        line, log = worker_failure(text, log_dir_for(cfg.save, cfg.data_cache), failed)
        print(f"megapar-train: error: {line}", file=sys.stderr)
        if cfg.debug:
            print(text, file=sys.stderr)
        elif log and " was killed by " in line:   # no traceback: its log and every rank's stack
            print(f"megapar-train: its output in {log}; every rank's stack: --debug",
                  file=sys.stderr)
        elif log:
            print(f"megapar-train: full traceback in {log} (or rerun with --debug)",
                  file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("megapar-train: aborted (second SIGINT): nothing saved", file=sys.stderr)
        return 130
    return 0

if __name__ == "__main__":
    sys.exit(main())
