"""Everything about a run that can be checked before a worker starts, checked in one place.

The CLI entry points call these in the launching process, so a mistake costs one line and
exit code 2 instead of N tracebacks after the workers started:

- `check_settings(cfg)`: every numeric flag of `megapar-train` (ranges, NaN / inf).
- `adapt_defaults(cfg, dp)`: values the user did not set give way to the ones they did
  (warmup vs --max-steps, --min-lr vs --lr, global vs micro-batch size); returns notes saying
  what changed. `fit_batch_to_data` does the same for a global batch the data cannot fill.
- `check_load_path(cfg)`: a --load that names a file or a step that is not there is an error
  (a missing or empty directory starts fresh: a requeued job).
- `checkpoint_manifest(path)`: a --load checkpoint exists, is complete and intact (sizes and
  sha256 of every file), read once here.
- `settings_from_checkpoint` / `check_resumable` / `check_same_data`: `--load CKPT` alone
  resumes its run; a setting that breaks the checkpoint's data order, or data whose content
  changed since, is reported.
- megapar-eval's and megapar-bubble's checks are in validate_tools.py.

Unexpected errors in running workers are failures.py's.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib.util
import math
import os
import re

from megapar.checkpoint.distributed import NON_STRUCTURAL
from megapar.checkpoint.format import MANIFEST, CheckpointError, probe_writable
from megapar.checkpoint.manifest import verify
from megapar.checkpoint.publish import has_checkpoint, steps_after
from megapar.data.blended import data_paths
from megapar.data.inputs import is_raw_text
from megapar.faults.slow import SlowRank
from megapar.models.config import config_from_dict
from megapar.pipeline.schedules import chunks_per_rank, schedule_actions
from megapar.training.config import flag_choices


class UsageError(ValueError):
    """A bad input: the message names the problem and the fix (exit code 2)."""


# --- megapar-train ---------------------------------------------------------------------------
# (field, kind, lowest allowed, lowest is allowed itself[, (value that turns it off, meaning)]):
# kind "int" or "float" (finite).
_RULES = [
    ("tp", "int", 1, True), ("cp", "int", 1, True), ("pp", "int", 1, True),
    ("dp", "int", 1, True),
    ("seq_len", "int", 1, True), ("micro_batch_size", "int", 1, True),
    ("global_batch_size", "int", 1, True), ("max_steps", "int", 1, True),
    ("warmup_steps", "int", 0, True), ("eval_interval", "int", 0, True),
    ("eval_steps", "int", 1, True), ("save_interval", "int", 0, True),
    ("log_interval", "int", 1, True), ("seed", "int", 0, True),
    ("lr", "float", 0.0, False), ("min_lr", "float", 0.0, True),
    ("weight_decay", "float", 0.0, True), ("clip_grad", "float", 0.0, True),
    ("peak_tflops", "float", 0.0, False), ("timeout_s", "float", 0.0, False),
    ("nccl_timeout_s", "float", 0.0, False),
    ("val_fraction", "float", 0.0, True), ("virtual_stages", "int", 1, True),
    ("adam_eps", "float", 0.0, False), ("grad_bucket_mb", "float", 0.0, False),
    ("adam_beta1", "float", 0.0, True), ("adam_beta2", "float", 0.0, True),
    ("powersgd_rank", "int", 1, True),
    ("lr_scale_with_batch", "int", 1, True, (0, "off")),
    ("max_nonfinite_steps", "int", 1, True, (0, "never stop")),
    ("exit_interval", "int", 1, True, (0, "never")),
    ("record_step", "int", 1, True, (0, "none")), ("replay", "int", 1, True, (0, "off")),
    ("exit_duration_mins", "float", 0.0, False, (0, "no limit")),
    ("straggler_factor", "float", 1.0, False, (0, "off")),
    ("world_size", "int", 1, True), ("gpus_per_node", "int", 1, True),
]


_EXAMPLE_PATHS = {"save": "ckpt", "log_json": "run.jsonl", "tensorboard": "tb"}

MAX_TIMEOUT_S = 1e9
"""Longest --timeout-s / --nccl-timeout-s: torch's TCPStore fails at once from about 1e10 s
(its deadline in int64 nanoseconds overflows), gloo from 1e13, datetime.timedelta from 8.64e13
(measured with torch 2.13)."""


def flag_of(name: str) -> str:
    """The command-line flag of config field `name` (``--name-with-dashes``)."""
    return "--" + name.replace("_", "-")


def _default(cfg, name: str):
    return next(f.default for f in dataclasses.fields(cfg) if f.name == name)


def check_settings(cfg) -> None:
    """Raise UsageError for the first setting out of range (NaN and inf included)."""
    for name, kind, low, inclusive, *off in _RULES:
        value = getattr(cfg, name)
        if value is None or (off and value == off[0][0] and not isinstance(value, bool)):
            continue
        bound = f">= {low}" if inclusive else f"> {low}"
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if kind == "int":
            ok = ok and math.isfinite(value) and float(value).is_integer()
            if ok:
                value = int(value)  # 32.0 from a --config file is 32
                setattr(cfg, name, value)
        else:
            ok = ok and math.isfinite(value)
        if ok:
            ok = value >= low if inclusive else value > low
        if not ok:
            what = "a whole number" if kind == "int" else "a finite number"
            default = _default(cfg, name)
            hint = f" (the default is {default})" if default is not None else ""
            if off:
                hint = f", or {off[0][0]} for {off[0][1]}" + (" (the default)" if
                                                              default == off[0][0] else hint)
            raise UsageError(f"{flag_of(name)} {value} is invalid: it must be {what} {bound}{hint}")

    if cfg.inject_slow is not None:
        try:
            SlowRank.parse(cfg.inject_slow)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    for name in ("save", "log_json", "tensorboard"):  # "" would silently write nothing
        if getattr(cfg, name) == "":
            raise UsageError(f"{flag_of(name)} '' is an empty path: give a path (e.g. "
                             f"{flag_of(name)} {_EXAMPLE_PATHS[name]}), or leave the flag out")

    for name in ("timeout_s", "nccl_timeout_s"):
        if getattr(cfg, name) > MAX_TIMEOUT_S:
            raise UsageError(f"{flag_of(name)} {getattr(cfg, name):g} is invalid: at most "
                             f"{MAX_TIMEOUT_S:g} s (about 31 years; torch's rendezvous store "
                             f"counts its wait in nanoseconds and fails at once from about 1e10 "
                             f"s); give a finite wait in seconds (the default is "
                             f"{_default(cfg, name):g})")
    for name, allowed in flag_choices().items():
        if getattr(cfg, name) not in allowed:
            raise UsageError(f"{flag_of(name)} {getattr(cfg, name)!r} is invalid: choose one of "
                             f"{', '.join(map(str, allowed))}")
    for name in ("adam_beta1", "adam_beta2"):
        if getattr(cfg, name) >= 1:
            raise UsageError(f"{flag_of(name)} {getattr(cfg, name)} is invalid: it must be in "
                             f"[0, 1) (the default is {_default(cfg, name)})")
    if cfg.val_fraction >= 1:
        raise UsageError(f"--val-fraction {cfg.val_fraction} is invalid: it is the share of "
                         f"documents held out, in [0, 1) (e.g. 0.05; 0 disables validation)")
    if cfg.min_lr > cfg.lr and "min_lr" in explicit(cfg):  # not given: it adapts to --lr
        raise UsageError(f"--min-lr {cfg.min_lr} is larger than --lr {cfg.lr}; lower --min-lr "
                         f"or raise --lr")
    check_zero3(cfg)
    if cfg.zero in (1, 2) and cfg.grad_compression != "none":
        raise UsageError(f"--grad-compression {cfg.grad_compression} cannot be combined with "
                         f"--zero {cfg.zero}: the distributed optimizer reduce-scatters the gradient "
                         f"buffer, the compressors compress an all-reduce; drop one of them")
    if cfg.offload_params and cfg.zero != 3:
        alone = "" if cfg.offload_optimizer else ", or use --offload-optimizer"
        raise UsageError(f"--offload-params needs --zero 3 (it keeps the parameter shards in "
                         f"host memory; --zero {cfg.zero} keeps whole parameters on the device): "
                         f"add --zero 3{alone}")
    if cfg.offload_optimizer and cfg.optimizer in ("lamb", "lars"):
        raise UsageError(f"--offload-optimizer steps AdamW or SGD on the host, not --optimizer "
                         f"{cfg.optimizer} (its trust ratios need whole-parameter norms on the "
                         f"devices): drop --offload-optimizer or use --optimizer adamw")
    rehearsal = [name for name in ("world_size", "gpus_per_node", "dry_run_ranks", "json")
                 if name in explicit(cfg)]
    if rehearsal and not cfg.dry_run:
        why = {"world_size": " (a run's world size is the number of processes started)",
               "gpus_per_node": " (a run's nodes are the ones torchrun or Slurm starts)"}
        raise UsageError(f"{flag_of(rehearsal[0])} only applies to a rehearsal: add --dry-run"
                         f"{why.get(rehearsal[0], '')}")
    if cfg.async_save and not cfg.save and not cfg.dry_run:
        raise UsageError("--async-save writes the checkpoints of --save in the background: give "
                         "--save DIR too (or drop --async-save)")
    if cfg.grad_compression != "none" and cfg.grad_reduce_dtype != "auto":
        raise UsageError(f"--grad-reduce-dtype {cfg.grad_reduce_dtype} and --grad-compression "
                         f"{cfg.grad_compression} both choose how gradients travel; give one "
                         f"(--grad-compression bf16 / fp16 is a reduction in that dtype)")


def check_zero3(cfg) -> None:
    """What --zero 3 cannot serve yet: one line naming the combination and what to use."""
    if cfg.zero3_keep_params and cfg.zero != 3:
        raise UsageError("--zero3-keep-params only applies to --zero 3 (it keeps a unit's "
                         "gathered parameters over the step); add --zero 3 or drop it")
    if cfg.zero3_reduce != "step" and cfg.zero != 3:
        already = " (--zero 2 reduces every micro-batch already)" if cfg.zero == 2 else ""
        raise UsageError(f"--zero3-reduce {cfg.zero3_reduce} only applies to --zero 3{already}; "
                         f"add --zero 3 or drop it")
    if cfg.zero3_persistence_threshold and cfg.zero != 3:
        raise UsageError("--zero3-persistence-threshold only applies to --zero 3; add --zero 3 "
                         "or drop it")
    if cfg.zero3_persistence_threshold < 0:
        raise UsageError(f"--zero3-persistence-threshold {cfg.zero3_persistence_threshold} is "
                         f"invalid: give a number of elements >= 0 (0: none persist)")
    if cfg.zero != 3:
        return
    if cfg.grad_compression != "none":
        raise UsageError(f"--grad-compression {cfg.grad_compression} cannot be combined with "
                         f"--zero 3 (gradients are reduce-scattered per unit, the compressors "
                         f"compress an all-reduce); use --zero 0, or --grad-compression none")
    if cfg.grad_reduce_dtype not in ("auto", "fp32"):
        raise UsageError(f"--grad-reduce-dtype {cfg.grad_reduce_dtype} is not served with "
                         f"--zero 3 (its reduce-scatters run in fp32); use --zero 1 for a "
                         f"{cfg.grad_reduce_dtype} reduction, or drop --grad-reduce-dtype")
    if cfg.offload_params and not cfg.offload_optimizer:
        raise UsageError("--offload-params needs --offload-optimizer (the host-held parameter "
                         "shards are the weights the optimizer steps, so it steps on the host "
                         "too, as DeepSpeed's offload_param with offload_optimizer): add "
                         "--offload-optimizer")


def check_inject_slow(cfg, world_size: int) -> None:
    """--inject-slow names a rank of this run's `world_size` ranks."""
    if cfg.inject_slow is not None:
        try:
            SlowRank.parse(cfg.inject_slow).check_world(world_size)
        except ValueError as exc:
            raise UsageError(str(exc)) from None


def check_cp_seq_len(seq_len: int, layout, sequence_parallel: bool = False) -> None:
    """Context parallelism cuts each sequence into 2 x cp chunks (and, under sequence
    parallelism, a cp rank's tokens into tp slices): --seq-len must allow both."""
    cp, tp = layout.cp, layout.tp
    need = math.lcm(2 * cp, cp * tp) if sequence_parallel and tp > 1 else 2 * cp
    if cp > 1 and seq_len % need:
        why = " and each cp rank's tokens into --tp slices" if need != 2 * cp else ""
        raise UsageError(f"--seq-len {seq_len} is not divisible by {need}: --cp {cp} cuts "
                         f"each sequence into 2 x cp = {2 * cp} chunks{why}; choose a multiple "
                         f"of {need}")


def explicit(cfg) -> set[str]:
    """The settings the user gave (flags or --config keys); without that record (a config
    built in code), the ones that differ from their defaults."""
    given = getattr(cfg, "explicit", None)
    if given is not None:
        return set(given)
    return {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != f.default}


def adapt_defaults(cfg, dp: int) -> list[str]:
    """Let settings the user did not give adapt to the ones they gave; returns notes.

    Only settings the user gave are checked against each other (by the caller, afterwards)."""
    given, notes = explicit(cfg), []
    if "warmup_steps" not in given:
        warmup = min(cfg.warmup_steps, cfg.max_steps // 10)
        if warmup != cfg.warmup_steps:
            notes.append(f"--warmup-steps not given: using {warmup} (10 % of --max-steps "
                         f"{cfg.max_steps}) instead of the default {cfg.warmup_steps}")
            cfg.warmup_steps = warmup
    if "min_lr" not in given:
        low, peak = _default(cfg, "min_lr"), _default(cfg, "lr")
        min_lr = min(low, float(f"{cfg.lr * low / peak:.12g}"))  # the defaults' ratio, at most
        if min_lr != cfg.min_lr:
            notes.append(f"--min-lr not given: using {min_lr:g} (--lr {cfg.lr:g} x {low / peak:g}"
                         f", the defaults' ratio) instead of the default {cfg.min_lr:g}")
            cfg.min_lr = min_lr
    per_step = cfg.micro_batch_size * dp
    if cfg.global_batch_size % per_step:
        if "global_batch_size" not in given:
            gbs = max(1, round(cfg.global_batch_size / per_step)) * per_step
            notes.append(f"--global-batch-size not given: using {gbs} (a multiple of "
                         f"micro-batch size {cfg.micro_batch_size} x dp {dp}) instead of the "
                         f"default {cfg.global_batch_size}")
            cfg.global_batch_size = gbs
        elif "micro_batch_size" not in given and cfg.global_batch_size % dp == 0:
            per_rank = cfg.global_batch_size // dp
            mbs = max(d for d in range(1, cfg.micro_batch_size + 1) if per_rank % d == 0)
            notes.append(f"--micro-batch-size not given: using {mbs} (divides --global-batch-"
                         f"size {cfg.global_batch_size} / dp {dp}) instead of the default "
                         f"{cfg.micro_batch_size}")
            cfg.micro_batch_size = mbs
    notes.extend(_inert_zero_settings(cfg, dp))
    return notes


def _inert_zero_settings(cfg, dp: int) -> list[str]:
    """Notes for ZeRO settings that change nothing in this run (accepted, said once)."""
    notes = []
    if cfg.zero and dp * cfg.cp == 1:
        notes.append(f"--zero {cfg.zero} with dp x cp = 1: there is no rank to shard over, so "
                     f"every rank keeps whole state (offloads still apply)")
    m = cfg.global_batch_size // max(1, cfg.micro_batch_size * dp)
    if cfg.zero == 3 and cfg.zero3_reduce == "micro-batch":
        if m == 1:
            notes.append("--zero3-reduce micro-batch with one micro-batch per step: the same "
                         "as step")
        elif _has_w_passes(cfg, m):
            notes.append(f"--zero3-reduce micro-batch under --schedule {cfg.schedule}: its W "
                         f"passes report the weight gradients once a step, so the units reduce "
                         f"once a step, as with step")
    return notes


def _has_w_passes(cfg, m: int) -> bool:
    try:
        actions = schedule_actions(cfg.schedule, cfg.pp, m, 0,
                                   chunks_per_rank(cfg.schedule, cfg.virtual_stages))
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
    sizes = [cfg.micro_batch_size] if "micro_batch_size" in given else \
        range(cfg.micro_batch_size, 0, -1)
    best = max(((samples // (m * dp) * m * dp, m) for m in sizes
                if samples >= m * dp and fits(samples // (m * dp) * m * dp, m)), default=None)
    if best is None:
        return None
    (gbs, mbs), was = best, (cfg.global_batch_size, cfg.micro_batch_size)
    cfg.global_batch_size, cfg.micro_batch_size = gbs, mbs
    also = f" and micro-batch size {mbs}" if mbs != was[1] else ""
    return (f"--global-batch-size not given: using {gbs}{also} (the training split holds "
            f"{samples} samples of {cfg.seq_len} tokens) instead of {was[0]}")


_STEP_DIR = re.compile(r"step_\d+")


def check_load_path(cfg) -> None:
    """A --load that cannot be what the user meant: a file, or a step directory that is not
    there. Only a missing directory, or one without a checkpoint, starts fresh (a requeue)."""

    path = os.path.expanduser(cfg.load)
    if os.path.isfile(path):
        parent = os.path.dirname(cfg.load.rstrip("/")) or "."
        raise UsageError(f"--load {cfg.load} is a file; give the checkpoint directory (e.g. its "
                         f"parent {parent})")
    if os.path.exists(path):
        if os.path.isfile(os.path.join(path, "config.json")) and not has_checkpoint(path):
            raise UsageError(f"--load {cfg.load} holds a Hugging Face model (config.json), not a "
                             f"megapar checkpoint; start from it with --from-hf {cfg.load}")
        return
    root = os.path.dirname(os.path.abspath(path))
    blocker = root
    while blocker and not os.path.exists(blocker):
        blocker = os.path.dirname(blocker)
    if blocker and not os.path.isdir(blocker):   # a missing dir under a file: never a checkpoint
        raise UsageError(f"--load {cfg.load}: {blocker} is a file, so no checkpoint can be "
                         f"there; give the directory --save writes to")
    try:
        names = os.listdir(root)
    except OSError:  # no such parent (or unreadable): nothing to name
        names = []
    steps = sorted(n for n in names
                   if _STEP_DIR.fullmatch(n) and os.path.exists(os.path.join(root, n, MANIFEST)))
    if not steps and _STEP_DIR.fullmatch(os.path.basename(os.path.abspath(path))):
        raise UsageError(f"--load {cfg.load}: no such checkpoint step, and {root} holds no "
                         f"step_* checkpoints; pass a directory written by --save (or one of "
                         f"its step_* directories)")
    if steps:
        shown = ", ".join(steps) if len(steps) <= 6 else \
            f"{len(steps)} steps, {steps[0]} ... {', '.join(steps[-3:])}"
        raise UsageError(f"--load {cfg.load}: no such checkpoint; {root} holds {shown}; "
                         f"pass one of them, or {root} for the latest")


def check_newer_steps(cfg, manifest: dict | None) -> None:
    """--save holding complete steps newer than the step this run starts from (--load's, or 0
    for a fresh start): its saves would replace them, and `latest` would go back, leaving two
    runs' steps mixed. Refused unless --overwrite-newer. A requeue (--load naming the --save
    root itself) resumes that root's `latest`, and redoes any step past it the same way."""
    if not cfg.save or cfg.overwrite_newer:
        return
    save = os.path.realpath(os.path.expanduser(cfg.save))
    if manifest is not None and os.path.realpath(os.path.expanduser(cfg.load)) == save:
        return
    start = int(manifest.get("step", 0)) if manifest is not None else 0
    newer = steps_after(save, start)
    if not newer:
        return
    shown = ", ".join(newer) if len(newer) <= 4 else f"{newer[0]} ... {newer[-1]} ({len(newer)})"
    where = (f"newer than step {start}, where --load {cfg.load} resumes" if manifest is not None
             else "of an earlier run, and this run starts from scratch")
    resume = "" if manifest is not None else f"resume it with --load {cfg.save}, "
    raise UsageError(f"--save {cfg.save} holds {shown}, {where}: this run's saves would replace "
                     f"or mix with them; {resume}give another --save, or pass --overwrite-newer "
                     f"to replace them")


def checkpoint_manifest(path: str) -> dict:
    """The manifest of a --load checkpoint after checking every file it lists (size, sha256)."""

    if not os.path.exists(os.path.expanduser(path)):
        raise UsageError(f"--load {path}: no such checkpoint directory; pass a directory written by --save "
                         f"(or one of its step_* directories)")
    try:
        return verify(os.path.expanduser(path))
    except (CheckpointError, KeyError, OSError) as exc:
        raise UsageError(f"--load {path}: {exc}") from None


NOT_INHERITED = {
    # the layout and how it runs (any layout resumes any checkpoint, with the same numbers)
    "tp", "cp", "pp", "dp", "oversubscribe", "rank_order", "schedule", "virtual_stages",
    "sequence_parallel", "recompute", "zero", "offload_optimizer", "offload_params",
    "zero3_keep_params", "zero3_persistence_threshold", "zero3_reduce",
    "grad_bucket_mb", "p2p_dtype", "grad_reduce_dtype",
    # where things go and how the run is watched or stopped
    "model", "from_hf", "load", "load_strict", "allow_data_change", "save", "async_save",
    "overwrite_newer", "data_cache",
    "log_json", "tensorboard",
    "wandb_project", "progress", "debug", "timeout_s", "nccl_timeout_s", "peak_tflops",
    "profile_steps",
    "profile_dir", "exit_signals", "exit_duration_mins", "exit_interval", "straggler_factor",
    "inject_slow", "inject_corrupt", "record_step", "replay", "replay_against",
    # a rehearsal
    "dry_run", "world_size", "gpus_per_node", "dry_run_ranks", "json"}
"""Settings a --load run never takes from the checkpoint's saved train_config."""


def settings_from_checkpoint(cfg, manifest: dict) -> list[str]:
    """With --load, settings the user did not give are the checkpoint's (data, batch, seq-len,
    schedule of the learning rate, --max-steps, ...), so `--load CKPT` alone resumes the run it
    came from; layout and output flags are never taken. Returns a note listing what was taken."""
    saved = (manifest.get("meta") or {}).get("train_config") or {}
    given, taken, inherited = explicit(cfg), [], set()
    for f in dataclasses.fields(cfg):
        name = f.name
        if name in NOT_INHERITED or name in given or name not in saved:
            continue
        inherited.add(name)
        value = saved[name]
        if name == "data" and value is not None and not _data_exists(value):
            shown = value if isinstance(value, str) else " ".join(map(str, value))
            raise UsageError(f"--load {cfg.load} was trained on --data {shown}, which is not "
                             f"found from here; pass --data with where that data is now")
        if value != getattr(cfg, name):
            setattr(cfg, name, value)
            taken.append(f"{flag_of(name)} {value}")
        given.add(name)
    cfg.explicit = frozenset(given)
    cfg.from_checkpoint = frozenset(inherited)  # named as such in error messages (`named`)
    return [f"from the checkpoint (not given): {', '.join(taken)}"] if taken else []


def named(cfg, name: str, value=None) -> str:
    """A setting as an error message names it: ``--data X``, and for a value the --load
    checkpoint recorded (the user gave none) ``--data X (not given: the value --load CK
    recorded)``, so the message does not blame a flag the user never typed."""
    value = getattr(cfg, name) if value is None else value
    shown = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else value
    if name in getattr(cfg, "from_checkpoint", ()):
        return f"{flag_of(name)} {shown} (not given: the value --load {cfg.load} recorded)"
    return f"{flag_of(name)} {shown}"

def _data_exists(data) -> bool:
    """Whether every path of a saved --data (one path, or a blend's WEIGHT PATH list) exists."""

    try:
        paths = data_paths(data)
    except ValueError:
        return False
    return all(p is not None and (os.path.exists(os.path.expanduser(str(p))) or
                                  os.path.exists(os.path.expanduser(str(p)) + ".idx"))
               for p in paths)


def check_resumable(cfg, manifest: dict, train_len: int) -> None:
    """The checkpoint's data order can continue: same number of training samples (unless
    --allow-data-change: the order then starts anew), global batch and seed as when it was
    saved."""
    state = (manifest.get("meta") or {}).get("sampler") or {}
    ours = {"dataset_len": train_len, "global_batch_size": cfg.global_batch_size,
            "seed": cfg.seed}
    diff = [k for k in ours if k in state and state[k] != ours[k]
            and not (k == "dataset_len" and cfg.allow_data_change)]
    if diff:
        shown = ", ".join(f"{k} {state[k]} (checkpoint) vs {ours[k]}" for k in diff)
        other = (", or pass --allow-data-change to continue on this data on purpose (its data "
                 "order starts anew)" if "dataset_len" in diff else "")
        raise UsageError(f"--load {cfg.load} cannot continue its data order: {shown}; resume "
                         f"with the --data, --seq-len, --val-fraction, --global-batch-size and "
                         f"--seed it was saved with (left out, they are the checkpoint's)"
                         f"{other}")


def check_same_data(cfg, manifest: dict, fingerprints: list[str] | None) -> None:
    """The checkpoint trained on the content --data holds now: each part's fingerprint (see
    `IndexedDataset.fingerprint`) is the one the checkpoint recorded, unless
    --allow-data-change. A checkpoint that recorded none (older, or from the Python API) is not
    checked."""
    saved = (manifest.get("meta") or {}).get("data_fingerprint")
    if not saved or fingerprints is None or saved == fingerprints or cfg.allow_data_change:
        return
    paths = [p if p is not None else "(the shipped sample)" for p in data_paths(cfg.data)]
    changed = [str(p) for p, a, b in zip(paths, saved, fingerprints) if a != b] or \
        [str(p) for p in paths]
    shown = " ".join(str(p) for p in paths)
    raise UsageError(f"--load {cfg.load} trained on other tokens than --data {shown} holds now: "
                     f"the content of {', '.join(changed)} changed since the checkpoint was "
                     f"saved (its fingerprint differs); resume with the data it trained on, or "
                     f"pass --allow-data-change to continue on this data on purpose")


def model_from_checkpoint(cfg, manifest: dict, given_config=None, given_from: str = ""):
    """The model config of a --load run: the checkpoint's. A --model / --from-hf given too
    must describe the same model (vocabulary aside for a recipe, which takes the tokenizer's)."""

    config = config_from_dict(manifest["model"])
    if given_config is not None:
        ours, theirs = given_config.to_dict(), config.to_dict()
        named = f"--model {cfg.model}" if given_from == "recipe" else given_from or "given"
        if ours.get("model_type") != theirs.get("model_type"):
            raise UsageError(f"--load {cfg.load} holds a {theirs.get('model_type')} model and "
                             f"{named} is a {ours.get('model_type')}; with --load the model "
                             f"comes from the checkpoint, drop {named.split()[0]}")
        skip = set(NON_STRUCTURAL) | ({"vocab_size"} if given_from == "recipe" else set())
        diff = sorted(k for k in set(ours) | set(theirs)
                      if k not in skip and ours.get(k) != theirs.get(k))
        if diff:
            shown = ", ".join(f"{k}={theirs.get(k)!r} (checkpoint) vs {ours.get(k)!r}" for k in diff)
            raise UsageError(f"--load {cfg.load} holds another model than {named}: "
                             f"{shown}; with --load the model comes from the checkpoint, drop "
                             f"--model / --from-hf")
    if cfg.max_steps <= int(manifest.get("step", 0)):
        raise UsageError(f"--load {cfg.load} is at step {manifest.get('step')} and --max-steps "
                         f"is {cfg.max_steps}: nothing left to train; raise --max-steps")
    return config


# --- output locations -------------------------------------------------------------------------
def check_writable(path: str, flag: str, kind: str = "dir") -> None:
    """Raise ValueError unless `path` (a directory, or a file's directory) can be written now.

    Creates the directory (as the run would) and writes and removes a probe file there, so a
    read-only mount, an immutable directory or a path under /proc is found before any work."""

    target = os.path.expanduser(path)
    directory = target if kind == "dir" else (os.path.dirname(os.path.abspath(target)) or ".")
    if kind == "dir" and os.path.exists(target) and not os.path.isdir(target):
        raise ValueError(f"{flag} {path} is a file, not a directory; choose a directory (or "
                         f"remove the file)")
    if kind == "file" and os.path.isdir(target):
        raise ValueError(f"{flag} {path} is a directory; give a file name")
    try:
        probe_writable(directory)
        if kind == "file" and os.path.exists(target):
            with open(target, "a"):
                pass
    except OSError as exc:
        reason = errno.errorcode.get(exc.errno, "") if exc.errno else ""
        raise ValueError(f"{flag} {path} is not writable ({exc.strerror or exc}"
                         f"{' ' + reason if reason else ''}); choose a location you can write "
                         f"to") from None


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
        raise UsageError("--wandb-project needs wandb, which is not installed: pip install "
                         "'megapar[wandb]' (or wandb), or log with --tensorboard / --log-json")

    if any(p is None or is_raw_text(os.path.expanduser(p)) for p in data_paths(cfg.data)):
        check_writable(cfg.data_cache, "--data-cache")  # raw text is tokenized into it
