"""A torchtitan job config (its TOML, or a JSON / YAML file with its tables) read as
megapar-train's flags: what a torchtitan user's `--config job.toml` is told to give instead
(megapar-train does not read torchtitan's format), each setting as torchtitan reads it (its
defaults, its learning-rate schedule's clamps, float8 only among `model.converters`).
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Callable
from typing import Any, TypeVar

from megapar.one_line_parser import other_switch_value
from megapar.pipeline.schedules import schedule_named_elsewhere
from megapar.tensor_parallel.fp8 import FP8_RECIPES
from megapar.training.deepspeed_config import global_batch_flag
from megapar.training.hf_trainer_config import (
    Refused,
    command_line_wins,
    refused_value,
    setting_leaves,
)
from megapar.training.line_over_file import line_number, line_whole
from megapar.training.other_tools import OTHER_TOOLS_FLAGS

TORCHTITAN_SECTIONS = frozenset(
    {
        "job",
        "model",
        "training",
        "parallelism",
        "optimizer",
        "lr_scheduler",
        "checkpoint",
        "activation_checkpoint",
        "float8",
        "quantize",
        "metrics",
        "profiling",
        "comm",
        "compile",
        "validation",
        "experimental",
        "fault_tolerance",
        "memory_estimation",
        "debug",
    }
)
"""The tables of a torchtitan job config: a JSON or YAML `--config` holding one is one."""


def toml_job_config(
    path: str,
    kinds: dict | None = None,
    refused: Refused | None = None,
    command_line: dict | None = None,
) -> str:
    """Why a TOML `--config` (a torchtitan job config: `[training] steps = 1000`, `[float8]
    recipe_name = "rowwise"`) is not read, with its settings as megapar-train flags where
    `OTHER_TOOLS_FLAGS` knows them (`--max-steps 1000`; a sentence for what has no flag), each
    the command line gives as it gives it (`torchtitan_job`)."""
    said = (
        f"{path}: --config takes a JSON or YAML file of megapar-train's flags, not a TOML "
        f"job config (torchtitan's)"
    )
    try:
        with open(os.path.expanduser(path), "rb") as f:
            job = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        return f"{said} ({exc})"
    return torchtitan_job(job, said, kinds, refused, command_line)


def torchtitan_job(
    job: dict,
    said: str,
    kinds: dict | None = None,
    refused: Refused | None = None,
    command_line: dict | None = None,
) -> str:
    """`said` (why the file is not read) with torchtitan job config `job`'s settings as
    megapar-train flags: each key `OTHER_TOOLS_FLAGS` answers with one flag, with its value (a
    value of the kind the flag takes, `kinds`: megapar-train's flags, "bool" for a switch, int,
    float or str); a sentence for a key it answers with one; the schedule's and float8's own rules
    (`torchtitan_schedule`, `_float8_flags`); and the keys nothing answers. Or the first of
    those flags whose value megapar-train refuses (`refused`), as a value to correct. A flag the
    command line gives is said as it gives it (`command_line_wins`)."""
    kinds = kinds or {}
    if not any(isinstance(v, dict) and k in TORCHTITAN_SECTIONS for k, v in job.items()):
        return f"{said}; give its settings as megapar-train flags (megapar-train --help)"
    job, line_notes = _at_the_line(job, command_line)
    keys = list(_leaves(job))
    flags, sentences, left = [], [], []
    own = [str(k) for k, v in job.items() if not isinstance(v, dict)]
    if own:
        sentences.append(
            f"{', '.join(own)}: outside torchtitan's tables; a --config file of megapar-train's "
            "flags takes megapar's settings alone, without the tables"
        )
    enable = _table(job, "checkpoint").get("enable")
    saved = (other_switch_value(enable.strip()) if isinstance(enable, str) else enable) is not False
    keys = [  # enable: its folder names --save; off, no checkpoint key names anything
        (k, v)
        for k, v in keys
        if k != "checkpoint.enable" and (saved or not k.startswith("checkpoint."))
    ]
    training = _table(job, "training")
    batch: list[str] = []
    file_keys: dict[str, str] = {}  # the file's words for a flag's value, in the notes
    if "local_batch_size" in training and "global_batch_size" not in training:
        local = _as(int, training["local_batch_size"], training["local_batch_size"])
        dp = line_whole(command_line, "--dp")
        batch = [global_batch_flag([local], dp)]  # each dp rank's
        file_keys["--global-batch-size"] = f"training.local_batch_size {local} x " + (
            f"--dp {dp}" if dp else "dp"
        )
        # whole batch (it was said as 8 x the --dp size beside --dp 2, and kept beside
        # --global-batch-size; a re-test)
    schedule = job.get("lr_scheduler")
    if schedule is None:
        schedule = {}  # a job without [lr_scheduler] trains torchtitan's default schedule
    if isinstance(schedule, dict):
        line_warmup = "--warmup-steps" in (command_line or {})
        schedule_flags, schedule_said = torchtitan_schedule(job, schedule, line_warmup)
        flags += schedule_flags
        sentences += schedule_said
    checkpointing = _table(job, "activation_checkpoint")
    if checkpointing.get("mode") == "selective" and "selective_ac_option" not in checkpointing:
        sentences.append(
            "activation_checkpoint.mode selective: torchtitan's default selective_ac_option 2 "
            "recomputes every 2nd layer whole, where megapar's --recompute selective "
            "recomputes each layer's attention core (--recompute full: every layer whole)"
        )
    given = {k for k, _ in keys}
    overridden = {  # a key that another key of the job overrides (torchtitan reads the other)
        "training.local_batch_size": "parallelism.pipeline_parallel_microbatch_size",
        "training.seed": "debug.seed",
    }
    microbatch = "parallelism.pipeline_parallel_microbatch_size"
    if _as(int, _table(job, "parallelism").get("pipeline_parallel_degree"), 1) > 1:
        if microbatch not in given:  # torchtitan's pipeline micro-batches hold 1 sequence
            flags.append("--micro-batch-size 1")
        given.add(microbatch)  # the local batch is no micro-batch size
    for key, value in keys:
        ours = OTHER_TOOLS_FLAGS.get(f"--{key}")
        if kinds.get(ours) == "bool" and isinstance(value, str):  # compile.enable = "false":
            word = other_switch_value(value.strip())  # its word (it was "--compile takes no
            value = value if word is None else word  # value"; a re-test)
        if overridden.get(key) in given:
            continue  # its flag's value is the other key's
        if ours == "--lr" and key != "optimizer.lr" and "optimizer.lr" in given:
            left.append(f"{key} (torchtitan reads [optimizer] lr)")
            continue
        if key.startswith("lr_scheduler.") and key.split(".", 1)[1] in TORCHTITAN_SCHEDULE:
            continue  # named by torchtitan_schedule
        if _is_float8(key) or (key == "model.converters" and "float8" in str(value)):
            continue  # named by _float8_flags
        said_for = _torchtitan_value(key, value)
        if said_for is not None:
            if said_for.startswith("--"):
                flags.append(said_for)
            elif said_for and not _given(said_for, command_line):
                sentences.append(f"{key} {value}: {said_for}")
        elif ours is None:
            left.append(key)
        elif key.startswith("parallelism.data_parallel_") and value == 1:
            continue  # torchtitan's default: no replicas, or no sharding
        elif (wrong := _wrong_kind(value, kinds.get(ours))) is not None:
            sentences.append(f"{key} = {wrong}: {ours} takes {_TAKES[kinds[ours]]}")
        elif re.fullmatch(r"--[a-z0-9-]+", ours):  # one flag: with the file's value
            shown = " ".join(map(str, value)) if isinstance(value, list) else value
            shown = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(shown, shown)
            if kinds.get(ours) is int and not isinstance(value, (bool, list)):
                shown = int(float(value))  # 10.0 (TOML's float) is --max-steps 10
            if value is not False:
                flags.append(ours if value is True else f"{ours} {shown}")
                file_keys.setdefault(ours, f"{key} {shown}")  # (it said "the file's --seq-len")
        elif not _given(ours, command_line):
            sentences.append(f"{key}: {ours}")
    fp8_flags, fp8_said, fp8_left = _float8_flags(job, keys)
    flags += batch + fp8_flags
    sentences += fp8_said
    left += fp8_left
    if not (flags or sentences):
        return f"{said}; give its settings as megapar-train flags (megapar-train --help)"
    flags = list(dict.fromkeys(flags))  # [training] compile and [compile] enable: said once
    noted = frozenset(LINE_KEYS)  # `_at_the_line` said them (the line's --warmup-steps 100
    # was noted "over the file's --warmup-steps 50", the line's own value cut to the steps)
    flags, notes = command_line_wins(flags, command_line, noted=noted, file_keys=file_keys)
    sentences += line_notes + list(dict.fromkeys(notes))
    if line := refused_value(said, flags, refused, job):
        return line
    return (
        f"{said}; give its settings as megapar-train flags: "
        + "; ".join(([" ".join(flags)] if flags else []) + sentences)
        + (f" (no flag named for: {', '.join(left)})" if left else "")
    )


_TAKES = {"bool": "no value (a switch)", int: "a whole number", float: "a number", str: "a value"}


def _wrong_kind(value, kind) -> str | None:
    """`value` as a job config shows it where it is not of the `kind` a megapar-train flag
    takes (`_TAKES`: a true / false for a switch, a whole number, a number, a value: a list
    only for a flag of several values); None where it is, or the kind is not known."""
    shown = str(value).lower() if isinstance(value, bool) else repr(value)
    if kind == "bool":
        return None if isinstance(value, bool) else shown
    if kind is None:
        return None
    if isinstance(value, (bool, dict)):
        return shown
    if kind is str:
        return None
    if isinstance(value, list):
        return shown
    try:
        number = float(value)
    except (TypeError, ValueError):
        return shown
    return shown if kind is int and not number.is_integer() else None


def _leaves(job: dict):
    """(dotted key, value) of every setting of a job config's tables (`setting_leaves`); a
    top-level key outside any table is no torchtitan setting."""
    for key, value in job.items():
        if isinstance(value, dict):
            yield from setting_leaves(value, f"{key}.")


def _is_float8(key: str) -> bool:
    return key.startswith(("float8.", "quantize.linear.float8."))


def _float8_flags(
    job: dict, keys: list[tuple[str, object]]
) -> tuple[list[str], list[str], list[str]]:
    """The flags, sentences and keys nothing answers for a job's float8 settings: torchtitan
    converts its linears only where `model.converters` lists float8 (`"float8"`, or in its
    newer spelling `"quantize.linear.float8"`), with [float8]'s recipe (tensorwise by default)
    and emulation; without it [float8] is read by nothing, so it names no --fp8."""
    converters = _table(job, "model").get("converters") or []
    on = any(
        "float8" in str(c) for c in (converters if isinstance(converters, list) else [converters])
    )
    settings = {k: v for k, v in keys if _is_float8(k)}
    if not on:
        if not settings:
            return [], [], []
        return (
            [],
            [
                "float8: torchtitan applies its settings only with model.converters = "
                '["float8"], which this config does not list; so no --fp8 (give --fp8 '
                "tensorwise or rowwise to train in float8)"
            ],
            [],
        )
    recipe = next((v for k, v in settings.items() if k.endswith(".recipe_name")), None)
    # torchtitan's default is tensorwise; rowwise_with_gw_hp's nearest is rowwise
    nearest = "rowwise" if str(recipe).startswith("rowwise") else "tensorwise"
    flags = [f"--fp8 {recipe if recipe in FP8_RECIPES[1:] else nearest}"]
    sentences, left = [], []
    for key, value in settings.items():
        ours = OTHER_TOOLS_FLAGS.get(f"--{key}")
        if key.endswith(".recipe_name"):
            if recipe not in FP8_RECIPES[1:]:
                sentences.append(f"{key} {value}: {ours} (the nearest given: {flags[0]})")
        elif ours is None:
            left.append(key)
        elif ours == "--fp8-emulate":
            if value is True:
                flags.append(ours)
        elif value not in (False, [], None):
            sentences.append(f"{key}: {ours}")
    return flags, sentences, left


def _torchtitan_value(key: str, value) -> str | None:
    """For a torchtitan setting whose megapar flag depends on its value, the flag (or "" for
    nothing to give, or a sentence); None for every other setting."""
    if key == "parallelism.pipeline_parallel_schedule":
        said = schedule_named_elsewhere(str(value))
        ours = said.split(" is megapar's ", 1)[-1] if " is megapar's " in said else ""
        if ours.startswith("--") and " V" not in ours:
            return ours
        return said.split(": ", 1)[-1] if said else "not a schedule megapar names"
    if key == "optimizer.name" and isinstance(value, str):
        if value.lower() in ("adamw", "lamb", "lars", "sgd", "muon"):
            return f"--optimizer {value.lower()}"
        if value.lower() == "adam":
            return (
                "torch's Adam (the weight decay added to the gradient), which megapar has not; "
                "its nearest is --optimizer adamw (the decay decoupled)"
            )
        return None
    if key == "model.converters":  # without float8 (`_float8_flags` names that)
        return "megapar converts no layers but float8 linears (--fp8); drop it"
    if key == "parallelism.fsdp_reshard_after_forward":
        return "--zero3-keep-params" if value == "never" else ""
    if key == "checkpoint.async_mode":
        return "" if value == "disabled" else "--async-save"
    if key in ("metrics.enable_tensorboard", "metrics.enable_wandb"):
        return f"give {OTHER_TOOLS_FLAGS[f'--{key}']}" if value else ""
    return None


TORCHTITAN_SCHEDULE = ("warmup_steps", "decay_ratio", "decay_type", "min_lr_factor", "lr_min")
"""torchtitan's [lr_scheduler] keys `torchtitan_schedule` names as flags."""


LINE_KEYS = {
    "--lr": ("optimizer", "lr", float),
    "--max-steps": ("training", "steps", int),
    "--warmup-steps": ("lr_scheduler", "warmup_steps", int),
}
"""megapar-train's flags whose command-line values stand in a torchtitan job's keys before it
is translated: its schedule is then the line's (a cosine's floor of the line's --lr, a warmup
and a decay of the line's --max-steps; they were the file's, a re-test)."""


def _given(answer: str, command_line: dict | None) -> bool:
    """Whether the command line gives the flag a sentence tells ("give --tensorboard DIR"
    beside the line's --tensorboard tb was told again; a re-test)."""
    flag = re.search(r"--[a-z0-9][a-z0-9-]*", answer)
    return flag is not None and flag.group(0) in (command_line or {})


def _at_the_line(job: dict, command_line: dict | None) -> tuple[dict, list[str]]:
    """`job` with the command line's values of `LINE_KEYS`' flags in its tables, and a note
    for each value of the file's it replaced."""
    notes = []
    for flag, (table, key, kind) in LINE_KEYS.items():
        value = line_number(command_line, flag)
        if value is None or not isinstance(job.get(table, {}), dict):
            continue
        given = _table(job, table).get(key)
        job = {**job, table: {**_table(job, table), key: kind(value)}}
        if given is not None and given != value:
            said = (command_line or {})[flag]
            notes.append(f"the command line's {said} over the file's {table}.{key} {given}")
    return job, notes


DECAY_TYPES = ("linear", "sqrt", "cosine")
"""torchtitan's [lr_scheduler] decay_type values."""


def torchtitan_schedule(
    job: dict, schedule: dict, line_warmup: bool = False
) -> tuple[list[str], list[str]]:
    """A torchtitan job's [lr_scheduler] as megapar-train's schedule flags, its defaults
    filled in (warmup 200; decay_ratio None: a decay over every step after warmup; decay_type
    linear, min_lr_factor 0, [optimizer] lr 8e-4): megapar's own defaults (cosine to a tenth of
    --lr 1e-3) would train another schedule. As torchtitan computes it: a warmup longer than
    the steps is the steps; the decay is round(steps x decay_ratio) steps, cut to the steps
    after warmup, and none (the lr holds after warmup: --lr-decay constant) where that leaves
    none or the ratio is negative. A value that is no number counts as not given; one
    megapar-train cannot take (a negative warmup, a decay_type torchtitan lacks, a
    min_lr_factor outside [0, 1]) is a sentence instead of its flag; a decay the job's table
    sets is said to run one step ahead of megapar's; a warmup cut to the steps is said, but
    for the command line's own (`line_warmup`: the line's flag stands, as the line gave it).
    Returns (flags, sentences)."""
    flags, said = [], []
    steps = _as(int, _table(job, "training").get("steps"), 10000)
    asked = _as(int, schedule.get("warmup_steps"), 200)
    warmup = min(asked, steps)
    if asked > steps and not line_warmup:  # (it was cut without a word; a re-test)
        named = "lr_scheduler.warmup_steps" if "warmup_steps" in schedule else "torchtitan's warmup"
        said.append(
            f"{named} {asked} is more than the run's {steps} steps: torchtitan warms up over "
            f"all {steps} instead, and so do these flags (no step left to decay in)"
        )
    if warmup < 0:
        said.append(
            f"lr_scheduler.warmup_steps = {warmup}: --warmup-steps takes a whole number >= 0"
        )
    else:
        flags.append(f"--warmup-steps {warmup}")
    ratio = schedule.get("decay_ratio")
    ratio_n = None if ratio is None else _as(float, ratio, float("nan"))
    if ratio_n is not None and ratio_n != ratio_n:  # no number: not given
        ratio, ratio_n = None, None
    shape = schedule.get("decay_type", "linear")
    after_warmup = steps - max(warmup, 0)
    decay = round(steps * ratio_n) if ratio_n is not None else after_warmup
    decay = min(decay, after_warmup)  # torchtitan cuts the decay to the steps after warmup
    lr_keys = [k for k, _ in _leaves(job) if OTHER_TOOLS_FLAGS.get(f"--{k}") == "--lr"]
    if "lr" not in _table(job, "optimizer") and not lr_keys:  # a key gives --lr: its value
        flags.append("--lr 0.0008")  # torchtitan's default; megapar-train's is 1e-3
    if shape not in DECAY_TYPES and decay > 0:
        known = ", ".join(DECAY_TYPES)
        said.append(f"lr_scheduler.decay_type {shape}: torchtitan has no such decay ({known})")
        return flags, said
    if ratio_n is not None and decay == round(steps * ratio_n) and decay > 0:
        flags.append(f"--lr-decay wsd --lr-wsd-decay-fraction {ratio} --lr-wsd-decay-style {shape}")
    elif decay <= 0:  # no step left to decay in, or a negative ratio: the lr holds
        flags.append("--lr-decay constant")
        return flags, said  # a constant lr reads no --min-lr (megapar-train refuses one)
    elif ratio is not None or shape == "sqrt":  # a WSD of those steps (sqrt: no stable phase)
        flags.append(f"--lr-decay wsd --lr-wsd-decay-steps {decay} --lr-wsd-decay-style {shape}")
    else:
        flags.append(f"--lr-decay {shape}")
    factor = _as(float, schedule.get("min_lr_factor", schedule.get("lr_min")), 0.0)
    lr = _as(float, _table(job, "optimizer").get("lr"), 8e-4)
    if 0 <= factor <= 1:
        flags.append(f"--min-lr {lr * factor:g}")
    else:
        said.append(
            f"lr_scheduler.min_lr_factor {factor:g}: megapar's --min-lr is at most --lr and "
            "at least 0 (a factor from 0 to 1)"
        )
    if schedule:  # the job's own [lr_scheduler] (training.md; linear_warmup_stable_decay's)
        said.append(
            "lr_scheduler: torchtitan's decay runs one step ahead of these flags' (its last step "
            "trains at the minimum lr; megapar's, as Megatron-LM's, reaches it at step --max-steps)"
        )
    return flags, said


def _table(job: dict, name: str) -> dict:
    """Table `name` of a job config; {} where it has none (or a value there, not a table)."""
    table = job.get(name)
    return table if isinstance(table, dict) else {}


T = TypeVar("T")


def _as(kind: Callable[[Any], T], value: Any, default: T) -> T:
    """A job config's `value` as `kind` (int: a whole number, float: a number), `default`
    where it gives none or no number (a true / false is none)."""
    if isinstance(value, bool):
        return default
    try:
        return kind(value)
    except (TypeError, ValueError):
        return default
