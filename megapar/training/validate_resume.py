"""The checks of a run that resumes a checkpoint (`--load`), made before a worker starts: the
path, the checkpoint's integrity, the settings it records, whether the run can continue its data
order on its data, and which steps a run would replace in `--save` (or which other format's
files it would be mixed with). Who hashes the checkpoint's files: the process that starts the
workers, every file, or under torchrun / Slurm (every process its own start-up, which checks
the sizes) each rank the files it reads, the ranks agreeing after the load whether all loaded
(`load_everywhere`)."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist

from megapar.checkpoint.convert import model_tensors
from megapar.checkpoint.distributed import NON_STRUCTURAL, differing_fields
from megapar.checkpoint.format import LATEST, MANIFEST, CheckpointError, step_dir_name
from megapar.checkpoint.manifest import read_manifest, verify
from megapar.checkpoint.publish import (
    deepspeed_checkpoint,
    foreign_checkpoint,
    has_checkpoint,
    newest_step,
    resolve_checkpoint,
    steps_after,
)
from megapar.data.blended import data_paths, parse_blend
from megapar.data.inputs import is_raw_text, parse_sft_keys
from megapar.faults import progress
from megapar.faults.status import set_action
from megapar.launcher import under_launcher
from megapar.models.config import CAUSAL_LM_TYPES, config_from_dict
from megapar.one_line_parser import shell_word
from megapar.optim.optimizer import state_keys
from megapar.training.tokenizer_checks import recorded_as_trained
from megapar.training.usage import flag_with_value
from megapar.training.validate import UsageError, broken_link, explicit, flag_of, named
from megapar.wording import and_list, scale_text

_STEP_DIR = re.compile(r"step_\d+")
T = TypeVar("T")


def check_load_path(cfg) -> None:
    """A --load that cannot be what the user meant: a file, or a step directory that is not
    there. Only a missing directory, or one without a checkpoint, starts fresh (a requeue)."""

    path = os.path.expanduser(cfg.load)
    deepspeed = deepspeed_checkpoint(path)
    if deepspeed is not None:
        raise UsageError(f"--load {cfg.load} {deepspeed}")
    if os.path.isfile(path):
        parent = os.path.dirname(cfg.load.rstrip("/")) or "."
        held = os.path.expanduser(parent)  # its parent named only where it holds one (a file
        if os.path.isfile(os.path.join(held, MANIFEST)) or has_checkpoint(held):  # beside
            raise UsageError(  # none was told "its parent .", refused next; a re-test)
                f"--load {cfg.load} is a file; give the checkpoint directory (e.g. its parent "
                f"{parent})"
            )
        raise UsageError(
            f"--load {cfg.load} is a file; give a checkpoint directory written by --save (or "
            f"one of its step_* directories)"
        )
    if os.path.exists(path):
        if os.path.isfile(os.path.join(path, "config.json")) and not has_checkpoint(path):
            raise UsageError(
                f"--load {cfg.load} holds a Hugging Face model (config.json), not a "
                f"megapar checkpoint; start from it with --from-hf {shell_word(cfg.load)}"
            )
        foreign = foreign_checkpoint(path)
        if foreign is not None:  # another format: never a fresh start beside it
            raise UsageError(f"--load {cfg.load} {foreign}")
        return
    root = os.path.dirname(os.path.abspath(path))
    blocker = root
    while blocker and not os.path.exists(blocker):
        blocker = os.path.dirname(blocker)
    if blocker and not os.path.isdir(blocker):  # a missing dir under a file: never a checkpoint
        raise UsageError(
            f"--load {cfg.load}: {blocker} is a file, so no checkpoint can be "
            f"there; give the directory --save writes to"
        )
    try:
        names = os.listdir(root)
    except OSError:  # no such parent (or unreadable): nothing to name
        names = []
    steps = sorted(
        n
        for n in names
        if _STEP_DIR.fullmatch(n) and os.path.exists(os.path.join(root, n, MANIFEST))
    )
    if not steps and _STEP_DIR.fullmatch(os.path.basename(os.path.abspath(path))):
        raise UsageError(
            f"--load {cfg.load}: no such checkpoint step, and {root} holds no "
            f"step_* checkpoints; pass a directory written by --save (or one of "
            f"its step_* directories)"
        )
    if steps:
        shown = (
            and_list(steps)
            if len(steps) <= 6
            else f"{len(steps)} steps, {steps[0]} ... {and_list(steps[-3:])}"
        )
        which = (
            f"pass {root}/{steps[0]}, or {root} (the latest)"
            if len(steps) == 1
            else f"pass one of them, or {root} for the latest"
        )
        raise UsageError(f"--load {cfg.load}: no such checkpoint; {root} holds {shown}; {which}")


def check_save_format(cfg) -> None:
    """--save naming a directory that holds another format's model or checkpoint (a Hugging Face
    model, a DCP checkpoint; `foreign_checkpoint`): the checkpoint's files would be mixed into
    it, as megapar-convert --to-hf refuses into a checkpoint's directory."""
    if not cfg.save:
        return
    _check_save_outside_checkpoint(cfg)
    _check_save_is_not_data(cfg)
    foreign = foreign_checkpoint(os.path.expanduser(cfg.save))
    if foreign is None:
        return
    what = foreign.split(", not a megapar checkpoint")[0]
    raise UsageError(
        f"--save {cfg.save} {what}: this run's checkpoints would be mixed into it; give "
        f"another --save (a new directory, or one that holds megapar checkpoints)"
    )


def _check_save_is_not_data(cfg) -> None:
    """--save naming a --data directory: its `latest` and step directories would make it a
    checkpoint, which a later --data of it refuses ("a megapar checkpoint, not data"). A
    directory inside it is fine: the text walk leaves a checkpoint out."""
    save = os.path.realpath(os.path.expanduser(cfg.save))
    for path in data_paths(cfg.data):
        if path and os.path.isdir(path) and os.path.realpath(path) == save:
            raise UsageError(
                f"--save {cfg.save} is the --data directory {path}: its checkpoints would "
                f"make it a checkpoint, not data, for every later run; give --save another "
                f"directory (a new one beside it, or one inside it: the text is read without it)"
            )


def _check_save_outside_checkpoint(cfg) -> None:
    """--save naming a step directory (it holds manifest.json), or a directory inside a
    checkpoint root or step directory: the run's root (`latest`, step_N) would be written among
    that checkpoint's files, as megapar-convert refuses for its DST and --to-hf."""
    save = Path(os.path.expanduser(cfg.save))
    if (broken := broken_link(str(save))) is not None:  # (a loop was a traceback of resolve's
        raise UsageError(
            f"--save {cfg.save}: {broken}; give another directory, or remove the link"
        )  # under --dry-run; a re-test)
    if (save / MANIFEST).is_file():
        raise UsageError(
            f"--save {cfg.save} is a checkpoint's step directory (it holds {MANIFEST}): this "
            f"run's checkpoints would be written among its files; give the root that holds it "
            f"({shell_word(save.parent)}) to add steps to that run, or another directory"
        )
    outer = next(
        (
            a
            for a in save.resolve().parents
            if (a / MANIFEST).is_file() or ((a / LATEST).is_file() and newest_step(a))
        ),
        None,
    )
    if outer is not None:
        raise UsageError(
            f"--save {cfg.save} is inside the megapar checkpoint {outer}: this run's "
            f"checkpoints would be mixed up with its step directories; give a directory "
            f"outside it"
        )


def check_newer_steps(cfg, manifest: dict | None, config=None) -> None:
    """--save holding complete steps newer than the step this run starts from (--load's, or 0
    for a fresh start): its saves would replace them, and `latest` would go back, leaving two
    runs' steps mixed. Refused unless --overwrite-newer; a fresh run's refusal says where those
    steps are of another model than its own (`config`), which --load would not resume. A
    requeue (--load naming the --save root itself) resumes that root's `latest`, and redoes any
    step past it the same way."""
    if not cfg.save or cfg.overwrite_newer:
        return
    save = os.path.realpath(os.path.expanduser(cfg.save))
    if manifest is not None and os.path.realpath(os.path.expanduser(cfg.load)) == save:
        return
    start = int(manifest.get("step", 0)) if manifest is not None else 0
    newer = steps_after(save, start)
    if not newer:
        if manifest is not None:
            _check_same_model(cfg, manifest, steps_after(save, -1))
        return
    shown = ", ".join(newer) if len(newer) <= 4 else f"{newer[0]} ... {newer[-1]} ({len(newer)})"
    where = (
        f"newer than step {start}, where --load {cfg.load} resumes"
        if manifest is not None
        else "of an earlier run, and this run starts "
        + (
            f"from --from-hf {cfg.from_hf}'s weights"
            if getattr(cfg, "from_hf", None)
            else "from scratch"
        )
    )
    resume = "" if manifest is not None else f"resume it with --load {shell_word(cfg.save)}, "
    other = None
    if manifest is None and config is not None:
        # a rehearsal skips the data: its model keeps its own vocabulary, not the tokenizer's
        unknown = ("vocab_size",) if cfg.dry_run else ()
        other = _other_model(cfg.save, newer[-1], config.to_dict(), "this run", unknown)
    if other is not None:
        raise UsageError(
            f"--save {cfg.save} holds {shown}, of an earlier run of {other}: this run's saves "
            f"would replace or mix with them; give another --save, or pass --overwrite-newer "
            f"to replace them"
        )
    raise UsageError(
        f"--save {cfg.save} holds {shown}, {where}: this run's saves would replace "
        f"or mix with them; {resume}give another --save, or pass --overwrite-newer "
        f"to replace them"
    )


def _check_same_model(cfg, manifest: dict, saved: list[str]) -> None:
    """--save holding complete steps (`saved`, none newer than the run's start) of another model
    than the --load checkpoint's: the run's saves would be mixed with them, `latest` naming
    one model and the older steps another. Refused; --overwrite-newer removes only newer steps,
    so another --save is the fix."""
    if not saved:
        return
    shown = _other_model(cfg.save, saved[-1], dict(manifest["model"]), "--load")
    if shown is None:
        return
    steps = ", ".join(saved) if len(saved) <= 4 else f"{saved[0]} ... {saved[-1]} ({len(saved)})"
    raise UsageError(
        f"--save {cfg.save} holds {steps} of {shown}: this run's saves would be mixed with "
        f"them; give another --save"
    )


def _other_model(
    save: str, step: str, ours: dict, label: str, unknown: tuple[str, ...] = ()
) -> str | None:
    """How the model of --save's `step` differs from `ours` (a model config's dict, named by
    `label`: "--load", "this run"; its fields `unknown` not compared): "a llama model, and this
    run trains a gpt2", "another model: n_embd=768 (--save) vs 64 (--load)"; None where it is
    the same, or the step cannot be read (loading it names what is wrong with it)."""
    try:
        theirs = dict(read_manifest(os.path.join(os.path.expanduser(save), step))["model"])
    except (CheckpointError, KeyError, OSError, ValueError):
        return None
    if theirs.get("model_type") != ours.get("model_type"):
        return f"a {theirs.get('model_type')} model, and this run trains a {ours.get('model_type')}"
    theirs = {**config_from_dict(theirs).to_dict(), **theirs}
    ours = {**config_from_dict(ours).to_dict(), **ours}
    keys = [k for k in differing_fields(ours, theirs) if k not in unknown]
    if not keys:
        return None
    return "another model: " + ", ".join(
        f"{k}={theirs.get(k)!r} (--save) vs {ours.get(k)!r} ({label})" for k in keys[:3]
    )


def check_optimizer_state(cfg, manifest: dict) -> None:
    """The --optimizer keeps the state the checkpoint holds (AdamW and LAMB: exp_avg and
    exp_avg_sq; SGD and LARS: momentum_buffer; Muon: both, the one for its matrices, the other
    for AdamW's parameters), else UsageError naming the one it trained with; a checkpoint
    without optimizer state (imported from Hugging Face) takes any."""
    kept = [k for e in manifest["tensors"].values() for k in e.get("optim") or ()]
    held = tuple(dict.fromkeys(kept))
    if not held or set(held) == set(state_keys(cfg.optimizer)):
        return
    meta = manifest.get("meta") or {}
    trained = (meta.get("optimizer") or {}).get("kind") or (meta.get("train_config") or {}).get(
        "optimizer"
    )
    back = f"--optimizer {trained} (or leave it out: the checkpoint's is taken)" if trained else ""
    raise UsageError(
        f"--optimizer {cfg.optimizer} keeps {', '.join(state_keys(cfg.optimizer))}, but --load "
        f"{cfg.load} holds {', '.join(held)}"
        + (f" (it trained with --optimizer {trained}): resume with {back}" if trained else "")
    )


def hashes_at_start() -> bool:
    """Whether this process's start-up hashes (sha256) every file of a --load checkpoint: where
    it starts the workers itself (forked local ranks, which then check only the sizes of the
    files they read: `worker_verify`); not under torchrun / Slurm, where every process runs its
    own start-up (there it checks the manifest and every file's size, and each rank hashes the
    files it reads, so the checkpoint is hashed about once per replica set, not per process)."""
    return not under_launcher()


def worker_verify() -> str:
    """How the ranks check the files of --load they read (`load_checkpoint`'s `verify`):
    "size" where the start-up hashed every file (`hashes_at_start`), else "sha256"."""
    return "size" if hashes_at_start() else "sha256"


def checked_step(path: str, manifest: dict) -> str | None:
    """The step directory of --load `path` that `checkpoint_manifest` checked (its `manifest`
    records that step), for the ranks to load that directory and no other (a `latest` moved
    since); None where it is not that step."""
    step_dir = resolve_checkpoint(os.path.expanduser(path))
    return str(step_dir) if step_dir.name == step_dir_name(int(manifest.get("step", 0))) else None


def load_refusal(load: str, exc: Exception, what: str = "--load") -> CheckpointError:
    """The error of a rank whose own check of the files of --load `load` it reads (sha256 under
    torchrun / Slurm) failed with `exc`: one line (the rank's failure line names the rank)
    naming the step directory, the file and the fix (`_other_steps`: the newest other step of
    its root to resume from); `what` names where `load` was given."""
    prefix = f"{what} " if what else ""  # "": megapar-convert's positional SRC
    other = _other_steps(load).replace("--load ", prefix)
    text = str(exc)
    damaged = getattr(exc, "path", None)  # a file of a step under the root `load` names
    if damaged is not None and text.startswith(f"{damaged.name}: "):
        if not _same_path(str(damaged.parent), load):
            where = os.path.relpath(damaged, os.path.expanduser(load))
            text = where + text[len(damaged.name) :]
    said = f": {text}"
    # "X: no such checkpoint directory", "X holds a different model": X said once (X may hold
    # ": " or spaces itself)
    for cut in (i for i, c in enumerate(text) if c == " " or text.startswith(": ", i)):
        if _same_path(text[:cut], load):
            said = text[cut:]
            break
    err = CheckpointError(f"{prefix}{load}{said}{other}")
    err.no_traceback = True  # type: ignore[attr-defined]  # the line says it all
    return err


def _same_path(a: str, b: str) -> bool:
    """Whether two spellings of a path (`./x`, `x/`, `~/x`) name the same place."""
    return os.path.abspath(os.path.expanduser(a)) == os.path.abspath(os.path.expanduser(b))


def load_everywhere(load: str, fn: Callable[[], T], device, what: str = "--load") -> T:
    """`fn()`, this rank's load of checkpoint `load` (given to `what`); a file that fails its
    check raises `load_refusal`'s line. Under torchrun / Slurm, where no launcher of megapar's
    brings the other ranks down, every rank then agrees whether all loaded (one MAX all-reduce
    of a flag on `device`, the default group's timeout bounding it): the failed rank's line is
    recorded in the job's store and the others raise one line naming it
    (`progress.holding_up`), rather than each failing later in a collective the failed rank
    never joins."""
    failed: CheckpointError | None = None
    out = None
    try:
        out = fn()
    except CheckpointError as exc:
        failed = load_refusal(load, exc, what)
        set_action(f"checking {what}'s files")  # what the others then name it failing at
        progress.mark_failed(str(failed))
    if under_launcher() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([float(failed is not None)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if failed is None and flag.item() > 0:
            cause = progress.holding_up() or "another rank failed to load it"
            failed = CheckpointError(f"{what} {load}: {cause}")
            failed.no_traceback = True  # type: ignore[attr-defined]
    if failed is not None:
        raise failed
    return out  # type: ignore[return-value]  # fn returned


def checkpoint_manifest(path: str, checksums: bool | None = None) -> dict:
    """The manifest of a --load checkpoint after checking every file it lists: its size, and
    its sha256 where `checksums` (None: `hashes_at_start()`; else the ranks hash what they
    read)."""

    if checksums is None:
        checksums = hashes_at_start()
    if not path.strip():  # megapar-eval's, megapar-generate's (an unset $CKPT)
        raise UsageError(
            f"--load {path!r} is an empty path: give a directory written by --save (or one of "
            f"its step_* directories)"
        )
    if not os.path.exists(os.path.expanduser(path)):
        raise UsageError(
            f"--load {path}: no such checkpoint directory; pass a directory written by --save "
            f"(or one of its step_* directories)"
        )
    try:
        manifest = verify(os.path.expanduser(path), checksums)
        # its tensors those of its own model, as megapar-convert --info checks (a manifest
        # without its digest, n_layer 4 made 2, trained a smaller model unsaid; a re-test)
        model_tensors(resolve_checkpoint(os.path.expanduser(path)), manifest)
        return manifest
    except (CheckpointError, KeyError, OSError) as exc:
        raise UsageError(str(load_refusal(path, exc))) from None  # the path said once


def _other_steps(path: str) -> str:
    """For a --load that failed its checks: the newest other step of its root to resume from
    instead (`; ... --load ROOT/step_N`), one whose files are all there at their recorded sizes
    (a size check: the checksums are the resume's own), or "" when there is none."""
    p = Path(os.path.expanduser(path))
    if (p / MANIFEST).is_file():
        root, failed = p.parent, p.name
    elif (p / LATEST).is_file():
        root, failed = p, (p / LATEST).read_text().strip()
    else:
        return ""
    shown = path.rstrip("/") if root == p else os.path.dirname(path.rstrip("/")) or "."
    for other in reversed([s for s in steps_after(root, -1) if s != failed]):
        try:
            verify(root / other, checksums=False)
        except (CheckpointError, KeyError, OSError):
            continue
        return f" (the newest other step there: --load {os.path.join(shown, other)})"
    return ""


NOT_INHERITED = {
    # the layout and how it runs (any layout resumes any checkpoint, with the same numbers)
    "tp",
    "cp",
    "cp_comm_type",
    "pp",
    "dp",
    "ep",
    "expert_tensor_parallel_size",
    "oversubscribe",
    "rank_order",
    "schedule",
    "virtual_stages",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
    "sequence_parallel",
    "sp_regather",
    "recompute",
    "compile",  # the same numbers eager (dropout aside): how this run executes its blocks
    "zero",
    "offload_optimizer",
    "offload_params",
    "zero3_keep_params",
    "zero3_persistence_threshold",
    "zero3_reduce",
    "grad_bucket_mb",
    "p2p_dtype",
    "grad_reduce_dtype",
    "muon_distributed",  # bit for bit the every-rank scheme; --zero 0 refuses it
    # how this machine runs --fp8's products (emulated on a CPU, real kernels on FP8 GPUs): a
    # run tried on a laptop under --fp8-emulate and resumed on the cluster runs the kernels
    "fp8_emulate",
    # where things go and how the run is watched or stopped
    "model",
    "from_hf",
    "load",
    "load_strict",
    "allow_data_change",
    "save",
    "async_save",
    "overwrite_newer",
    "data_cache",
    "log_json",
    "tensorboard",
    "wandb_project",
    "progress",
    "debug",
    "timeout_s",
    "nccl_timeout_s",
    "peak_tflops",
    "profile_steps",
    "profile_dir",
    "exit_signals",
    "exit_duration_mins",
    "exit_interval",
    "straggler_factor",
    "inject_slow",
    "inject_corrupt",
    "record_step",
    "replay",
    "replay_against",
    # a rehearsal
    "dry_run",
    "world_size",
    "gpus_per_node",
    "gpu_memory_gb",
    "dry_run_ranks",
    "json",
}
"""Settings a --load run never takes from the checkpoint's saved train_config."""


FP16_SCALER = frozenset(
    {"loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis"}
)
"""The fp16 loss scale's settings: a resume in another precision takes none of them."""


def settings_from_checkpoint(cfg, manifest: dict) -> list[str]:
    """With --load, settings the user did not give are the checkpoint's (data, batch, seq-len,
    schedule of the learning rate, --max-steps, ...), so `--load CKPT` alone resumes the run it
    came from; layout and output flags are never taken. Returns a note listing what was taken,
    and notes where the run differs from the checkpoint unseen: another --loss-mean or --fp8
    given, megapar-train's defaults where a `megapar.prepare` engine's checkpoint records no
    --seq-len / --global-batch-size / --max-steps, the default tokenizer where it records
    none."""
    saved = _with_recorded_tokenizer(manifest)
    given, taken, inherited = explicit(cfg), [], set()
    explicit_before = set(given)
    for f in dataclasses.fields(cfg):
        name = f.name
        if name in NOT_INHERITED or name in given or name not in saved:
            continue
        if name == "lr_wsd_decay_steps" and "lr_wsd_decay_fraction" in given:
            continue  # the fraction given now sets the decay's length, not the saved steps
        if name == "fp8_layers" and (cfg.fp8 if "fp8" in given else saved.get("fp8")) == "off":
            continue  # no float8 linears this run: nor their choice (it would be saved on)
        precision = cfg.precision if "precision" in given else saved.get("precision")
        if name in FP16_SCALER and "fp16" != precision:
            continue  # no loss scale this run: nor its settings (given, they are refused)
        if name in FP16_SCALER and saved.get("precision") != "fp16":
            continue  # no loss scale saved: this fp16 run's starts afresh, at its own flags
        inherited.add(name)
        value = saved[name]
        if name == "data" and value is not None and not _data_exists(value):
            shown = value if isinstance(value, str) else " ".join(map(str, value))
            raise UsageError(
                f"--load {cfg.load} was trained on --data {shown}, which is not "
                f"found from here; pass --data with where that data is now"
            )
        if value != getattr(cfg, name):
            setattr(cfg, name, value)
            if not (name == "save_interval" and cfg.save is None):  # no save: no effect
                taken.append(flag_with_value(name, value))
        given.add(name)
    cfg.explicit = frozenset(given)
    cfg.from_checkpoint = frozenset(inherited)  # named as such in error messages (`named`)
    notes = [f"from the checkpoint (not given): {', '.join(taken)}"] if taken else []
    if "loss_mean" in explicit_before and saved.get("loss_mean") not in (None, cfg.loss_mean):
        now = (
            "the mean over the batch's labelled tokens"
            if cfg.loss_mean == "token"
            else "the mean of the micro-batches' means"
        )
        notes.append(  # allowed (a fine-tuning choice), but never silently
            f"--loss-mean {cfg.loss_mean} differs from the checkpoint's {saved['loss_mean']}: "
            f"from here the loss is {now}, so its scale and the gradients' weighting change"
        )
    micro = saved.get("micro_batch_size")
    if "micro_batch_size" in explicit_before and micro not in (None, cfg.micro_batch_size):
        model = manifest.get("model") or {}
        try:  # a mixture of experts balances its routing per micro-batch (moe.md)
            experts = getattr(config_from_dict(model), "num_local_experts", None) if model else None
        except ValueError:
            experts = None
        if experts:
            notes.append(  # allowed, but never silently
                f"--micro-batch-size {cfg.micro_batch_size} differs from the checkpoint's "
                f"{micro}: a mixture of experts computes its balancing loss and capacity per "
                f"micro-batch, so from here the objective differs, not only the rounding"
            )
    unrecorded = [n for n in ("seq_len", "global_batch_size", "max_steps") if n not in saved]
    if (manifest.get("meta") or {}).get("batches_from_caller") and unrecorded:
        defaults = [
            flag_with_value(n, getattr(cfg, n))
            + (" (or the model's positions, where fewer)" if n == "seq_len" else "")
            for n in unrecorded
            if n not in given
        ]
        if defaults:
            notes.append(
                f"--load {cfg.load} records no {', '.join(flag_of(n) for n in unrecorded)} "
                f"(saved by a megapar.prepare engine, whose batches were its caller's): "
                f"megapar-train's defaults {', '.join(defaults)}; give the run's own"
            )
    if "fp8" in explicit_before and saved.get("fp8", cfg.fp8) != cfg.fp8:
        before = saved["fp8"]
        notes.append(  # allowed (the weights are kept in the master dtype), but never silently
            f"--fp8 {cfg.fp8} differs from the checkpoint's --fp8 {before}: "
            + (
                "from here its linears run in high precision"
                if cfg.fp8 == "off"
                else f"from here its linears run in float8 ({cfg.fp8} scales)"
            )
            + ", so the loss may move by the recipes' rounding"
        )
    if "precision" in explicit_before and saved.get("precision", cfg.precision) != cfg.precision:
        before = saved["precision"]
        scale = (
            "; the checkpoint's loss scale is dropped (only fp16 scales the loss)"
            if before == "fp16"
            else f"; its loss scale starts at --initial-loss-scale "
            f"{scale_text(cfg.initial_loss_scale)}"
            if cfg.precision == "fp16"
            else ""
        )
        notes.append(  # allowed (the weights are kept in fp32), but never silently
            f"--precision {cfg.precision} differs from the checkpoint's --precision {before}: "
            f"from here the step runs in {cfg.precision}{scale}, so the loss may move by the "
            f"change of rounding"
        )
    precision_state = (manifest.get("meta") or {}).get("scaler") or {}  # `Precision`'s
    was = (precision_state.get("scaler") or {}).get("scale")
    raised = "min_loss_scale" in explicit_before and cfg.precision == "fp16" and not cfg.loss_scale
    raised = raised and "initial_loss_scale" not in explicit_before  # else it restarts there
    if raised and was is not None and cfg.min_loss_scale > was:
        notes.append(  # the scaler starts at its floor (`DynamicLossScaler.load_state_dict`)
            f"--min-loss-scale {scale_text(cfg.min_loss_scale)} is above the checkpoint's "
            f"loss scale {scale_text(was)}: the scale starts at {scale_text(cfg.min_loss_scale)}"
        )
    recorded = (manifest.get("meta") or {}).get("tokenizer")
    if "tokenizer" not in given and not (isinstance(recorded, dict) and recorded.get("sha256")):
        notes.append(  # as --from-hf's note where its directory holds none
            f"--load {cfg.load} records no tokenizer (imported without one, or older): raw "
            f"text is tokenized with the default --tokenizer {cfg.tokenizer} (a prepared --data "
            f"keeps its own); pass --tokenizer with the model's own if it is another"
        )
    return notes


def _with_recorded_tokenizer(manifest: dict) -> dict:
    """The checkpoint's saved train_config, its --tokenizer replaced by the tokenizer the data
    was tokenized with (meta ``tokenizer``, its recorded path) where they differ: a prepared
    --data kept its own whatever --tokenizer said, so raw text given now is tokenized as the
    model learned. That tokenizer is taken when it loads from its recorded path with the
    recorded files (sha256); when it does not, the saved --tokenizer is not taken either (the
    default tokenizes, and `check_checkpoint_tokenizer` names the recorded one)."""
    meta = manifest.get("meta") or {}
    saved = dict(meta.get("train_config") or {})
    recorded = meta.get("tokenizer")
    if not isinstance(recorded, dict) or not recorded.get("path") or not recorded.get("sha256"):
        return saved  # an older checkpoint, or one imported without a tokenizer
    path = str(recorded["path"])
    if recorded_as_trained(recorded) is None:  # moved or changed: so is the saved --tokenizer
        saved.pop("tokenizer", None)  # where it names the same place
        return saved
    if not ("tokenizer" in saved and _same_place(str(saved["tokenizer"]), path)):
        saved["tokenizer"] = path
    return saved


def _same_place(a: str, b: str) -> bool:
    """Whether two tokenizer specs name the same place (``gpt2``, or one path written two
    ways)."""
    if a == b:
        return True
    return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))


def replay_past(cfg, step: int) -> str:
    """The refusal of --replay N from a --load checkpoint at `step` >= N: it re-runs step N from
    a checkpoint saved before it, naming the newest such complete step directory beside
    --load's (`steps_after`)."""
    root = Path(os.path.expanduser(str(cfg.load)))
    if re.fullmatch(r"step_\d+", root.name):
        root = root.parent
    earlier = [name for name in steps_after(root, -1) if int(name[5:]) < cfg.replay]
    if earlier:
        where = f"--load {shell_word(str(root / earlier[-1]))}"
    elif cfg.replay == 1:  # no run saves before its first step
        where = "no run saves a checkpoint before step 1: record and replay a later step"
    else:
        where = f"--load a checkpoint saved at or before step {cfg.replay - 1} (none is beside it)"
    return (
        f"--replay {cfg.replay} re-runs step {cfg.replay} from a checkpoint saved before it, "
        f"and --load {cfg.load} is at step {step}; {where}"
    )


def _data_exists(data) -> bool:
    """Whether every path of a saved --data (one path, or a blend's WEIGHT PATH list) exists."""

    try:
        paths = data_paths(data)
    except ValueError:
        return False
    return all(
        p is not None
        and (
            os.path.exists(os.path.expanduser(str(p)))
            or os.path.exists(os.path.expanduser(str(p)) + ".idx")
        )
        for p in paths
    )


def _same_documents(a: list, b: list) -> bool:
    """Whether two `training_documents` lists name the same documents of every part."""
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and np.array_equal(x, y))
        for x, y in zip(a, b)
    )


def check_resumable_without_data(cfg, manifest: dict) -> list[str]:
    """A rehearsal's `check_resumable` where the data is not at hand: what the checkpoint alone
    decides is refused with the run's own line (another --seed, another --val-fraction), as is
    another --seq-len on text packed into --seq-len samples (raw text or the shipped sample,
    which always changes their number); with --sft-keys (records, one sample each at any
    --seq-len) nothing; on a prepared dataset, which may hold prompt / response records, a
    note saying the run decides.
    --allow-data-change's new order gets the note the run's would be. Returns the notes."""
    state = (manifest.get("meta") or {}).get("sampler") or {}
    if "dataset_len" in state:
        check_resumable(cfg, manifest, state["dataset_len"])
    train_config = (manifest.get("meta") or {}).get("train_config") or {}
    saved = train_config.get("seq_len")
    if saved is None or saved == cfg.seq_len or cfg.sft_keys or train_config.get("sft_keys"):
        return []  # prompt / response records: one sample each at any --seq-len
    packed = _packed_text(cfg, manifest)
    if cfg.allow_data_change:
        count = state.get("dataset_len")
        had = f" (the checkpoint's data had {count})" if count is not None else ""
        return [
            f"dry run: --allow-data-change: the run's data order starts anew on --data's "
            f"samples of --seq-len {cfg.seq_len}{had}"
            + (
                ""
                if packed
                else ", where their number differs (prompt / response records keep theirs: "
                "a rehearsal without the data cannot count them)"
            )
        ]
    if packed:
        raise UsageError(
            f"--seq-len {cfg.seq_len} differs from the checkpoint's {saved}: --load {cfg.load} "
            f"cannot continue its data order (text packed into --seq-len samples: another "
            f"number of them); resume with --seq-len {saved} (or leave it out: the "
            f"checkpoint's is taken), or pass --allow-data-change to continue on this data on "
            f"purpose (its data order starts anew)"
        )
    return [
        f"dry run: --seq-len {cfg.seq_len} differs from the checkpoint's {saved}, and the run "
        f"refuses it where that changes the number of samples (text packed into --seq-len "
        f"samples: always; prompt / response records: not), which a rehearsal without the "
        f"data cannot count; resume with --seq-len {saved} (or leave it out) to continue "
        f"--load {cfg.load}'s data order"
    ]


def _packed_text(cfg, manifest: dict) -> bool:
    """Whether the resumed run's data (read without --sft-keys) is text packed into --seq-len
    samples by its paths alone: raw text (or the shipped sample) read by a causal LM; a
    prepared dataset may hold prompt / response records, and says so only in its files; BERT's
    masked-LM samples are each document's chunks, as many at any --seq-len for documents
    shorter than both."""
    train_config = (manifest.get("meta") or {}).get("train_config") or {}
    if (manifest.get("model") or {}).get("model_type") not in CAUSAL_LM_TYPES:
        return False
    data = cfg.data if cfg.data is not None else train_config.get("data")
    return all(p is None or is_raw_text(os.path.expanduser(p)) for p in data_paths(data))


RESUME_ON_THE_SAMPLE = "resume without --data (the checkpoint's shipped sample is taken)"
"""How a checkpoint trained on the shipped sample resumes, where a --data given breaks it."""


def check_resumable(
    cfg, manifest: dict, train_len: int, split_of: Callable[[float, int], list] | None = None
) -> None:
    """The checkpoint's data order can continue: same number of training samples (unless
    --allow-data-change: the order then starts anew) and seed as when it was saved. Another
    global batch continues it (the next samples of the epoch, cut into the new size). Another
    --val-fraction, or another global batch (a small split grows to hold one), continues it only
    where `split_of(val_fraction, global_batch_size)` (the training documents of each part of
    --data) is the same for both."""
    state = (manifest.get("meta") or {}).get("sampler") or {}
    ours = {"dataset_len": train_len, "seed": cfg.seed}
    diff = [
        k
        for k in ours
        if k in state and state[k] != ours[k] and not (k == "dataset_len" and cfg.allow_data_change)
    ]
    train_config = (manifest.get("meta") or {}).get("train_config") or {}
    trained = train_config.get("data")
    blend = cfg.data is not None and parse_blend(cfg.data) is not None
    if (
        not cfg.allow_data_change
        and trained is not None
        and cfg.data is not None
        and (parse_blend(trained) is not None) != blend
    ):  # a blend of one part is the same tokens in the blend's order, not the dataset's
        raise UsageError(
            f"{named(cfg, 'data')} differs from the checkpoint's {_shown(trained)}: "
            f"{'a blend' if blend else 'one dataset'} draws its samples in "
            f"another order than {'one dataset' if blend else 'a blend'}, so "
            f"--load {cfg.load} cannot continue its data order; resume with --data "
            f"{_shown(trained)} (or leave it out: the checkpoint's is taken), or pass "
            f"--allow-data-change to continue on this order on purpose"
        )
    recorded = train_config.get("val_fraction")
    fraction = recorded if recorded is not None else cfg.val_fraction
    batch = state.get("global_batch_size", cfg.global_batch_size)  # absent: not moved
    moved = [
        *(["val_fraction"] if not _same_value("val_fraction", fraction, cfg.val_fraction) else []),
        *(["global_batch_size"] if batch != cfg.global_batch_size and split_of else []),
    ]  # a split grown to hold one global batch moves with the batch
    if (
        not diff
        and not cfg.allow_data_change
        and moved
        and not (
            split_of is not None
            and _same_documents(
                split_of(fraction, batch), split_of(cfg.val_fraction, cfg.global_batch_size)
            )
        )
    ):  # another split of as many samples: other documents (some trained on now held out)
        saved = {"val_fraction": fraction, "global_batch_size": batch}
        back = " ".join(f"{flag_of(k)} {_shown(saved[k])}" for k in moved)
        if moved == ["val_fraction"]:
            raise UsageError(
                f"{named(cfg, 'val_fraction')} differs from the checkpoint's "
                f"{_shown(fraction)}: it {'holds' if split_of else 'can hold'} out other "
                f"documents than --load {cfg.load} did (some it trained on), so its data order "
                f"{'cannot' if split_of else 'is not known to'} continue; resume with {back} "
                f"(or leave it out: the checkpoint's is taken), or pass --allow-data-change to "
                f"continue on this split on purpose"
            )
        given = and_list([f"{named(cfg, k)} (the checkpoint's {_shown(saved[k])})" for k in moved])
        raise UsageError(
            f"{given} {'hold' if len(moved) > 1 else 'holds'} out other documents for validation "
            f"than --load {cfg.load} did (some "
            f"it trained on: a split too small for one global batch grows until it holds one), "
            f"so its data order cannot continue; resume with {back} (or leave "
            f"{'them' if len(moved) > 1 else 'it'} out: the checkpoint's is taken), or pass "
            f"--allow-data-change to continue on this split on purpose"
        )
    if diff:
        shown = ", ".join(f"{k} {state[k]} (checkpoint) vs {ours[k]}" for k in diff)
        other = (
            ", or pass --allow-data-change to continue on this data on purpose (its data "
            "order starts anew)"
            if diff == ["dataset_len"]  # it does not continue another seed
            else ""
        )
        saved = {
            **train_config,
            **({"seed": state["seed"]} if "seed" in diff else {}),
        }
        sample = "data" in saved and saved["data"] is None  # it trained on the shipped sample
        changed = [
            k
            for k in ("data", "seq_len", "val_fraction", "seed")
            if (k in diff or "dataset_len" in diff)
            and (saved.get(k) is not None or (k == "data" and sample and cfg.data is not None))
            and not _same_value(k, saved[k], getattr(cfg, k))
        ]
        if changed:  # the flag that changed the sample count is named first, not dataset_len
            lead = "; ".join(
                f"{flag_of(k)} {_shown(getattr(cfg, k))} differs from the checkpoint's "
                f"{'(the shipped sample)' if saved[k] is None else _shown(saved[k])}"
                for k in changed
            )
            kept = [k for k in changed if saved[k] is not None]
            back = " ".join(f"{flag_of(k)} {_shown(saved[k])}" for k in kept)
            without = " and without --data" if len(kept) < len(changed) else ""
            resume = (
                f"resume with {back}{without} (or leave {'them' if len(changed) > 1 else 'it'} "
                f"out: the checkpoint's is taken)"
                if kept
                else RESUME_ON_THE_SAMPLE
            )
            raise UsageError(
                f"{lead}: --load {cfg.load} cannot continue its data order ({shown}); "
                f"{resume}{other}"
            )
        if diff == ["dataset_len"] and batch != cfg.global_batch_size:
            raise UsageError(  # the validation split grew (or shrank) to hold one batch
                f"--global-batch-size {cfg.global_batch_size} (the checkpoint's {batch}) changes "
                f"the validation split, which holds out whole documents until it holds one "
                f"global batch: --load {cfg.load} cannot continue its data order ({shown}); "
                f"resume with --global-batch-size {batch} (a run trained with --val-fraction 0 has "
                f"no split to move)"
                f"{other}"
            )
        raise UsageError(
            f"--load {cfg.load} cannot continue its data order: {shown}; resume "
            f"with the --data, --seq-len, --val-fraction and --seed it was saved "
            f"with (left out, they are the checkpoint's)"
            f"{other}"
        )


def check_same_data(cfg, manifest: dict, fingerprints: list[str] | None) -> None:
    """The checkpoint trained on the content --data holds now: each part's fingerprint (see
    `IndexedDataset.fingerprint`) is the one the checkpoint recorded, unless
    --allow-data-change. A checkpoint that recorded none (older, or from the Python API) is not
    checked."""
    if cfg.allow_data_change:
        return
    meta = manifest.get("meta") or {}
    saved = meta.get("data_fingerprint")
    trained = (meta.get("train_config") or {}).get("data")
    if saved and fingerprints is not None and saved == fingerprints:
        _check_same_blend_weights(cfg, trained)
    if not saved or fingerprints is None or saved == fingerprints:
        return
    paths = [p if p is not None else "(the shipped sample)" for p in data_paths(cfg.data)]
    if len(saved) > 1 and sorted(saved) == sorted(fingerprints):
        raise UsageError(
            f"--load {cfg.load} trained on the blend --data {_shown(trained)}; --data "
            f"{_shown(cfg.data)} gives the same parts in another order, which draws other "
            f"samples from here on; give them in the checkpoint's order (or leave --data "
            f"out), or pass --allow-data-change to continue on this order on purpose"
        )
    keys = (meta.get("train_config") or {}).get("sft_keys")
    if keys and cfg.sft_keys and parse_sft_keys(keys) != parse_sft_keys(cfg.sft_keys):
        raise UsageError(
            f"--load {cfg.load} trained on the records of --data {_shown(trained)} with "
            f"--sft-keys {keys}, and --sft-keys {cfg.sft_keys} reads them otherwise; "
            f"leave --sft-keys out (the checkpoint's), or pass --allow-data-change to "
            f"continue on these fields on purpose"
        )
    if "data" in (meta.get("train_config") or {}) and not _same_value("data", trained, cfg.data):
        # other files than it trained on (not the same files changed since)
        was = f"--data {_shown(trained)}" if trained is not None else "the shipped sample"
        back = (
            f"resume with --data {_shown(trained)} (or leave --data out: the checkpoint's is taken)"
            if trained is not None
            else RESUME_ON_THE_SAMPLE
        )
        raise UsageError(
            f"--load {cfg.load} trained on {was}, and --data {_shown(cfg.data)} holds other "
            f"tokens (their fingerprints differ); {back}, or pass --allow-data-change to "
            f"continue on this data on purpose"
        )
    changed = [str(p) for p, a, b in zip(paths, saved, fingerprints) if a != b] or [
        str(p) for p in paths
    ]
    shown = " ".join(str(p) for p in paths)
    raise UsageError(
        f"--load {cfg.load} trained on other tokens than --data {shown} holds now: "
        f"the content of {', '.join(changed)} changed since the checkpoint was "
        f"saved (its fingerprint differs); resume with the data it trained on, or "
        f"pass --allow-data-change to continue on this data on purpose"
    )


def _same_value(name: str, saved, given) -> bool:
    """Whether a recorded setting and the given one are the same: --data by the files its
    paths name (a relative path is the recorded absolute one), others by value."""
    if name != "data":
        return _shown(saved) == _shown(given)
    try:
        paths = [data_paths(saved), data_paths(given)]
    except ValueError:
        return _shown(saved) == _shown(given)
    real = [[p and os.path.realpath(os.path.expanduser(str(p))) for p in ps] for ps in paths]
    return real[0] == real[1]


def _shown(data) -> str:
    """A --data value as typed (a blend's items joined by spaces); another flag's value as text."""
    if isinstance(data, (list, tuple)):
        return " ".join(str(x) for x in data)
    return str(data)


def _check_same_blend_weights(cfg, trained) -> None:
    """A blend of the checkpoint's parts (in its order) weighs them as the checkpoint's did
    (normalised): other weights draw other samples from here on. UsageError naming both."""
    try:
        old = parse_blend(trained) if trained is not None else None
        new = parse_blend(cfg.data) if cfg.data is not None else None
    except ValueError:  # a recorded value this version does not parse: nothing to compare
        return
    if not old or not new or len(old) != len(new):
        return
    if all(math.isclose(a, b, rel_tol=1e-9) for (a, _), (b, _) in zip(old, new)):
        return

    def weights(blend) -> str:
        return ", ".join(f"{w:.4g} {p}" for w, p in blend)

    raise UsageError(
        f"--load {cfg.load} trained on the blend {weights(old)} and --data weighs the same "
        f"parts {weights(new)}, which draws other samples from here on; resume with its "
        f"weights (or leave --data out), or pass --allow-data-change to reweigh on purpose"
    )


def model_from_checkpoint(cfg, manifest: dict, given_config=None, given_from: str = ""):
    """The model config of a --load run: the checkpoint's. A --model / --from-hf given too
    must describe the same model (vocabulary aside for a recipe, which takes the tokenizer's)."""

    config = config_from_dict(manifest["model"])
    if given_config is not None:
        ours, theirs = given_config.to_dict(), config.to_dict()
        named = f"--model {cfg.model}" if given_from == "recipe" else given_from or "given"
        if ours.get("model_type") != theirs.get("model_type"):
            raise UsageError(
                f"--load {cfg.load} holds a {theirs.get('model_type')} model and "
                f"{named} is a {ours.get('model_type')}; with --load the model "
                f"comes from the checkpoint, drop {named.split()[0]}"
            )
        vocab = {"vocab_size"} if given_from == "recipe" else set()  # the tokenizer's
        diff = differing_fields(ours, theirs, NON_STRUCTURAL | vocab)
        if diff:
            shown = ", ".join(
                f"{k}={theirs.get(k)!r} (checkpoint) vs {ours.get(k)!r}" for k in diff
            )
            raise UsageError(
                f"--load {cfg.load} holds another model than {named}: "
                f"{shown}; with --load the model comes from the checkpoint, drop "
                f"--model / --from-hf"
            )
    check_steps_left(cfg, manifest)
    return config


def check_steps_left(cfg, manifest: dict | None) -> None:
    """UsageError where --load's checkpoint (`manifest`; None: a fresh start) is past a
    --replay's step (naming the checkpoint to load), or at --max-steps or past it: nothing left
    to train. Checked before the schedule the run would follow (a checkpoint's warmup longer
    than the new --max-steps offered --warmup-steps 2, refused next for this)."""
    if manifest is not None and cfg.replay and cfg.replay <= int(manifest.get("step", 0)):
        raise UsageError(replay_past(cfg, int(manifest.get("step", 0))))
    if manifest is not None and cfg.max_steps <= int(manifest.get("step", 0)):
        raise UsageError(
            f"--load {cfg.load} is at step {manifest.get('step')} and --max-steps "
            f"is {cfg.max_steps}: nothing left to train; raise --max-steps"
        )
