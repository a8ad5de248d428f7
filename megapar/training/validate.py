"""Everything about a run that can be checked before a worker starts: megapar-train's
settings here, the rest in the `validate_*` modules beside it.

The CLI entry points call these in the launching process, so a mistake costs one line and
exit code 2 instead of N tracebacks after the workers started:

- `check_settings(cfg)`: every numeric flag of `megapar-train` (ranges, NaN / inf).
- `adapt_defaults(cfg, dp)`: values the user did not set give way to the ones they did
  (warmup vs --max-steps, --min-lr vs --lr, global vs micro-batch size, --loss-mean token on
  prompt / response records); returns notes saying what changed. `fit_batch_to_data` does the
  same for a global batch the data cannot fill.
- for a run that resumes, validate_resume.py: `check_load_path(cfg)` (a --load that names a
  file or a step that is not there is an error; a missing or empty directory starts fresh),
  `checkpoint_manifest(path)` (a --load checkpoint exists, is complete and intact: sizes and
  sha256 of every file), `settings_from_checkpoint` / `check_resumable` / `check_same_data`
  (`--load CKPT` alone resumes its run; a setting that breaks the checkpoint's data order, or
  data whose content changed since, is reported).
- megapar-eval's and megapar-bubble's checks are in validate_tools.py and validate_bubble.py;
  --fp8's, ZeRO's, unused flags' and SFT records' in validate_fp8.py, validate_sharding.py,
  validate_unused.py and validate_sft.py.

Unexpected errors in running workers are `megapar.faults.report`'s.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib.util
import os
from collections.abc import Callable

from megapar.checkpoint.format import probe_writable
from megapar.context_parallel.a2a import heads_error
from megapar.context_parallel.split import length_multiple
from megapar.data.blended import data_paths
from megapar.data.inputs import is_raw_text
from megapar.data.mlm_dataset import MIN_SEQ_LEN
from megapar.device import PEAK_TFLOPS, bf16_peak_of, too_fast
from megapar.env_seconds import problem as env_problem
from megapar.faults.slow import SlowRank
from megapar.mesh import Layout, LayoutError, layout_option
from megapar.models.config import ConfigError
from megapar.models.flops import heads
from megapar.pipeline.schedules import (
    chunks_per_rank,
    schedule_actions,
    schedule_takes,
)
from megapar.training.config import choice_problem, flag_choices
from megapar.training.empty_values import check_empty
from megapar.training.logging import WANDB_MODES
from megapar.training.ranges import check_ranges, default_of
from megapar.training.usage import UsageError, flag_of
from megapar.training.validate_fp8 import Fp8Error, check_fp8
from megapar.training.validate_sft import check_sft_keys, holds_records
from megapar.training.validate_sharding import (
    check_grad_wire,
    check_optimizer_sharding,
    check_zero3,
)
from megapar.training.validate_unused import check_unused
from megapar.wording import counted, scale_text


def check_settings(cfg) -> None:
    """Raise UsageError for the first setting out of range (NaN and inf included), then for
    the first combination of settings that cannot run."""
    check_ranges(cfg)
    if cfg.inject_slow is not None:
        try:
            SlowRank.parse(cfg.inject_slow)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    check_empty(cfg)

    wrong = env_problem()
    if wrong:  # read at import, where an invalid value falls back to the default
        raise UsageError(wrong)
    for name in flag_choices():
        problem = choice_problem(name, getattr(cfg, name))
        if problem:
            raise UsageError(problem)
    if cfg.sp_regather and not (cfg.sequence_parallel and cfg.tp > 1):
        missing = (
            "--tp > 1 (sequence parallelism splits over tp)"
            if cfg.sequence_parallel
            else "--sequence-parallel with --tp > 1"
        )
        raise UsageError(
            "--sp-regather changes what sequence parallelism keeps for the backward: "
            f"{'give' if cfg.sequence_parallel else 'add'} {missing}, or drop --sp-regather"
        )
    _check_combinations(cfg)


def _check_combinations(cfg) -> None:
    """UsageError for the first combination of settings that cannot run, naming the fix."""
    if cfg.min_lr > cfg.lr and "min_lr" in explicit(cfg):  # not given: it adapts to --lr
        raise UsageError(
            f"--min-lr {cfg.min_lr} is larger than --lr {cfg.lr}; lower --min-lr or raise --lr"
        )
    if refusal := too_fast(cfg.peak_tflops):  # GFLOP/s meant (989e3): an MFU of 0.00 %
        raise UsageError(refusal)
    scaled = cfg.precision == "fp16" and not cfg.loss_scale  # else the flags are unused
    if cfg.min_loss_scale > cfg.initial_loss_scale and scaled:  # (check_unused's line)
        recorded = "initial_loss_scale" in getattr(cfg, "from_checkpoint", ())
        raise UsageError(
            f"--min-loss-scale {scale_text(cfg.min_loss_scale)} is above "
            f"{named(cfg, 'initial_loss_scale', scale_text(cfg.initial_loss_scale))}: lower "
            f"--min-loss-scale or raise --initial-loss-scale"
            + (" (the resumed scale then restarts there)" if recorded else "")
        )
    given = given_now(cfg)
    check_unused(cfg, given)  # every flag this run would not read, in one line (the --zero3-*
    check_zero3(cfg)  # and --fp8-* ones were each refused alone first; a re-test)
    try:
        cfg.pipeline_split.check(cfg.pp)  # the model's layers are checked once it is read
    except LayoutError as exc:
        raise UsageError(str(exc)) from None
    tools = [n for n in ("record_step", "replay", "inject_corrupt") if getattr(cfg, n, None)]
    if cfg.compile and tools:
        raise UsageError(
            f"{flag_of(tools[0])} cannot be combined with --compile: its per-module hooks "
            f"sit inside the compiled blocks; run it without --compile (the eager blocks "
            f"compute the same values)"
        )
    try:
        check_fp8(cfg, hardware=not cfg.dry_run, given=given)
    except Fp8Error as exc:
        raise UsageError(str(exc)) from None
    check_sft_keys(cfg, given)
    check_optimizer_sharding(cfg)  # ZeRO 1/2 with compression, LAMB / LARS offloaded
    rehearsal = [
        name
        for name in ("world_size", "gpus_per_node", "gpu_memory_gb", "dry_run_ranks", "json")
        if name in explicit(cfg)
    ]
    if rehearsal and not cfg.dry_run:
        why = {
            "world_size": " (a run's world size is the number of processes started)",
            "gpus_per_node": " (a run's nodes are the ones torchrun or Slurm starts)",
        }
        raise UsageError(
            f"{flag_of(rehearsal[0])} only applies to a rehearsal: add --dry-run"
            f"{why.get(rehearsal[0], '')}"
        )
    if cfg.allow_data_change and not cfg.load:
        raise UsageError(
            "--allow-data-change only applies to a resume (it lets --load continue "
            "on changed --data): add --load CKPT or drop it"
        )
    if cfg.load_strict and not cfg.load:
        raise UsageError(
            "--load-strict only applies to --load (it makes a --load that holds no "
            "checkpoint an error): add --load CKPT or drop it"
        )
    if cfg.overwrite_newer and not cfg.save:
        raise UsageError(
            "--overwrite-newer only applies to --save (it lets this run replace newer "
            "steps there): add --save DIR or drop it"
        )
    if cfg.async_save and not cfg.save and not cfg.dry_run:
        raise UsageError(
            "--async-save writes the checkpoints of --save in the background: give "
            "--save DIR too (or drop --async-save)"
        )
    check_grad_wire(cfg)


def check_inject_slow(cfg, world_size: int) -> None:
    """--inject-slow names a rank of this run's `world_size` ranks, from a step it runs."""
    if cfg.inject_slow is not None:
        try:
            slow = SlowRank.parse(cfg.inject_slow)
            slow.check_world(world_size)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if slow.from_step > cfg.max_steps:
            raise UsageError(
                f"--inject-slow {cfg.inject_slow!r}: from_step={slow.from_step} is "
                f"after the run's last step (--max-steps {cfg.max_steps}), so no "
                f"step would be slowed; choose from_step <= {cfg.max_steps}"
            )


def check_mlm_seq_len(seq_len: int) -> None:
    """A BERT model's MLM samples need --seq-len >= 5 ([CLS] A [SEP] B [SEP])."""
    if seq_len < MIN_SEQ_LEN:
        raise UsageError(
            f"--seq-len {seq_len} is too short for a BERT model's samples: [CLS] A [SEP] B "
            f"[SEP] takes at least {MIN_SEQ_LEN} tokens; raise --seq-len"
        )


def check_mlm_token_types(config) -> None:
    """A BERT model's MLM samples give segment B token type 1: the model needs two types."""
    if config.type_vocab_size < 2:
        raise UsageError(
            f"the model's type_vocab_size is {config.type_vocab_size}, and megapar's BERT "
            f"samples ([CLS] A [SEP] B [SEP]) give segment B token type 1; use a BERT with "
            f"type_vocab_size >= 2"
        )


def check_cp_seq_len(
    seq_len: int,
    layout,
    sequence_parallel: bool = False,
    shown: str | None = None,
    runs: Callable[[int], bool] | None = None,
) -> None:
    """Context parallelism cuts each sequence into 2 x cp chunks (and, under sequence
    parallelism, a cp rank's tokens into tp slices): --seq-len must be a multiple of
    `length_multiple` (the rule the cp split itself checks, `check_length`). The refusal names
    the --cp sizes that fit the length too, of those `runs` takes (the job's world at that
    --cp); `shown`: --seq-len as the message names it, e.g. one a --load checkpoint recorded
    (`named`)."""
    cp, tp = layout.cp, layout.tp
    need = length_multiple(cp, tp, sequence_parallel)
    if cp > 1 and seq_len % need:
        why = " and each cp rank's tokens into --tp slices" if need != 2 * cp else ""
        fits = [  # near the --cp given: a --cp 31 for --cp 2 would be 29 more processes
            str(c)
            for c in range(2, min(seq_len // 2, 2 * cp) + 1)
            if seq_len % length_multiple(c, tp, sequence_parallel) == 0
            and (runs is None or runs(c))
        ][:4]
        other = f", or a --cp it allows ({', '.join(fits)})" if fits else ""
        raise UsageError(
            f"{shown or f'--seq-len {seq_len}'} is not divisible by {need}: --cp {cp} cuts "
            f"each sequence into 2 x cp = {2 * cp} chunks{why}; choose a multiple "
            f"of {need}{other}"
        )


def check_documents(cfg, config, api: bool = False) -> None:
    """--attention-mask-type block_causal, --reset-position-ids and --eod-mask-loss read the
    documents packed into a decoder's sequences: BERT's samples are one sentence pair each;
    `megapar.prepare` needs the end-of-document id, which must be inside the vocabulary.
    UsageError naming the fix."""

    def name(field: str, value: object = None) -> str:
        if api:
            return f"{field}={value!r}" if value is not None else f"{field}=True"
        return "--" + field.replace("_", "-") + (f" {value}" if value is not None else "")

    used = [
        name(f, v)
        for f, v, on in (
            ("attention_mask_type", "block_causal", cfg.attention_mask_type == "block_causal"),
            ("reset_position_ids", None, cfg.reset_position_ids),
            ("eod_mask_loss", None, cfg.eod_mask_loss),
        )
        if on
    ]
    if not used:
        return
    if config.model_type == "bert":
        raise UsageError(
            f"{used[0]} reads the documents packed into a decoder's sequences, and BERT's "
            f"samples are one sentence pair each; drop it or train GPT-2 or a Llama-family model"
        )
    if api and cfg.eod_id is None:
        raise UsageError(
            f"{used[0]} needs the end-of-document token's id: pass eod_id= (e.g. "
            f"tokenizer.eos_token_id)"
        )
    if cfg.eod_id is not None and cfg.eod_id >= config.vocab_size:
        raise UsageError(
            f"{name('eod_id', cfg.eod_id)} is outside the model's vocabulary of "
            f"{config.vocab_size} ids; give the tokenizer's end-of-document id"
        )


def check_cp_comm(comm_type: str, layout, config, api: bool = False) -> None:
    """--cp-comm-type a2a at cp > 1 gives each cp rank a cp-th of a tp rank's query heads: they
    must divide over cp (`a2a.heads_error`); UsageError naming the fix."""
    if comm_type != "a2a" or layout.cp == 1:
        return
    per_tp = heads(config) // layout.tp
    why = heads_error(per_tp, layout.cp)
    if why is None:
        return
    flag, other = (
        ("cp_comm_type='a2a'", "cp_comm_type='p2p'")
        if api
        else ("--cp-comm-type a2a", "--cp-comm-type p2p")
    )
    fits = [str(c) for c in range(2, per_tp + 1) if per_tp % c == 0]
    total = heads(config)
    # a smaller tp only where it gives each tp rank heads that divide over this cp
    tps = [
        str(t)
        for t in range(1, layout.tp)
        if total % t == 0 and heads_error(total // t, layout.cp) is None
    ]
    fixes = []
    if fits:
        fixes.append(f"{layout_option('cp', ' or '.join(fits), api)} (dividing {per_tp})")
    if tps:
        fixes.append(
            f"{layout_option('tp', ' or '.join(tps), api)} (its heads per tp rank divide over "
            f"cp {layout.cp})"
        )
    fixes.append(f"{other} (the ring scales past the head count)")
    raise UsageError(
        f"{flag} at cp {layout.cp}: {why} ({total} heads / tp {layout.tp}); use "
        f"{', '.join(fixes[:-1])}{', or ' if len(fixes) > 1 else ''}{fixes[-1]}"
    )


def _fits(world: int, tp: int, pp: int, cp: int, ep: int, batch: tuple[int, int] | None) -> bool:
    """Whether a world of `world` ranks divides into tp x cp x pp, leaving a dp x cp that `ep`
    divides and a dp whose micro-batches of `batch` (global batch, micro-batch size; None: not
    fixed) the global batch divides."""
    if world % (tp * pp * cp) or (world // (tp * pp)) % ep:
        return False
    dp = world // (tp * pp * cp)
    return batch is None or batch[0] % (batch[1] * dp) == 0


def pps_taken(
    layers: int, world: int, tp: int, cp: int, ep: int = 1, batch=None, chunks: int = 1
) -> list[int]:
    """Of the pp values a model of `layers` layers takes in `chunks` model chunks per rank
    (each at least one layer), those a world of `world` ranks takes (`_fits`), largest first;
    [] where each one fits, or none does: the model's "lower --pp to 4 or less" was refused
    next for --pp 4 at 6 processes (megapar-train's note under a fixed world, megapar-plan's
    under --gpus)."""
    offered = [p for p in range(layers // chunks, 0, -1)]
    fits = [p for p in offered if _fits(world, tp, p, cp, ep, batch)]
    return fits if len(fits) < len(offered) else []


def tps_taken(config, world: int, pp: int, cp: int, ep: int = 1, batch=None) -> list[int]:
    """Of the tp values model `config` takes at `pp` and `cp`, those a world of `world` ranks
    takes (`_fits`: tp x cp x pp dividing it, ep the dp x cp, the global batch of `batch` the
    dp's micro-batches); [] where each one the model takes fits, or none does (nothing to add
    beside the model's refusal, which names them): megapar-train's note under a fixed world and
    megapar-plan's under --gpus (the model offered --tp 4 to 2 processes, refused next; --tp 2
    at --ep 4 of 4 processes; tp=2 at --gpus 8 for a global batch of 6)."""

    def model_takes(tp: int) -> bool:
        try:
            config.validate(Layout(tp, pp, 1, cp=cp))
        except (LayoutError, ConfigError):
            return False
        return True

    offered = [t for t in range(1, 257) if model_takes(t)]  # (no model has more heads here)
    fits = [t for t in offered if _fits(world, t, pp, cp, ep, batch)]
    return fits if len(fits) < len(offered) else []


def named(cfg, name: str, value=None) -> str:
    """A setting as an error message names it: ``--data X``, and for a value the --load
    checkpoint recorded (the user gave none) ``--data X (not given: the value --load CK
    recorded)``, so the message does not blame a flag the user never typed."""
    value = getattr(cfg, name) if value is None else value
    shown = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else value
    if name in getattr(cfg, "from_checkpoint", ()):
        return f"{flag_of(name)} {shown} (not given: the value --load {cfg.load} recorded)"
    return f"{flag_of(name)} {shown}"


def explicit(cfg) -> set[str]:
    """The settings the user gave (flags or --config keys); without that record (a config
    built in code), the ones that differ from their defaults."""
    given = getattr(cfg, "explicit", None)
    if given is not None:
        return set(given)
    return {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != f.default}


def given_now(cfg) -> set[str]:
    """The settings given on this run's command line or --config: `explicit`, without those a
    --load run took from the checkpoint (`settings_from_checkpoint`'s `from_checkpoint`)."""
    return explicit(cfg) - set(getattr(cfg, "from_checkpoint", ()))


def adapt_defaults(cfg, dp: int) -> list[str]:
    """Let settings the user did not give adapt to the ones they gave; returns notes.

    Only settings the user gave are checked against each other (by the caller, afterwards)."""
    given, notes = explicit(cfg), []
    if "warmup_steps" not in given:
        end = cfg.lr_decay_steps or cfg.max_steps  # where the decay ends
        warmup = min(cfg.warmup_steps, end // 10)
        if warmup != cfg.warmup_steps:
            of = f"--lr-decay-steps {end}" if cfg.lr_decay_steps else f"--max-steps {end}"
            notes.append(
                f"--warmup-steps not given: using {warmup} (10 % of {of}) instead of the "
                f"default {cfg.warmup_steps}"
            )
            cfg.warmup_steps = warmup
    if "min_lr" not in given:
        low, peak = default_of(cfg, "min_lr"), default_of(cfg, "lr")
        min_lr = min(low, float(f"{cfg.lr * low / peak:.12g}"))  # the defaults' ratio, at most
        if min_lr != cfg.min_lr and cfg.lr_decay != "constant":  # constant never reads it
            notes.append(
                f"--min-lr not given: using {min_lr:g} (--lr {cfg.lr:g} x {low / peak:g}"
                f", the defaults' ratio) instead of the default {cfg.min_lr:g}"
            )
        cfg.min_lr = min_lr
    per_step = cfg.micro_batch_size * dp
    if cfg.global_batch_size % per_step:
        if "global_batch_size" not in given:
            gbs = max(1, round(cfg.global_batch_size / per_step)) * per_step
            notes.append(
                f"--global-batch-size not given: using {gbs} (a multiple of "
                f"micro-batch size {cfg.micro_batch_size} x dp {dp}) instead of the "
                f"default {cfg.global_batch_size}"
            )
            cfg.global_batch_size = gbs
        elif "micro_batch_size" not in given and cfg.global_batch_size % dp == 0:
            per_rank = cfg.global_batch_size // dp
            mbs = max(d for d in range(1, cfg.micro_batch_size + 1) if per_rank % d == 0)
            notes.append(
                f"--micro-batch-size not given: using {mbs} (divides --global-batch-"
                f"size {cfg.global_batch_size} / dp {dp}) instead of the default "
                f"{cfg.micro_batch_size}"
            )
            cfg.micro_batch_size = mbs
    if "micro_batch_size" not in given:
        notes.extend(_micro_batches_for_schedule(cfg, dp))
    if "loss_mean" not in given and trains_on_records(cfg):  # said by the records' log line
        cfg.loss_mean = "token"
    notes.extend(_inert_zero_settings(cfg, dp))
    given = given_now(cfg)
    for name, idle, where in [
        (
            "p2p_dtype",
            cfg.pp == 1,
            "--pp 1: no pipeline messages to narrow, it applies with --pp > 1",
        ),
        ("grad_reduce_dtype", dp * cfg.cp == 1, "dp x cp = 1: no data-parallel reduction"),
        ("grad_compression", dp * cfg.cp == 1, "dp x cp = 1: no data-parallel reduction"),
    ]:
        if name in given and idle:  # accepted, as --sequence-parallel at --tp 1; said once
            notes.append(f"{flag_of(name)} {getattr(cfg, name)} at {where}")
    gpu = bf16_peak_of(cfg.peak_tflops, cfg.precision)
    if gpu and "peak_tflops" in given:  # megapar-plan's fp32 command carries it so
        _, tf32, fp32 = PEAK_TFLOPS[gpu]
        notes.append(
            f"--peak-tflops {cfg.peak_tflops:g} is an {gpu}'s bf16 peak, the MFU's denominator; "
            f"fp32 matmuls run at its fp32 rate ({fp32:g}, {tf32:g} with --tf32): give that, "
            f"or leave --peak-tflops out on that GPU"
        )
    return notes


def trains_on_records(cfg) -> bool:
    """Whether the run trains on prompt / response records: --sft-keys, or --data (or a part of
    its blend) a dataset megapar-data --sft-keys wrote. Their loss defaults to the global
    batch's token mean (--loss-mean token), as TRL's and torchtune's SFT loss: most tokens are
    -100 (prompts, padding), so a micro-batch mean would weigh a micro-batch of short responses
    as much as one of long ones and count one with no response token as a loss of 0."""
    if cfg.sft_keys is not None:
        return True
    try:
        paths = data_paths(cfg.data)
    except ValueError:  # a malformed blend: named by its own check
        return False
    return any(path is not None and holds_records(os.path.expanduser(path)) for path in paths)


def _micro_batches_for_schedule(cfg, dp: int) -> list[str]:
    """Where the pipeline schedule refuses the step's m = global batch / (micro-batch size x
    dp) micro-batches (DualPipeV's m >= 2 pp, interleaved 1F1B's equal rounds), the largest
    smaller micro-batch size whose m it takes, with the note saying so; none if no size does
    (the caller's check then names the problem)."""
    if cfg.pp == 1 or cfg.global_batch_size % dp:
        return []
    per_rank = cfg.global_batch_size // dp

    def takes(mbs: int) -> bool:
        return schedule_takes(cfg.schedule, cfg.pp, per_rank // mbs, cfg.virtual_stages)

    if per_rank % cfg.micro_batch_size or takes(cfg.micro_batch_size):
        return []
    fits = [d for d in range(cfg.micro_batch_size - 1, 0, -1) if per_rank % d == 0 and takes(d)]
    if not fits:
        return []
    was, cfg.micro_batch_size = cfg.micro_batch_size, fits[0]
    return [
        f"--micro-batch-size not given: using {fits[0]} (--schedule {cfg.schedule} at --pp "
        f"{cfg.pp} does not take {per_rank // was} micro-batches a step; "
        f"{per_rank // fits[0]} it does) instead of {was}"
    ]


def _inert_zero_settings(cfg, dp: int) -> list[str]:
    """Notes for ZeRO settings that change nothing in this run (accepted, said once)."""
    notes = []
    if cfg.zero and dp * cfg.cp == 1:
        notes.append(
            f"--zero {cfg.zero} with dp x cp = 1: there is no rank to shard over, so "
            f"every rank keeps whole state"
            + (" (--offload-optimizer still applies)" if cfg.offload_optimizer else "")
            + (
                "; --offload-params changes nothing here: it keeps ZeRO-3's parameter shards "
                "on the host, and there are none"
                if cfg.offload_params
                else ""
            )
            + (
                "; --muon-distributed has no data-parallel rank to split the "
                "orthogonalisation over: every rank orthogonalises each of its matrices (a "
                "tp-split one all-gathered over tp), as without it"
                if cfg.optimizer == "muon" and cfg.muon_distributed
                else ""
            )
        )
    m = cfg.global_batch_size // max(1, cfg.micro_batch_size * dp)
    if cfg.zero == 3 and cfg.zero3_reduce == "micro-batch":
        if m == 1:
            notes.append(
                "--zero3-reduce micro-batch with one micro-batch per step: the same as step"
            )
        elif _has_w_passes(cfg, m):
            notes.append(
                f"--zero3-reduce micro-batch under --schedule {cfg.schedule}: its W "
                f"passes report the weight gradients once a step, so the units reduce "
                f"once a step, as with step"
            )
    return notes


def _has_w_passes(cfg, m: int) -> bool:
    try:
        actions = schedule_actions(
            cfg.schedule, cfg.pp, m, 0, chunks_per_rank(cfg.schedule, cfg.virtual_stages)
        )
    except ValueError:  # an m the schedule refuses: the caller's checks say so
        return False
    return any(a.kind == "backward_weight" for a in actions)


def fit_batch_to_data(cfg, samples: int, dp: int, fits=lambda gbs, mbs: True) -> str | None:
    """When the training split holds fewer than one global batch and the user gave neither
    --global-batch-size nor (for a smaller one) --micro-batch-size: the largest global batch
    the data holds, a multiple of micro-batch size x dp that `fits` the layout (the pipeline
    schedule). Returns the note, or None when nothing may (or can) change."""
    given = explicit(cfg)
    if samples >= cfg.global_batch_size or "global_batch_size" in given:
        return None
    sizes = (
        [cfg.micro_batch_size]
        if "micro_batch_size" in given
        else range(cfg.micro_batch_size, 0, -1)
    )
    best = max(
        (
            (samples // (m * dp) * m * dp, m)
            for m in sizes
            if samples >= m * dp and fits(samples // (m * dp) * m * dp, m)
        ),
        default=None,
    )
    if best is None:
        return None
    (gbs, mbs), was = best, (cfg.global_batch_size, cfg.micro_batch_size)
    cfg.global_batch_size, cfg.micro_batch_size = gbs, mbs
    also = f" and micro-batch size {mbs}" if mbs != was[1] else ""
    return (
        f"--global-batch-size not given: using {gbs}{also} (the training split holds "
        f"{counted(samples, 'sample')} of {cfg.seq_len} tokens) instead of {was[0]}"
    )


# --- output locations -------------------------------------------------------------------------
def names_directory(path: str) -> bool:
    """Whether `path` names a directory: one that exists, or a path ending in a separator
    (``logs/``), which the OS would resolve as one."""
    return path.endswith(("/", os.sep)) or os.path.isdir(os.path.expanduser(path))


def unwritable_in(exc: OSError, directory: str) -> bool:
    """Whether `exc` is a write refused (EACCES, EPERM, EROFS) at or under `directory`."""
    if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS) or not exc.filename:
        return False
    path, root = os.path.abspath(os.fsdecode(exc.filename)), os.path.abspath(directory)
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def broken_link(path: str) -> str | None:
    """What is wrong with the first link on `path` (itself or a directory above it) that leads
    to nothing: "LINK is a link to X, which does not exist" or "LINK is a link in a loop of
    links"; None where every link on it leads somewhere (below one to nothing, the path was
    "not writable (LINK is a file, not a directory)"; re-tests)."""
    parts = os.path.abspath(path).split(os.sep)
    for end in range(2, len(parts) + 1):
        here = os.sep.join(parts[:end])
        if not os.path.islink(here):
            continue
        try:
            os.stat(here)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return f"{here} is a link in a loop of links"
            hop = os.readlink(here)  # a link to a link to nothing leads nowhere
            after = os.path.join(os.path.dirname(here), hop)
            why = "leads nowhere" if os.path.lexists(after) else "does not exist"
            return f"{here} is a link to {hop}, which {why}"
    return None


def check_writable(path: str, flag: str, kind: str = "dir") -> None:
    """Raise ValueError unless `path` (a directory, or a file's directory) can be written now.

    Creates the directory (as the run would) and writes and removes a probe file there, so a
    read-only mount, an immutable directory or a path under /proc is found before any work."""

    target = os.path.expanduser(path)
    directory = target if kind == "dir" else (os.path.dirname(os.path.abspath(target)) or ".")
    if kind == "dir" and os.path.exists(target) and not os.path.isdir(target):
        raise ValueError(
            f"{flag} {path} is a file, not a directory; choose a directory (or remove the file)"
        )
    if kind == "file" and names_directory(path):
        raise ValueError(f"{flag} {path} is a directory; give a file name")
    if (broken := broken_link(target)) is not None:  # (a file's write failed after the
        thing = "file name" if kind == "file" else "directory"  # run's work; a directory's,
        raise ValueError(f"{flag} {path}: {broken}; give another {thing}, or remove the link")
    try:
        probe_writable(directory)
        if kind == "file" and os.path.exists(target):
            with open(target, "a"):
                pass
    except OSError as exc:
        if exc.errno == errno.ENOENT:  # /proc ("No such file or directory ENOENT", of its
            above = os.path.abspath(directory)  # probe or of the directory it made; a re-test):
            while not os.path.isdir(above) and os.path.dirname(above) != above:
                above = os.path.dirname(above)  # the nearest directory that exists
            raise ValueError(
                f"{flag} {path} is not writable: nothing can be created in {above}; choose a "
                f"location you can write to"
            ) from None
        reason = errno.errorcode.get(exc.errno, "") if exc.errno else ""
        raise ValueError(
            f"{flag} {path} is not writable ({exc.strerror or exc}"
            f"{' ' + reason if reason else ''}); choose a location you can write "
            f"to"
        ) from None


def unchecked_outputs(cfg) -> list[str]:
    """A rehearsal's note on what `check_outputs` checks of the run and a rehearsal does not
    (its paths are the cluster's, its W&B is the cluster's install and environment), naming
    the run's outputs; none where it has none."""
    given = [
        f"{flag} {value}"
        for flag, value in (
            ("--save", cfg.save),
            ("--log-json", cfg.log_json),
            ("--tensorboard", cfg.tensorboard),
            ("--profile-dir", cfg.profile_dir if cfg.profile_steps else None),
            ("--wandb-project", cfg.wandb_project),
        )
        if value
    ]
    if not given:
        return []
    return [
        f"dry run: the run's outputs are the cluster's and not checked here ({', '.join(given)}); "
        f"the run checks that each is writable (and W&B's install and WANDB_MODE) before its "
        f"workers start"
    ]


def check_outputs(cfg) -> None:
    """Every output location of a training run, checked in the launching process."""
    if cfg.save:
        check_writable(cfg.save, "--save")
    if cfg.log_json:
        check_writable(cfg.log_json, "--log-json", kind="file")
    if cfg.tensorboard:
        check_writable(cfg.tensorboard, "--tensorboard")
    if cfg.profile_steps:  # without --profile-steps nothing is written there
        check_writable(cfg.profile_dir, "--profile-dir")
    if cfg.wandb_project and importlib.util.find_spec("wandb") is None:
        raise UsageError(
            "--wandb-project needs wandb, which is not installed: pip install "
            "'megapar[wandb]' (or wandb), or log with --tensorboard / --log-json"
        )
    mode = os.environ.get("WANDB_MODE")
    if cfg.wandb_project and mode and mode not in WANDB_MODES:
        raise UsageError(
            f"--wandb-project: WANDB_MODE={mode!r} is not one of W&B's modes "
            f"({', '.join(WANDB_MODES)}); set one, or unset WANDB_MODE to log online when "
            f"the server answers (offline otherwise)"
        )

    # raw text is tokenized into it, once: an existing cache may hold this text's copy and be
    # read-only (shared), so a write it needs is refused when made (`data._resolve_one`)
    raw = any(p is None or is_raw_text(os.path.expanduser(p)) for p in data_paths(cfg.data))
    if raw and not os.path.isdir(os.path.expanduser(cfg.data_cache)):
        check_writable(cfg.data_cache, "--data-cache")
