"""A megapar-train run planned before any worker starts: its settings checked (and completed
from the checkpoint it resumes), its model resolved and its data tokenized and split, so a
mistake gives one clear line instead of N stack traces or a hung process group.

`cli/train.py` chooses the layout (how the command is run) and calls `read_resumed_settings`,
then `plan_data`.
"""

from __future__ import annotations

import math
import os
from functools import partial

from megapar.checkpoint.format import probe_writable
from megapar.checkpoint.lock import check_unlocked, launched_job
from megapar.checkpoint.publish import has_checkpoint
from megapar.context_parallel.a2a import heads_error
from megapar.data import IndexedDataset, SFTDataset
from megapar.data.blended import BlendedDataset
from megapar.data.inputs import expand_inputs
from megapar.diagnostics import inject
from megapar.diagnostics.replay import check_record, find_record, loss_terms
from megapar.faults.stop import parse_signals
from megapar.launcher import launched_world_size, under_launcher
from megapar.mesh import Layout, LayoutError
from megapar.models.flops import heads
from megapar.optim.scheduler import flags_schedule
from megapar.pipeline.partition import chunk_specs, partition_layers
from megapar.pipeline.schedules import (
    CHUNKED_SCHEDULES,
    SPLIT_BACKWARD,
    check_schedule,
    chunks_per_rank,
    one_stage_chunks_error,
    placement_of,
    schedule_takes,
)
from megapar.training.config import TrainConfig
from megapar.training.data import (
    DataPlan,
    blend_parts,
    build_datasets,
    discard_tokenized,
    max_samples,
    prepare_data,
    resolve_model,
    training_documents,
)
from megapar.training.documents import document_notes, reads_documents
from megapar.training.engine import Engine
from megapar.training.profiling import parse_steps
from megapar.training.tokenizer_checks import default_to_hf_tokenizer
from megapar.training.validate import (
    UsageError,
    adapt_defaults,
    check_cp_comm,
    check_cp_seq_len,
    check_documents,
    check_inject_slow,
    check_outputs,
    check_settings,
    explicit,
    fit_batch_to_data,
    given_now,
    named,
    pps_taken,
    tps_taken,
    unchecked_outputs,
)
from megapar.training.validate_fp8 import check_fp8_layout
from megapar.training.validate_resume import (
    check_load_path,
    check_newer_steps,
    check_optimizer_state,
    check_resumable,
    check_resumable_without_data,
    check_same_data,
    check_save_format,
    checked_step,
    checkpoint_manifest,
    replay_past,
    settings_from_checkpoint,
    worker_verify,
)
from megapar.training.validate_sft import check_sft_model
from megapar.training.validate_sharding import check_powersgd_rank
from megapar.wording import and_list, counted, first_few, or_list


def read_resumed_settings(cfg: TrainConfig, notes: list[str]) -> dict | None:
    """Check --load and the settings; settings not given are the resumed checkpoint's (said in
    `notes`). Returns the checkpoint's manifest (None: a fresh start)."""
    manifest = None
    if cfg.load:
        check_load_path(cfg)  # a file, or a step that is not there: never a fresh start
    if cfg.load and cfg.load_strict and not has_checkpoint(cfg.load):
        what = (
            "no checkpoint there"
            if os.path.isdir(os.path.expanduser(cfg.load))
            else "no such checkpoint directory"
        )
        raise UsageError(
            f"--load {cfg.load}: {what} (--load-strict); pass a directory written "
            f"by --save (or one of its step_* directories), or drop --load-strict "
            f"to start fresh when there is none"
        )
    if cfg.load and has_checkpoint(cfg.load):
        # the checkpoint, checked once; settings not given are the checkpoint's
        manifest = checkpoint_manifest(cfg.load)
        notes.extend(settings_from_checkpoint(cfg, manifest))
        check_optimizer_state(cfg, manifest)
    else:  # a fresh start from --from-hf DIR tokenizes with DIR's tokenizer
        notes.extend(default_to_hf_tokenizer(cfg))
    check_settings(cfg)
    if manifest is None and cfg.load and not {"model", "from_hf"} & explicit(cfg):
        raise UsageError(  # a mistyped --load: a run of the default model would start
            f"--load {cfg.load}: no checkpoint there, and no --model or --from-hf says what a "
            f"fresh run would train; pass the directory written by --save (or one of its "
            f"step_* directories), or give --model / --from-hf to start a run there"
        )
    if manifest is None and cfg.load and cfg.dry_run:  # the run's workers say it (`Trainer`)
        notes.append(
            f"--load {cfg.load}: no checkpoint there yet, the rehearsed run starts from scratch "
            f"(--load-strict makes this an error)"
        )
    return manifest


def plan_data(
    cfg: TrainConfig, layout: Layout, notes: list[str], manifest: dict | None
) -> DataPlan:
    """Check the run on `layout`, resolve its model and prepare its data (tokenized, split,
    checked against the checkpoint it resumes); raises with a clear message. Settings the user
    did not give may adapt to the ones they gave (said in `notes`)."""
    config, per_step = check_run(cfg, layout, notes, manifest)
    if cfg.dry_run:  # a rehearsal writes nothing (its --save is the cluster's path)
        notes.extend(unchecked_outputs(cfg))
    else:
        check_outputs(cfg)  # an unwritable --save is not found after the run
    # what --save holds, where it is here too (a rehearsal reads it as the run would)
    if cfg.save:  # another run writing --save: refused before tokenizing, by every rank
        # (a torchrun rank but 0 went on to another refusal, then was cut off); not this
        # job's rank 0 lock, which it may take meanwhile
        check_unlocked(cfg.save, job=None if takes_save_lock() else launched_job())
    check_save_format(cfg)  # a Hugging Face model's (or DCP) directory: never mixed
    check_newer_steps(cfg, manifest, config)  # steps a resumed or fresh run would overwrite
    if not cfg.dry_run:
        notes.extend(_earlier_log(cfg, manifest))
    plan = prepare_data(cfg, notes, manifest, config)
    if manifest is not None:  # the data order the resumed run continues (a dry run shows it)
        plan.sampler_state = (manifest.get("meta") or {}).get("sampler")
        plan.start_step = int(manifest.get("step", 0))
        assert cfg.load is not None  # a manifest: --load's
        plan.checked_load = checked_step(cfg.load, manifest)  # the step its files were checked of
        plan.load_verify = worker_verify()
    if plan.prefix is None:  # a rehearsal without the data
        if manifest is not None:
            notes.extend(check_resumable_without_data(cfg, manifest))
        if reads_documents(cfg) and cfg.eod_id is None:  # the masks' shapes need no real id
            cfg.eod_id = int(getattr(config, "eos_token_id", None) or 0)
        return plan
    # ids outside the vocabulary: refused at any tp
    IndexedDataset(plan.prefix, cfg.tokenizer).check_vocab(config.vocab_size)
    if reads_documents(cfg):
        indexed = IndexedDataset(plan.prefix, cfg.tokenizer)
        parts = [  # each part of a blend (index counts only), or the one dataset
            (f"--data's part {path}", part.num_docs, part.num_tokens)
            for path, part in (
                (path, IndexedDataset(prefix, cfg.tokenizer)) for path, prefix in blend_parts(cfg)
            )
        ] or [(_data_named(cfg), indexed.num_docs, indexed.num_tokens)]
        notes.extend(
            document_notes(
                cfg,
                indexed.eod_id,
                parts,
                _data_named(cfg),
                records=indexed.prompt_lengths is not None,
            )
        )
        if cfg.eod_id is None:  # the data's end-of-document token
            cfg.eod_id = indexed.eod_id
            check_documents(cfg, config)  # inside the vocabulary
    try:
        train, val, split_notes = _training_split(cfg, plan, config.model_type, layout, notes)
        if isinstance(train, SFTDataset) and train.unlabelled == len(train):
            raise ValueError(
                f"every one of the {len(train):,} training records of {_data_named(cfg)} has a "
                f"prompt of at least --seq-len + 1 = {cfg.seq_len + 1} tokens: no response "
                f"token is left to train on (the loss would be 0); raise --seq-len to at least "
                f"{int(train.prompt.min())} (the shortest prompt) or shorten the prompts"
            )
        if len(train) < cfg.global_batch_size:
            fix = (
                f"fewer data-parallel ranks (dp {layout.dp} needs {layout.dp} samples)"
                if len(train) < layout.dp
                else "a smaller --global-batch-size"
            )
            records = isinstance(train, SFTDataset)  # one sample a record at any --seq-len
            raise ValueError(
                f"the training split of {_data_named(cfg)} has {counted(len(train), 'sample')} of "
                f"{cfg.seq_len} tokens, fewer than one global batch of {cfg.global_batch_size}; "
                + (
                    f"use more records or {fix}"
                    if records
                    else f"use more data, a shorter --seq-len or {fix}"
                )
            )
    except ValueError:
        discard_tokenized(
            plan.tokenized
        )  # too little text to train on: its fresh copy in the cache goes
        raise
    notes.extend(split_notes)
    if not isinstance(train, (SFTDataset, BlendedDataset)):  # their own lines say it
        notes.append(_data_line(cfg, len(train), len(val) if val is not None else 0, manifest))
    if manifest is not None:
        split_of = partial(training_documents, cfg, plan.prefix, config.model_type)
        check_resumable(cfg, manifest, len(train), split_of)
        check_same_data(cfg, manifest, plan.data_fingerprint)
    return plan


def regather_notes(cfg: TrainConfig, layout: Layout) -> list[str]:
    """The start-up note where --sp-regather re-gathers nothing, or less than every
    column-parallel layer's input: where the layers keep the gathered input for the backward
    anyway (--recompute full's rebuilt blocks, --compile'd blocks, zero-bubble schedules'
    deferred weight gradients, --fp8's float8 linears), as its help says."""
    if not (cfg.sp_regather and cfg.sequence_parallel and layout.tp > 1):
        return []  # refused in `validate` where sequence parallelism is off
    kept = [
        ("--recompute full", cfg.recompute == "full"),
        ("--compile", cfg.compile),
        (f"--schedule {cfg.schedule}", cfg.schedule in SPLIT_BACKWARD),
    ]
    named = [flag for flag, on in kept if on]
    if named:
        return [
            f"--sp-regather with {and_list(named)}: the blocks keep the gathered input for "
            f"the backward anyway, so nothing is re-gathered (drop --sp-regather)"
        ]
    if cfg.fp8 != "off":
        return [
            f"--sp-regather with --fp8 {cfg.fp8}: the float8 linears keep the gathered input "
            f"for the backward anyway; only the linears left in {cfg.precision} re-gather theirs"
        ]
    return []


def _fixed_world(cfg: TrainConfig) -> int:
    """The world the job fixed (a rehearsal's --world-size, torchrun's), or 0: the flags'."""
    return (
        (cfg.world_size or 0) if cfg.dry_run else (launched_world_size() if under_launcher() else 0)
    )


def _fixed_batch(cfg: TrainConfig) -> tuple[int, int] | None:
    """The global batch given and the micro-batch size given (1 where not: it adapts to a
    divisor of the dp's share), whose micro-batches a dp's must divide; None where the global
    batch adapts to the dp (not given)."""
    given = explicit(cfg)
    if "global_batch_size" not in given:
        return None
    return cfg.global_batch_size, (cfg.micro_batch_size if "micro_batch_size" in given else 1)


def pps_the_world_takes(cfg: TrainConfig, layers: int, chunks: int) -> str:
    """Beside the layers' refusal of --pp under a world the job fixed: the --pp values both the
    layers (in `chunks` model chunks per rank) and that world take ("lower --pp to 4 or less"
    was refused next for 6 processes)."""
    world = _fixed_world(cfg)
    if not world:
        return ""
    batch = _fixed_batch(cfg)
    fits = [p for p in pps_taken(layers, world, cfg.tp, cfg.cp, cfg.ep, batch, chunks) if p > 1]
    if not fits:
        return ""
    what = counted(world, "process", "processes")
    return f"; of those, {what} take --pp {or_list([str(p) for p in fits[:3]])}"


def tps_the_world_takes(cfg: TrainConfig, config) -> str:
    """Beside the model's refusal of --tp under a world the job fixed (torchrun's, or a
    rehearsal's --world-size): the --tp values both the model and that world take (the model
    offered --tp 4 to 2 processes, refused next)."""
    world = _fixed_world(cfg)
    if not world:
        return ""
    fits = [str(t) for t in tps_taken(config, world, cfg.pp, cfg.cp, cfg.ep, _fixed_batch(cfg))]
    if not fits:  # every one the model offers runs, or none
        return ""
    at = " x ".join(
        f"--{n} {v}" for n, v in (("cp", cfg.cp), ("pp", cfg.pp), ("ep", cfg.ep)) if v > 1
    )
    what = counted(world, "process", "processes") + (f" at {at}" if at else "")
    return f"; of those, {what} {'take' if world > 1 else 'takes'} --tp {or_list(fits)}"


def _cp_runs(cfg: TrainConfig, layout: Layout, config):
    """Whether the job runs at another --cp: a world the launcher or --world-size fixed must
    divide into its tp x cp x pp; a world of the flags' sizes grows with cp, and a rehearsed one
    is a node's --gpus-per-node or less, or a multiple of it (as `cli.train` checks); under
    --cp-comm-type a2a, the model's heads per tp rank divide over it (`check_cp_comm`)."""
    per_tp = heads(config) // layout.tp

    def model_runs(c: int) -> bool:
        return cfg.cp_comm_type != "a2a" or heads_error(per_tp, c) is None

    if cfg.world_size or under_launcher():
        return lambda c: model_runs(c) and layout.world_size % (layout.tp * layout.pp * c) == 0
    others = layout.world_size // layout.cp
    gpus = cfg.gpus_per_node
    return lambda c: (
        model_runs(c) and (not cfg.dry_run or others * c <= gpus or others * c % gpus == 0)
    )


def check_run(cfg: TrainConfig, layout: Layout, notes: list[str], manifest: dict | None):
    """The settings checked against `layout` and each other, and the model resolved and
    checked against them, before any data is read or anything written. Returns (the model's
    config, samples per micro-batch step: micro-batch size x dp)."""
    check_inject_slow(cfg, layout.world_size)
    notes.extend(adapt_defaults(cfg, layout.dp))
    per_step = cfg.micro_batch_size * layout.dp
    if cfg.micro_batch_size < 1 or cfg.global_batch_size % per_step:
        if cfg.micro_batch_size >= 1:
            _check_resumed_batch(cfg, layout.dp)
        raise ValueError(_batch_refusal(cfg, layout.dp, layout.pp))
    _check_profile(cfg, manifest)
    parse_signals(cfg.exit_signals)  # a typo is an error now, not when the signal comes
    if cfg.save_interval < 0 or cfg.max_steps < 1:
        raise ValueError("--max-steps must be >= 1 and --save-interval >= 0")
    if cfg.sequence_parallel and cfg.seq_len % layout.tp:
        raise ValueError(
            f"{named(cfg, 'seq_len')} is not divisible by --tp {layout.tp}, which "
            f"--sequence-parallel needs; choose a multiple of {layout.tp}"
        )
    if cfg.sequence_parallel and layout.tp == 1:  # Megatron's "disabled when tp == 1"
        notes.append("--sequence-parallel at --tp 1: nothing to split, it applies with --tp > 1")
    notes.extend(regather_notes(cfg, layout))
    off = [v for v in ("TORCH_COMPILE_DISABLE", "TORCHDYNAMO_DISABLE") if os.environ.get(v) == "1"]
    if cfg.compile and off:  # torch.compile then returns the function as it is, silently
        notes.append(
            f"warning: --compile does nothing: {off[0]}=1 is set, which turns torch.compile "
            f"off, so the blocks run eager; unset it to compile, or drop --compile"
        )
    elif cfg.compile and os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        _check_compile_cache(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    if cfg.compile and not off and not cfg.dry_run:  # else the first step's minute looks hung
        notes.append(
            "--compile: the first step compiles the blocks with torch.compile (tens of "
            "seconds; its tok/s counts the compile), the later steps run compiled"
        )

    if cfg.lr_scale_with_batch and cfg.global_batch_size != cfg.lr_scale_with_batch:
        scaled = Engine.flags_schedule(cfg)  # the schedule the engine builds
        notes.append(
            f"--lr-scale-with-batch {cfg.lr_scale_with_batch}: the run trains at --lr {cfg.lr:g}"
            f" x global batch {cfg.global_batch_size} / {cfg.lr_scale_with_batch} = "
            f"{scaled.max_lr:g}"
            + (
                f" (and --min-lr {cfg.min_lr:g} x the same, {scaled.min_lr:g})"
                if cfg.lr_decay != "constant"
                else ""
            )
            + ", which the logged lr shows"
        )
    if manifest is not None and cfg.max_steps <= int(manifest.get("step", 0)):
        resolve_model(cfg, notes, manifest)  # another model's refusal, else nothing left to
        # train (`check_steps_left`): before the schedule, which would not run (a checkpoint's
        # warmup longer than the new --max-steps offered --warmup-steps 2, refused next)
    _check_resumed_warmup(cfg)
    flags_schedule(cfg, cfg.lr, cfg.min_lr)  # checks
    # the model and the layout: before any data is read or anything written
    config = resolve_model(cfg, notes, manifest)
    check_cp_seq_len(  # the --cp it offers: one the job and the model run
        cfg.seq_len,
        layout,
        cfg.sequence_parallel,
        named(cfg, "seq_len"),
        _cp_runs(cfg, layout, config),
    )
    one_stage = one_stage_chunks_error(
        cfg.schedule, cfg.virtual_stages, layout.pp, layers=config.num_layers
    )
    if one_stage:
        raise ValueError(one_stage)
    given = "given" if "schedule" in explicit(cfg) else "default"  # one line if V does not apply
    chunks = chunks_per_rank(
        cfg.schedule, cfg.virtual_stages, flags=given, layers=config.num_layers, pp=layout.pp
    )
    if chunks < 2 and cfg.schedule in CHUNKED_SCHEDULES:  # interleaved at V 1: its own line
        check_schedule(cfg.schedule, layout.pp, 2 * layout.pp, cfg.virtual_stages)
    split = cfg.pipeline_split  # enough layers for each stage or chunk? (before the model's
    try:  # own check: the schedule's line names the --pp its chunks take)
        if chunks > 1:
            specs = placement_of(cfg.schedule), split
            chunk_specs(config.num_layers, layout.pp, 0, chunks, *specs)
        else:
            partition_layers(config.num_layers, layout.pp, split)
    except LayoutError as exc:  # a --pp of the world's the layers refuse: those both take
        if config.num_layers >= layout.pp * chunks or not split.even:
            raise
        raise LayoutError(f"{exc}{pps_the_world_takes(cfg, config.num_layers, chunks)}") from None
    try:
        config.validate(layout)
    except LayoutError as exc:  # a --tp of the world's that the model refuses: those both take
        raise LayoutError(f"{exc}{tps_the_world_takes(cfg, config)}") from None
    check_fp8_layout(cfg, config, layout.tp)  # the model's float8 linears at this tp
    check_cp_comm(cfg.cp_comm_type, layout, config)
    check_powersgd_rank(cfg, config, layout.tp, layout.pp)
    check_documents(cfg, config)
    check_sft_model(cfg, config.model_type)
    _check_injection(cfg, config, layout, per_step, manifest)
    _check_replay(cfg, manifest, config, notes)
    if not cfg.dry_run:
        most = max_samples(cfg, config.model_type)  # before a schedule of that many micro-batches
        if (
            most is not None
            and cfg.global_batch_size > most
            and "global_batch_size" in explicit(cfg)
        ):
            raise ValueError(
                f"{_data_named(cfg)} holds fewer than one global batch of "
                f"{cfg.global_batch_size}: at most {most:,} sample{'s' * (most != 1)} of "
                f"{cfg.seq_len} tokens by its size; use more data, a shorter "
                f"--seq-len or a smaller --global-batch-size"
            )
    _check_micro_batches(cfg, layout, per_step)
    return config, per_step


def _data_named(cfg: TrainConfig) -> str:
    """--data as a message names it: its path(s), or the shipped sample when none was given."""
    if cfg.data is None:
        return "--data (not given: the shipped sample)"
    if isinstance(cfg.data, str) and os.path.isdir(os.path.expanduser(cfg.data)):
        root = os.path.expanduser(cfg.data)
        try:
            files = [os.path.relpath(f, root) for f in expand_inputs([root])]
        except (OSError, ValueError):  # refused by the data path before this line is written
            files = []
        if files:
            return (
                f"{named(cfg, 'data')} (its {counted(len(files), 'text file')}: "
                f"{first_few(files, 3)})"
            )
    return named(cfg, "data")


def _check_profile(cfg: TrainConfig, manifest: dict | None) -> None:
    """--profile-steps: steps this run trains."""
    if not cfg.profile_steps:
        return
    first, last = parse_steps(cfg.profile_steps)
    start = int(manifest.get("step", 0)) if manifest else 0
    if last > cfg.max_steps:
        raise UsageError(
            f"--profile-steps {cfg.profile_steps} goes beyond --max-steps "
            f"{cfg.max_steps}: the trace would never be written; profile steps "
            f"within {start + 1}:{cfg.max_steps} or raise --max-steps"
        )
    if first <= start:
        raise UsageError(
            f"--profile-steps {cfg.profile_steps} starts at or before step "
            f"{start}, where --load resumes; profile steps within "
            f"{start + 1}:{cfg.max_steps}"
        )


def _check_micro_batches(cfg: TrainConfig, layout: Layout, per_step: int) -> None:
    """The schedule takes m = global batch / (micro-batch size x dp) micro-batches; an error
    says whether m or the layout is the problem."""
    try:
        check_schedule(
            cfg.schedule, layout.pp, cfg.global_batch_size // per_step, cfg.virtual_stages
        )
    except ValueError as exc:
        try:  # 2 pp micro-batches suit every schedule: if they pass, the error is about m
            check_schedule(cfg.schedule, layout.pp, 2 * layout.pp, cfg.virtual_stages)
        except ValueError:
            raise exc from None  # about --pp or --virtual-stages: m is not the problem
        raise ValueError(
            f"{exc}; m is --global-batch-size / (--micro-batch-size x dp) = "
            f"{cfg.global_batch_size} / {per_step}: raise the first or lower the second"
        ) from None


def _earlier_log(cfg: TrainConfig, manifest: dict | None) -> list[str]:
    """A note when a fresh run will start an existing, non-empty --log-json anew."""
    path = os.path.expanduser(cfg.log_json) if cfg.log_json else ""
    if manifest is not None or not path or not os.path.isfile(path) or not os.path.getsize(path):
        return []
    with open(path, "rb") as f:
        records = sum(1 for line in f if line.strip())
    return [
        f"--log-json {cfg.log_json} holds {counted(records, 'record')} of an earlier run: this "
        "fresh "
        f"run starts the file anew (give another --log-json to keep them)"
    ]


def _check_injection(
    cfg: TrainConfig, config, layout: Layout, per_step: int, manifest: dict | None
) -> None:
    """--inject-corrupt (or MEGAPAR_INJECT_CORRUPT): a spec the run can carry out."""
    cfg.inject_corrupt = inject.from_settings(cfg.inject_corrupt) or None
    if not cfg.inject_corrupt:
        return
    flag = "--inject-corrupt" if "inject_corrupt" in explicit(cfg) else inject.ENV
    spec = inject.check(
        cfg.inject_corrupt,
        config,
        layout,
        cfg.global_batch_size // per_step,
        flag,
        tokens=cfg.micro_batch_size * cfg.seq_len,
    )
    start = int(manifest.get("step", 0)) if manifest else 0
    if not start < spec.step <= cfg.max_steps:
        raise UsageError(
            f"{flag}: step={spec.step} is not run (this run trains steps "
            f"{start + 1}-{cfg.max_steps}); choose a step in that range"
        )


def _batch_refusal(cfg: TrainConfig, dp: int, pp: int = 1) -> str:
    """Why the global batch cannot be cut into micro-batches over dp, and the fixes that work:
    a global batch that is a multiple of dp when the micro-batch size was not given (it adapts
    to any such one), else a multiple of micro-batch size x dp, or the (up to three) micro-batch
    sizes nearest the given one that divide the global batch's share of a dp rank into
    micro-batches the pipeline schedule takes (at `pp` stages)."""
    gbs, mbs = cfg.global_batch_size, cfg.micro_batch_size
    if "micro_batch_size" not in explicit(cfg) and gbs % dp:
        near = sorted({max(dp, gbs // dp * dp), (gbs // dp + 1) * dp})
        return (
            f"global batch size {gbs} is not divisible by dp {dp}: each dp rank takes an equal "
            f"share; choose a multiple of {dp} (e.g. {' or '.join(map(str, near))}; the "
            f"micro-batch size, not given, then adapts to it)"
        )

    def scheduled(m: int) -> bool:
        """Whether the pipeline schedule takes `m` micro-batches (any m without a pipeline)."""
        return pp == 1 or schedule_takes(cfg.schedule, pp, m, cfg.virtual_stages)

    fix = f"choose a --global-batch-size that is a multiple of {mbs * dp}"
    if mbs >= 1:
        step = mbs * dp
        counts = range(1, gbs // step + 4 * pp * cfg.virtual_stages + 8)
        takes = [k * step for k in counts if scheduled(k)]
        near = [b for b in takes if b < gbs][-1:] + [b for b in takes if b > gbs][:1]
        if near:
            fix += f" ({' or '.join(map(str, near))})"
    if mbs >= 1 and gbs % dp == 0:
        share = gbs // dp
        sizes = [b for b in range(1, share + 1) if share % b == 0 and scheduled(share // b)]
        nearest = sorted(sorted(sizes, key=lambda b: (abs(b - mbs), b))[:3])
        if nearest:
            fix += f", or --micro-batch-size {' / '.join(map(str, nearest))}"
    return (
        f"global batch size {gbs} is not divisible by micro-batch size {mbs} x dp {dp} = "
        f"{mbs * dp}; {fix}"
    )


def _check_resumed_warmup(cfg: TrainConfig) -> None:
    """UsageError for a resumed run whose checkpoint's warmup (kept: --warmup-steps not given)
    is longer than the schedule this run gives (a shorter --max-steps or --lr-decay-steps),
    naming where the warmup came from; a fresh run's default warmup shrinks instead
    (`adapt_defaults`)."""
    end = cfg.lr_decay_steps or cfg.max_steps
    if "warmup_steps" not in getattr(cfg, "from_checkpoint", ()) or cfg.warmup_steps <= end:
        return
    ends = f"--lr-decay-steps {end}" if cfg.lr_decay_steps else f"--max-steps {end}"
    raise UsageError(
        f"{named(cfg, 'warmup_steps')} is longer than the {end} steps of {ends}; give "
        f"--warmup-steps {end} or fewer (the steps after the checkpoint follow the new "
        f"schedule), or {ends.split()[0]} {cfg.warmup_steps} or more"
    )


def _check_resumed_batch(cfg: TrainConfig, dp: int) -> None:
    """UsageError for a resumed run whose dp does not divide the checkpoint's global batch
    (which it keeps when --global-batch-size is not given), naming the dp values and micro-batch
    sizes that do, and the global batch sizes this dp takes; nothing for a global batch given
    or of a fresh run."""
    if "global_batch_size" not in getattr(cfg, "from_checkpoint", ()):
        return
    gbs, mbs = cfg.global_batch_size, cfg.micro_batch_size
    dps = [d for d in range(1, gbs + 1) if gbs % (mbs * d) == 0]
    sizes = [b for b in range(1, gbs + 1) if gbs % (b * dp) == 0]
    fixes = [f"a layout with dp {' / '.join(map(str, dps))}"] if dps else []
    if sizes:
        fixes.append(f"--micro-batch-size {' / '.join(map(str, sizes[-3:]))} at dp {dp}")
    if not fixes:
        fixes.append(f"a dp that divides {gbs} and a --micro-batch-size that divides {gbs} / dp")
    fixes.append(f"--global-batch-size a multiple of {mbs * dp} (the data order continues)")
    raise UsageError(
        f"{named(cfg, 'global_batch_size')} is not divisible by micro-batch size {mbs} x "
        f"dp {dp} = {mbs * dp}, and a resumed run keeps its checkpoint's global batch unless "
        f"--global-batch-size is given; choose {', or '.join(fixes)}"
    )


def _check_replay(cfg: TrainConfig, manifest: dict | None, config, notes: list[str]) -> None:
    """--record-step, --replay, --replay-against: a step this run reaches, a place to write, a
    readable record of the replayed step and model to compare with."""
    start = int(manifest.get("step", 0)) if manifest else 0
    outputs = ("save", "record_step", "log_json", "tensorboard", "wandb_project")
    given = [f for f in outputs if f in explicit(cfg) and getattr(cfg, f)]
    if cfg.replay and given:  # a log would also lose the records after the checkpoint's step
        flag = "--" + given[0].replace("_", "-")
        raise UsageError(
            f"{flag} with --replay {cfg.replay}: a replay runs step {cfg.replay} "
            f"once, compares it and exits without saving, recording or logging; drop {flag}"
        )
    if cfg.record_step and not cfg.save:
        raise UsageError(f"--record-step {cfg.record_step} writes SAVE/records/: give --save")
    if cfg.record_step and not start < cfg.record_step <= cfg.max_steps:
        raise UsageError(
            f"--record-step {cfg.record_step} is not run (this run trains steps "
            f"{start + 1}-{cfg.max_steps}); choose a step in that range"
        )
    if cfg.replay_against and not cfg.replay:
        raise UsageError("--replay-against is the record --replay compares with: give --replay")
    if not cfg.replay:
        return
    if manifest is None:
        held = f"--load {cfg.load} holds no checkpoint; " if cfg.load else ""
        raise UsageError(
            f"{held}--replay {cfg.replay} re-runs a step from a checkpoint: give --load "
            f"CKPT (one saved at or before step {cfg.replay - 1})"
        )
    trained = ((manifest.get("meta") or {}).get("sampler") or {}).get("global_batch_size")
    if trained is not None and cfg.global_batch_size != trained:
        raise UsageError(
            f"--global-batch-size {cfg.global_batch_size} with --replay {cfg.replay}: a replay "
            f"re-runs the recorded step on its samples, and --load {cfg.load} trained on global "
            f"batches of {trained}; drop --global-batch-size (the checkpoint's is taken)"
        )
    if cfg.replay <= start:
        raise UsageError(replay_past(cfg, start))
    if cfg.replay > cfg.max_steps:
        raise UsageError(
            f"--replay {cfg.replay}: the checkpoint is at step {start} and the run "
            f"ends at --max-steps {cfg.max_steps}; replay a step in "
            f"{start + 1}-{cfg.max_steps} (or --load an earlier checkpoint)"
        )
    if cfg.replay_against and not os.path.exists(os.path.expanduser(cfg.replay_against)):
        raise UsageError(
            f"--replay-against {cfg.replay_against}: no such record; give the "
            f"records/step_{cfg.replay:08d}.json --record-step wrote"
        )
    assert cfg.load is not None  # a manifest is --load's checkpoint's
    record = cfg.replay_against or find_record(cfg.load, cfg.replay)
    if record is None:
        raise UsageError(
            f"--replay {cfg.replay}: no record of step {cfg.replay} next to the "
            f"--load checkpoint (records/step_{cfg.replay:08d}.json of its --save "
            f"directory), so nothing would be compared; record it with --record-step "
            f"{cfg.replay} in the original run, or give --replay-against FILE"
        )
    flag = "--replay-against" if cfg.replay_against else "the record"
    notes.extend(
        check_record(record, cfg.replay, config.to_dict(), flag, cfg.loss_mean, loss_terms(cfg))
    )


def _training_split(
    cfg: TrainConfig, plan: DataPlan, model_type: str, layout: Layout, notes: list[str]
):
    """(training split, notes on the split): a global batch the user did not give shrinks to
    what the data holds (said in `notes`); errors name the user's --data, not its cache."""

    def fits(gbs: int, mbs: int) -> bool:
        return schedule_takes(cfg.schedule, layout.pp, gbs // (mbs * layout.dp), cfg.virtual_stages)

    assert plan.prefix is not None  # plan_data returns a plan without data before this
    for _ in range(4):  # a smaller batch can change the validation split: until it settles
        split_notes: list[str] = []
        try:
            train, val = build_datasets(cfg, plan.prefix, model_type, split_notes)
        except ValueError as exc:
            raise ValueError(_name_user_data(str(exc), cfg)) from None
        note = fit_batch_to_data(cfg, len(train), layout.dp, fits)
        if note is None:
            return train, val, split_notes
        notes.append(note)
    return train, val, split_notes


def _data_line(cfg: TrainConfig, samples: int, held: int, manifest: dict | None = None) -> str:
    """The log's line on how much data the run has and how much of it the run reads: its
    training samples, those held out for validation (and why, where they are far more than
    --val-fraction's share: whole documents, at least a global batch; what a given --eval-steps
    counts, where it is more than the split's batches), and --max-steps' share of an epoch (a
    run resumed from `manifest` at another global batch: the checkpoint's samples and the
    steps left's)."""
    drawn = cfg.max_steps * cfg.global_batch_size
    reads = f"--max-steps {cfg.max_steps} x {cfg.global_batch_size} sequences read {{:,}} of them"
    manifest = manifest or {}
    start = int(manifest.get("step", 0))
    before = manifest.get("meta", {}).get("consumed_samples")
    if before is not None and before != start * cfg.global_batch_size:  # batch changed
        left = max(cfg.max_steps - start, 0)
        drawn = int(before) + left * cfg.global_batch_size
        reads = (
            f"--max-steps {cfg.max_steps} read {{:,}} of them ({int(before):,} in the "
            f"checkpoint's {start} steps, then {left} x {cfg.global_batch_size})"
        )
    per_epoch = max(samples // cfg.global_batch_size, 1) * cfg.global_batch_size
    share = drawn / per_epoch  # an epoch's last, incomplete batch is dropped
    shown = f"{share:.2f}"
    if 0 < share < 0.01:  # not "0.00": two significant digits (0.0016, 0.000011)
        shown = f"{share:.{1 - math.floor(math.log10(share))}f}".rstrip("0").rstrip(".")
    epochs = f"{shown} of an epoch" if share < 1 else f"{share:.1f} epochs"
    unread = samples - per_epoch > 0.05 * samples  # a twentieth or more unread
    # or where the count shown is not drawn / samples (4,800 of 682: 7.1 epochs, not 7.0)
    if share >= 1 and (unread or f"{drawn / samples:.1f}" != f"{share:.1f}"):
        epochs += (
            f" (an epoch reads {per_epoch:,} of them, whole global batches: the last "
            f"{samples - per_epoch:,} of each epoch's order are left out)"
        )
    validation = (
        f" ({counted(held, 'sample')} held out for validation)" if held else " (no validation)"
    )
    if held and held > 2 * cfg.val_fraction * (samples + held):  # a few long documents
        validation = (
            f" ({counted(held, 'sample')} held out for validation: "
            f"{held / (samples + held):.0%}, where --val-fraction {cfg.val_fraction} asks "
            f"{cfg.val_fraction * 100:.3g}%, since the split holds out whole documents, at "
            f"least one global batch of them; --val-fraction 0 trains on all)"
        )
    batches = held // cfg.global_batch_size
    if held and "eval_steps" in given_now(cfg) and cfg.eval_steps > batches:
        validation = validation[:-1] + (  # a Trainer user's --eval-steps 500: every 500 steps
            f"; --eval-steps {cfg.eval_steps} counts the validation batches an evaluation reads, "
            f"not the steps between evaluations, --eval-interval's {cfg.eval_interval}: each "
            f"reads all {counted(batches, 'batch', 'batches')} the split holds)"
        )
    return (
        f"data: {_data_named(cfg)} holds {counted(samples, 'training sample')} of "
        f"{cfg.seq_len} tokens{validation}; {reads.format(drawn)}: {epochs}"
    )


def _name_user_data(message: str, cfg: TrainConfig) -> str:
    """A dataset error that names a tokenized copy in --data-cache names the user's file."""
    cache = os.path.abspath(os.path.expanduser(cfg.data_cache))
    first, sep, rest = message.partition(": ")
    if not sep or os.path.dirname(os.path.abspath(first)) != cache:
        return message
    items = cfg.data if isinstance(cfg.data, list) else [cfg.data]
    stem = os.path.basename(first).rsplit("-", 1)[0]
    users = [
        p
        for p in items
        if p
        and os.path.splitext(os.path.basename(os.path.expanduser(str(p)).rstrip("/")))[0] == stem
    ]
    data = users[0] if users else (cfg.data or "the shipped sample")
    return f"--data {data} (tokenized with --tokenizer {cfg.tokenizer}): {rest}"


def takes_save_lock() -> bool:
    """The process that locks --save: the launching one, or global rank 0 under torchrun /
    Slurm (if it is refused, it exits 2 and torchrun stops the other ranks)."""
    return (
        not under_launcher()
        or int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0
    )


def _check_compile_cache(path: str) -> None:
    """A ValueError naming TORCHINDUCTOR_CACHE_DIR where --compile's cache cannot be made or
    written there (`probe_writable`), before any worker (each rank's first compile would fail
    on it)."""
    try:
        probe_writable(path)
    except OSError as exc:
        raise ValueError(
            f"TORCHINDUCTOR_CACHE_DIR={path} cannot be --compile's cache "
            f"({exc.strerror or exc}); point it at a directory you can write, or unset it"
        ) from None
