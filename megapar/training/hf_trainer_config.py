"""A Hugging Face Trainer's arguments (a `TrainingArguments` JSON or YAML) read as
megapar-train's flags: what a Trainer user's `--config args.json` is told to give instead
(megapar-train does not read the Trainer's format), each setting as the Trainer reads it: its
defaults where the file leaves one out and megapar-train's differs (weight decay 0, beta2
0.999, a linear decay to 0 without warmup, seed 42).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from megapar.models.config import ConfigError, load_config_file
from megapar.one_line_parser import other_switch_value
from megapar.training.deepspeed_config import (
    DEEPSPEED_KEYS,
    deepspeed_equivalents,
    fp16_scaler,
    global_batch_flag,
)
from megapar.training.line_over_file import TRAINER_KEYS, line_whole, named_at_the_line
from megapar.training.other_tools import other_tools_answer
from megapar.wording import counted

TRAINER_ONLY_KEYS = frozenset(
    {
        "output_dir",
        "per_device_train_batch_size",
        "learning_rate",
        "num_train_epochs",
        "lr_scheduler_type",
        "logging_steps",
        "save_steps",
        "warmup_ratio",
        "max_grad_norm",
    }
)
"""Keys of the Trainer's arguments that are no megapar-train setting (nor DeepSpeed's): a
`--config` file with output_dir or two of them (one is a megapar config's misspelt setting),
no megapar-only setting and no DeepSpeed key is the Trainer's."""

SHARED_KEYS = frozenset(
    {
        "seed",
        "max_steps",
        "eval_steps",
        "weight_decay",
        "warmup_steps",
        "adam_beta1",
        "adam_beta2",
        "tf32",
        "debug",
    }
)
"""Names the Trainer and megapar-train share (eval_steps and debug meaning other things)."""

DEFAULT_MAX_STEPS = 300
"""megapar-train's default --max-steps (TrainConfig's, which this module cannot import: a test
holds them equal), past which a translated warmup is refused."""

SCHEDULES = {
    "linear": "--lr-decay linear --min-lr 0",
    "cosine": "--lr-decay cosine --min-lr 0",
    "constant": "--lr-decay constant",
    "constant_with_warmup": "--lr-decay constant",
}
"""The Trainer's lr_scheduler_type as megapar-train's schedule flags (its decays end at 0)."""

Refused = Callable[[list[str]], str | None]
"""megapar-train's check of translated flags: the first one whose value it refuses, said as it
says it (`megapar.training.config.refused_flag`), or None."""


def refused_value(
    said: str, flags: list[str], refused: Refused | None, data: dict | None = None
) -> str | None:
    """`said` (what the file is, which megapar-train does not read) with the first of its
    translated `flags` whose value megapar-train refuses (`refused`), and the key of the file's
    settings `data` that holds that value where one alone does; None where it takes them all,
    or no check is given."""
    problem = refused(flags) if refused is not None else None
    if not problem:
        return None
    key = _key_of(problem, data) if data is not None else None
    return (
        f"{said}, and a value in it is one megapar-train refuses: {problem}"
        + (f" (the file's {key})" if key else "")
        + "; correct it in the file"
    )


def command_line_wins(
    flags: list[str],
    command_line: dict[str, str] | None,
    file_flags: list[str] | None = None,
    noted: frozenset[str] = frozenset(),
    file_keys: dict[str, str] | None = None,
) -> tuple[list[str], list[str]]:
    """Translated `flags` with each flag the command line gives as it gives it (`command_line`:
    the text of its own flags by flag, a switch by both spellings: the command line wins over a
    file, as over a --config of megapar-train's own), and a sentence for each it changed ("the
    command line's --min-lr 5e-05 over the file's --min-lr 0.0001"). `file_flags`: the file's
    translation without the line's values in it, whose value the sentence names (none where it
    has none, or the line's): a value derived from the line's (a global batch of its
    micro-batch, a warmup cut to its steps) is not called the file's, and one the line's
    values make equal to the line's is still noted where the file's own differs (re-tests);
    `noted`: the flags whose notes name the file's keys elsewhere (`at_the_line`, a
    torchtitan job's `_at_the_line`);
    `file_keys`: the file's own words for a flag's value ("training.local_batch_size 8"), which
    the sentence names instead of the flag."""
    own = {g[0]: " ".join(g) for f in (file_flags or []) for g in _groups(f)}
    kept, notes = [], []
    for text in flags:
        words = []
        for group in _groups(text):
            theirs, ours = " ".join(group), (command_line or {}).get(group[0])
            said = theirs if file_flags is None else own.get(group[0])
            moved = (ours != theirs or file_flags is not None) and group[0] not in noted
            if ours is not None and moved and said is not None and said != ours:
                said = (file_keys or {}).get(group[0], said)
                notes.append(f"the command line's {ours} over the file's {said}")
            words.append(ours if ours is not None else theirs)
        kept.append(" ".join(words))
    # the file's warmup under the line's --max-steps is cut to it (--warmup-steps 100 at
    # --max-steps 50 was refused next); a --warmup-steps of the line's own is left to the line
    # (a note called the line's 10 the file's; re-tests)
    steps = (command_line or {}).get("--max-steps")
    warmup = dict(_pairs(kept)).get("--warmup-steps")
    given = "--warmup-steps" in (command_line or {})
    if steps and warmup and not given and _number(warmup) and _number(steps.split()[-1]):
        most = steps.split()[-1]
        if float(warmup) > float(most):
            cut = re.compile(rf"--warmup-steps {re.escape(warmup)}(?=\s|$)")
            kept = [cut.sub(f"--warmup-steps {most}", f) for f in kept]
            notes.append(f"the file's warmup of {warmup} steps cut to the command line's {steps}")
    if clash := _batch_clash(dict(_pairs(kept)), command_line or {}):
        notes.append(clash)
    return kept, notes


TRAINER_BATCH = (("per_device_train_batch_size", 8), ("gradient_accumulation_steps", 1))
"""A Trainer's per-GPU batch keys and their defaults (x the GPUs: its global batch)."""


def batch_words(data: dict, keys: tuple, command_line: dict[str, str] | None) -> str:
    """Another tool's global batch in its own words, as a note names the file's value: its
    per-GPU `keys` (key, default) given or not 1, x the command line's --dp ("x dp" without
    one): "per_device_train_batch_size 4 x gradient_accumulation_steps 2 x --dp 2" (it was
    "the file's --global-batch-size 16"; a re-test)."""
    words = [
        f"{key} {data.get(key, default)}" for key, default in keys if key in data or default != 1
    ]
    dp = line_whole(command_line, "--dp")
    return " x ".join([*words, f"--dp {dp}" if dp else "dp"])


def _batch_clash(flags: dict[str, str], command_line: dict[str, str]) -> str | None:
    """Where the translated --global-batch-size is no multiple of --micro-batch-size x the
    command line's --dp (megapar-train refuses the flags it was handed: a torchtitan file's
    local_batch_size 8 beside the line's --dp 2 --global-batch-size 8; a re-test), the
    sentence naming the clash and both fixes; None where they fit or either is not a number."""
    mbs, gbs = flags.get("--micro-batch-size", ""), flags.get("--global-batch-size", "")
    dp = (command_line.get("--dp") or "--dp 1").split()[-1]
    if not (mbs.isdigit() and gbs.isdigit() and dp.isdigit()) or not int(mbs) * int(dp):
        return None
    step = int(mbs) * int(dp)
    if int(gbs) % step == 0:
        return None
    per_rank = int(gbs) // int(dp)  # the largest micro-batch below the file's that fits
    fits = next((d for d in range(min(per_rank, int(mbs)), 0, -1) if per_rank % d == 0), None)
    other = f", or --micro-batch-size {fits}" if fits and int(gbs) % int(dp) == 0 else ""
    return (
        f"but --global-batch-size {gbs} is no multiple of --micro-batch-size {mbs} x --dp {dp} "
        f"= {step}, which megapar-train refuses: give --global-batch-size {step} (or a "
        f"multiple){other}"
    )


def _groups(text: str) -> list[list[str]]:
    """The flags of translated `text`, each with its words ("--adam-beta1 0.9 --adam-beta2
    0.95" is two)."""
    groups: list[list[str]] = []
    for token in text.split(" "):
        if token.startswith("--") or not groups:
            groups.append([token])
        else:
            groups[-1].append(token)
    return groups


def _key_of(problem: str, data: dict) -> str | None:
    """The dotted key of `data` (nested tables) whose value is the one a refusal ("--zero 4 is
    invalid: ...") names, as "zero_optimization.stage 4": of several keys holding it, the one
    sharing most words with the flag's name; None where no key holds it, or no one key is
    nearest."""
    said = re.match(r"--([\w-]+) '?([^' ]+?)'? is invalid", problem)
    if not said:
        return None
    flag_words, value = set(said[1].split("-")), said[2]

    leaves = [  # a list's items too (optimizer.params.betas.1 of betas: [0.9, 1.5])
        (f"{k}.{i}", item) if isinstance(v, list) else (k, v)
        for k, v in setting_leaves(data)
        for i, item in (enumerate(v) if isinstance(v, list) else [(0, v)])
    ]
    found = [(k, v) for k, v in leaves if not isinstance(v, (dict, list)) and _alike(str(v), value)]
    if len(found) > 1:  # several: the one another tool names the flag by (--tp's
        known = [f for f in found if other_tools_answer(f[0]) == f"--{said[1]}"]  # degree)
        found = known if len(known) == 1 else found
    if len(found) > 1:  # several: those whose key shares the most words with the flag's name
        shared = [len(flag_words & set(re.split(r"[._]", k))) for k, _ in found]
        found = [f for f, n in zip(found, shared) if n == max(shared) > 0]
    if len(found) > 1:  # still several: the one named as the flag is (optimizer.lr for --lr)
        exact = [f for f in found if f[0].rsplit(".", 1)[-1] == said[1].replace("-", "_")]
        found = exact or found
    return f"{found[0][0]} {found[0][1]!r}" if len(found) == 1 else None


def setting_leaves(data: dict, above: str = ""):
    """(dotted key, value) of every setting in `data`, tables' settings under theirs
    (`[quantize.linear.float8] recipe_name` is `quantize.linear.float8.recipe_name`)."""
    for key, value in data.items():
        name = f"{above}{key}"
        if isinstance(value, dict):
            yield from setting_leaves(value, name + ".")
        else:
            yield name, value


def is_trainer_arguments(data: dict, own: set[str]) -> bool:
    """Whether a `--config` file's settings `data` are a Hugging Face Trainer's (see
    `TRAINER_ONLY_KEYS`; `own`: megapar-train's settings' names). A DeepSpeed config's keys
    (`DEEPSPEED_KEYS`, zero_optimization, its fp16 / bf16 tables) make it DeepSpeed's."""
    trainer = TRAINER_ONLY_KEYS & set(data)
    if "output_dir" not in trainer and len(trainer) < 2:
        return False
    if (set(data) & own) - SHARED_KEYS or DEEPSPEED_KEYS & set(data) - {"fp16", "bf16"}:
        return False
    return not any(isinstance(data.get(k), dict) for k in ("fp16", "bf16"))


def switched_on(data: dict, key: str) -> bool:
    """The Trainer's switch `key` of its arguments `data`, its value read as the Trainer's
    string_to_bool reads a word ("false", "no", "0" are false; the string "false" was read as
    true)."""
    value = data.get(key, False)
    if isinstance(value, str):
        return other_switch_value(value.strip()) is True
    return bool(value)


def trainer_flags(data: dict, command_line: dict | None) -> tuple[list[str], list[str]]:
    """The Trainer's arguments `data` as megapar-train's (flags, sentences), the Trainer's
    defaults filled in where megapar-train's differ. `command_line`: the command line's flags
    (`command_line_wins`), whose values stand in the file's (`at_the_line`): its --max-steps is
    said as the line's, its --dp makes the global batch a number, and an inline DeepSpeed value
    is not compared with the Trainer's where the line sets both."""
    line = frozenset(command_line or {})
    steps_name = named_at_the_line(command_line, "--max-steps", "the Trainer's max_steps")
    dp = line_whole(command_line, "--dp")
    flags: list[str] = []
    said: list[str] = []

    def get(key: str, default: Any) -> Any:
        """The setting, as a number where it reads as one (YAML reads 3e-4 as a string)."""
        value = data.get(key, default)
        if value is None:
            return default
        if isinstance(value, str) and isinstance(default, (int, float)):
            try:
                number = float(value)
            except ValueError:
                return value
            return int(number) if isinstance(default, int) and number.is_integer() else number
        return value

    def on(key: str) -> bool:
        return switched_on(data, key)

    def shown(key: str, default: float) -> str:
        value = get(key, default)
        return f"{value:g}" if isinstance(value, (int, float)) else str(value)

    micro = get("per_device_train_batch_size", 8)
    flags.append(f"--micro-batch-size {micro}")
    accumulation = get("gradient_accumulation_steps", 1)
    flags.append(global_batch_flag([micro, accumulation], dp))  # x the line's --dp (it was
    # said as 8 x the --dp size beside --dp 2, and kept beside --global-batch-size; a re-test)
    optim = str(get("optim", "adamw_torch")).lower().rpartition(".")[2]
    optim_args = dict(  # "momentum=0.9, nesterov=True": transformers' SGD reads them there
        part.split("=", 1)
        for part in str(data.get("optim_args") or "").replace(" ", "").split(",")
        if "=" in part
    )
    flags.append(f"--lr {shown('learning_rate', 5e-5)}")
    if optim == "sgd" and "weight_decay" in optim_args:
        flags.append(f"--weight-decay {optim_args['weight_decay']}")
    else:
        flags.append(f"--weight-decay {shown('weight_decay', 0.0)}")
    if optim != "sgd":  # SGD has no moments (megapar-train refuses the Adam flags with it)
        flags.append(f"--adam-beta1 {shown('adam_beta1', 0.9)}")
        flags.append(f"--adam-beta2 {shown('adam_beta2', 0.999)}")
        flags.append(f"--adam-eps {shown('adam_epsilon', 1e-8)}")
    flags.append(f"--clip-grad {shown('max_grad_norm', 1.0)}")
    flags.append(f"--seed {get('seed', 42)}")
    steps = get("max_steps", -1)
    if isinstance(steps, float) and steps.is_integer():
        steps = int(steps)  # 100.0, as the Trainer takes it
    steps = steps if isinstance(steps, int) else -1  # no whole number: the epochs count
    if steps > 0:
        flags.append(f"--max-steps {steps}")
    else:
        said.append(
            f"num_train_epochs {get('num_train_epochs', 3.0):g}: megapar-train counts optimizer "
            f"steps: --max-steps (an epoch is the training split's samples over the global batch)"
        )
    warmup, ratio = get("warmup_steps", 0), get("warmup_ratio", 0.0)
    warmup = warmup if isinstance(warmup, (int, float)) else 0  # no number: the default
    ratio = ratio if isinstance(ratio, (int, float)) else 0.0
    ratio_key = "warmup_ratio"
    schedule = str(get("lr_scheduler_type", "linear")).lower().rpartition(".")[2]
    if isinstance(warmup, float) and 0 < warmup < 1:  # transformers 5's ratio in warmup_steps
        warmup, ratio, ratio_key = 0, warmup, "warmup_steps"
    elif warmup > 0:  # transformers 4: warmup_steps > 0 overrides warmup_ratio
        ratio = 0.0
    own_warmup = int(warmup) if warmup > 0 else math.ceil(ratio * steps) if steps > 0 else 0
    inline = data.get("deepspeed")  # its scheduler replaces the Trainer's, warmup filled in
    replaced = isinstance(inline, dict) and isinstance(inline.get("scheduler"), dict)
    line_warmup = (command_line or {}).get("--warmup-steps")
    if line_warmup is not None:  # the line's: none derived from the file's or cut (a note
        flags.append(line_warmup)  # called a cut to 50 of warmup_steps 100 the file's; a re-test)
        if ratio or (warmup and line_warmup.split()[-1] != f"{warmup:g}"):
            file_warmup = f"{ratio_key} {ratio:g}" if ratio else f"warmup_steps {warmup:g}"
            said.append(f"the command line's {line_warmup} over the file's {file_warmup}")
    elif schedule == "constant" and not replaced:  # get_constant_schedule: no warmup (it was
        flags.append("--warmup-steps 0")  # warmed up, "never reaching its learning_rate")
        if warmup or ratio:
            said.append(
                f"{ratio_key if ratio else 'warmup_steps'} {ratio or warmup:g}: the Trainer's "
                f"constant schedule does not warm up (constant_with_warmup does)"
            )
    elif not 0 <= ratio <= 1:  # the Trainer refuses it ("warmup_ratio must lie in [0,1]")
        said.append(f"{ratio_key} {ratio:g}: a share of the training steps, from 0 to 1")
    elif ratio and steps > 0:
        flags.append(f"--warmup-steps {math.ceil(ratio * steps)}")  # the Trainer's rounding
    elif ratio:
        said.append(f"{ratio_key} {ratio:g}: --warmup-steps (the ratio x the training steps)")
    elif steps > 0 and warmup > steps:  # the Trainer warms up past its end, never at --lr
        flags.append(f"--warmup-steps {steps}")  # (--warmup-steps 500 was refused next at
        said.append(  # --max-steps 100; a re-test)
            f"warmup_steps {int(warmup)}: more than {steps_name} {steps}, never reaching its "
            f"learning_rate (megapar's warmup ends within --max-steps: --warmup-steps {steps})"
        )
    else:
        flags.append(f"--warmup-steps {int(warmup)}")
        if steps <= 0 and warmup >= DEFAULT_MAX_STEPS:  # epochs: the --max-steps to choose
            said.append(
                f"warmup_steps {int(warmup)}: the --max-steps you choose must be more "
                f"(megapar-train's default is {DEFAULT_MAX_STEPS}), or give a shorter "
                f"--warmup-steps"
            )
    kwargs = data.get("lr_scheduler_kwargs")
    kwargs = kwargs if isinstance(kwargs, dict) else {}
    lr = get("learning_rate", 5e-5)
    lr = lr if isinstance(lr, (int, float)) else 5e-5
    cycles = kwargs.get("num_cycles", 0.5)
    if schedule in ("cosine", "cosine_with_min_lr") and cycles != 0.5:
        said.append(
            f"lr_scheduler_kwargs num_cycles {cycles}: megapar-train's cosine is half a wave "
            f"(num_cycles 0.5), from --lr down to --min-lr once"
        )
    if schedule in SCHEDULES:
        flags.append(SCHEDULES[schedule])
    elif schedule == "cosine_with_min_lr" and not {"min_lr", "min_lr_rate"} & set(kwargs):
        said.append(
            "lr_scheduler_type cosine_with_min_lr: transformers refuses it without min_lr or "
            "min_lr_rate in lr_scheduler_kwargs; megapar-train's is --lr-decay cosine --min-lr LR"
        )
    elif schedule == "cosine_with_min_lr":  # min_lr, or min_lr_rate x the peak
        floor = kwargs.get("min_lr", lr * float(kwargs.get("min_lr_rate", 0.0)))
        flags.append(f"--lr-decay cosine --min-lr {float(floor):g}")
    elif schedule == "polynomial" and float(kwargs.get("lr_end", 1e-7)) >= lr:
        said.append(
            f"lr_scheduler_kwargs lr_end {float(kwargs.get('lr_end', 1e-7)):g}: transformers "
            f"refuses an lr_end not below learning_rate {lr:g} (as megapar-train a --min-lr above "
            f"--lr)"
        )
    elif schedule == "polynomial" and float(kwargs.get("power", 1.0)) == 1.0:  # linear to lr_end
        flags.append(f"--lr-decay linear --min-lr {float(kwargs.get('lr_end', 1e-7)):g}")
    elif schedule == "warmup_stable_decay":
        flags.append(f"--lr-decay wsd --min-lr {lr * float(kwargs.get('min_lr_ratio', 0.0)):g}")
        if "num_decay_steps" in kwargs:
            flags.append(f"--lr-wsd-decay-steps {kwargs['num_decay_steps']}")
        style = kwargs.get("decay_type", "cosine")  # transformers' get_wsd_schedule's default
        flags.append(f"--lr-wsd-decay-style {'sqrt' if style == '1-sqrt' else style}")
        decay_steps, stable = kwargs.get("num_decay_steps"), kwargs.get("num_stable_steps")
        if decay_steps is None:
            said.append(
                "lr_scheduler_type warmup_stable_decay: transformers refuses it without "
                "num_decay_steps in lr_scheduler_kwargs (megapar-train's: --lr-wsd-decay-steps)"
            )
        warmed = math.ceil(ratio * steps) if ratio and steps > 0 else None if ratio else warmup
        ends = None
        if isinstance(stable, int) and isinstance(decay_steps, int) and warmed is not None:
            ends = int(warmed) + stable + decay_steps
        if ends is not None and ends != steps:  # the decay ends before --max-steps
            flags.append(f"--lr-decay-steps {ends}")
        elif "num_stable_steps" in kwargs and ends is None and decay_steps is not None:
            said.append(
                "lr_scheduler_kwargs num_stable_steps: --lr-decay-steps (the warmup + "
                "num_stable_steps + num_decay_steps) ends the decay there, the lr then held at "
                "--min-lr; without it the stable phase is what --max-steps leaves"
            )
    else:
        said.append(
            f"lr_scheduler_type {schedule}"
            + (f" power {kwargs['power']}" if schedule == "polynomial" else "")
            + ": megapar-train's --lr-decay is linear, cosine, constant or wsd (with --min-lr)"
        )
    if kwargs.get("warmup_type", "linear") != "linear":
        said.append(
            f"lr_scheduler_kwargs warmup_type {kwargs['warmup_type']}: megapar-train's warmup "
            f"is linear"
        )
    if optim == "lamb":  # no OptimizerNames member: transformers refuses it
        said.append(
            "optim lamb: not one of transformers' optimizers (it refuses it); megapar-train's "
            "--optimizer lamb is LAMB"
        )
    elif optim.startswith("adamw") or optim in ("adam", "sgd"):  # adamw_torch_fused, ...
        if not optim.startswith("adamw"):
            flags.append(f"--optimizer {'adamw' if optim == 'adam' else optim}")
        momentum = optim_args.get("momentum", "0")
        if optim == "sgd" and _number(momentum) != 0.9:
            said.append(
                f"optim sgd: the Trainer's is torch's SGD with momentum {momentum}"
                + (" (its optim_args)" if "momentum" in optim_args else "")
                + "; megapar's sgd uses momentum 0.9"
            )
        others = [
            f"{k}={v}"
            for k, v in optim_args.items()
            if optim == "sgd"
            and k in ("dampening", "nesterov")
            and v not in ("0", "False", "false")
        ]
        if others:
            said.append(
                f"optim_args {','.join(others)}: megapar's sgd has no dampening and no Nesterov "
                "momentum"
            )
    else:
        said.append(
            f"optim {optim}: megapar-train's --optimizer is adamw, lamb, lars, sgd or muon "
            f"(not given, it trains with AdamW)"
        )
    if on("bf16") or on("fp16"):
        flags.append(f"--precision {'bf16' if on('bf16') else 'fp16'}")
    smoothing = get("label_smoothing_factor", 0.0)
    if smoothing != 0.0:
        flags.append(f"--label-smoothing {smoothing}")
    if on("gradient_checkpointing"):
        flags.append("--recompute full")
    if on("torch_compile"):
        flags.append("--compile")
    sharding, fsdp_said = _fsdp(data.get("fsdp"), data.get("fsdp_config"))
    flags += sharding
    said += fsdp_said

    def interval(flag: str, key: str, default: float) -> None:
        """`flag` for the Trainer's steps setting `key`; one below 1 is its ratio of the
        training steps (rounded up, as the Trainer does); one the Trainer refuses is said so."""
        value = get(key, default)
        if isinstance(value, float) and 0 < value < 1:
            if steps > 0:
                flags.append(f"{flag} {math.ceil(value * steps)}")
            else:
                said.append(f"{key} {value:g}: {flag} (the ratio x the training steps)")
        elif isinstance(value, (int, float)) and value >= 1 and float(value).is_integer():
            flags.append(f"{flag} {int(value)}")
        else:
            said.append(
                f"{key} {value}: not a setting the Trainer takes (a whole number >= 1, or a "
                f"ratio of the training steps below 1); {flag} N"
            )

    def strategy(key: str, default: str) -> str:
        """The Trainer's `key` strategy ("steps", "epoch", "no"; an enum's name read too)."""
        return str(get(key, default)).lower().rpartition(".")[2]

    if data.get("output_dir"):
        flags.append(f"--save {data['output_dir']}")
        if strategy("save_strategy", "steps") == "steps":
            interval("--save-interval", "save_steps", 500)
        if data.get("save_total_limit"):
            flags.append(f"--keep-latest-k {data['save_total_limit']}")
    if strategy("logging_strategy", "steps") == "steps":
        interval("--log-interval", "logging_steps", 500)
    evaluation = strategy("eval_strategy", strategy("evaluation_strategy", "no"))
    if evaluation == "steps":  # eval_steps unset: the Trainer's logging_steps
        interval(
            "--eval-interval", "eval_steps" if data.get("eval_steps") else "logging_steps", 500
        )
    elif data.get("eval_steps"):
        said.append(
            f"eval_steps: the Trainer evaluates on steps only with eval_strategy steps (here "
            f"{evaluation}); megapar-train evaluates every --eval-interval steps"
        )
    if data.get("ddp_timeout") is not None:  # the Trainer's default 1800 s; megapar's 300
        flags.append(f"--timeout-s {shown('ddp_timeout', 1800)}")
    deepspeed = data.get("deepspeed")
    if isinstance(deepspeed, str):  # the file the Trainer reads, read as it reads it (its
        try:  # scheduler replaces the Trainer's, its values are compared)
            deepspeed = load_config_file(deepspeed) or deepspeed
            unread = "an empty file"
        except ConfigError as exc:  # "no such config file", "not valid JSON ..."
            unread = str(exc).split(": ", 1)[-1]
    if isinstance(deepspeed, str):  # unread, which the Trainer refuses too (it was told to
        said.append(  # give the file to --config, which refused it next)
            f"deepspeed {deepspeed}: {unread}, which the Trainer refuses too; fix the path or "
            f"the file, then give it to --config for its settings as megapar-train flags"
        )
    elif isinstance(deepspeed, dict):  # the config itself, as the Trainer takes it
        own = {"--warmup-steps": str(own_warmup)}  # the Trainer's, before a cut to --max-steps
        flags += _inline_deepspeed(deepspeed, flags, said, data, steps_name, own, line)
    report_flags, report_said = _reports(data.get("report_to"), data.get("logging_dir"), line)
    flags += report_flags  # (wandb was "the Trainer's other arguments ... have no flag")
    said += report_said
    if data.get("resume_from_checkpoint"):
        said.append(
            "resume_from_checkpoint: --load takes a megapar checkpoint; a Trainer "
            "checkpoint's weights start a run with --from-hf"
        )
    return flags, said


def _reports(report: Any, logging_dir: Any, line: frozenset[str]) -> tuple[list[str], list[str]]:
    """The Trainer's report_to (a name, "all", or a list of them) as megapar-train's reporting:
    tensorboard is --tensorboard, at its logging_dir where one is given, wandb --wandb-project
    NAME (a sentence: the Trainer takes the project from WANDB_PROJECT; none where the command
    line's flags `line` give it: it was told beside it, a re-test); others are said to have
    none, and "none" nothing (megapar-train's default)."""
    names = report if isinstance(report, list) else [report] if isinstance(report, str) else []
    wanted = {str(n).strip().lower() for n in names} - {"none", ""}
    if "all" in wanted:
        wanted = (wanted - {"all"}) | {"wandb", "tensorboard"}
    flags, said = [], []
    if "tensorboard" in wanted and isinstance(logging_dir, str) and logging_dir.strip():
        flags.append(f"--tensorboard {logging_dir.strip()}")
    elif "tensorboard" in wanted and "--tensorboard" not in line:
        said.append("report_to tensorboard: --tensorboard DIR")
    if "wandb" in wanted and "--wandb-project" not in line:
        said.append(
            "report_to wandb: --wandb-project NAME (the Trainer's WANDB_PROJECT), a run's name "
            "the environment's WANDB_NAME"
        )
    others = sorted(wanted - {"tensorboard", "wandb"})
    if others:
        said.append(
            f"report_to {', '.join(others)}: megapar-train reports to Weights & Biases "
            f"(--wandb-project) and TensorBoard (--tensorboard) alone"
        )
    return flags, said


def _accelerate_deepspeed(
    deepspeed: dict, stage: Any, precision: Any, said: list[str], batch: tuple
) -> list:
    """An accelerate DeepSpeed plugin's offload, fp16 scaler, clipping and accumulation (its
    settings in the config itself) as megapar-train's flags; what has none goes to `said`.
    `batch`: the (micro-batch, dp) its global batch is of (`_clipping_and_steps`)."""
    flags = []
    devices = {
        part: str(deepspeed.get(f"offload_{part}_device", "none")).lower()
        for part in ("optimizer", "param")
    }
    for part, device in devices.items():
        if device == "nvme":  # as a DeepSpeed config's offload to nvme is said
            said.append(f"offload_{part}_device nvme: no equivalent (megapar offloads to the host)")
    offloads = {part: device == "cpu" for part, device in devices.items()}
    if offloads["optimizer"]:
        flags.append("--offload-optimizer")
    if offloads["param"] and stage != 3:
        said.append("offload_param_device: DeepSpeed offloads parameters at stage 3 only")
    elif offloads["param"] and offloads["optimizer"]:
        flags.append("--offload-params")
    elif offloads["param"] and devices["optimizer"] == "nvme":
        said.append(
            "offload_param_device cpu: megapar offloads the parameters with the optimizer state, "
            "to the host (--offload-optimizer --offload-params)"
        )
    elif offloads["param"]:
        said.append(
            "offload_param_device without offload_optimizer_device: megapar offloads the "
            "parameters with the optimizer state (--offload-optimizer --offload-params)"
        )
    if precision == "fp16":  # DeepSpeed's dynamic scaler's defaults
        flags += fp16_scaler({})[0]
    flags += _clipping_and_steps(
        deepspeed, "gradient_clipping", "gradient_accumulation_steps", batch
    )
    return flags


def _clipping_and_steps(section: dict, clip_key: str, steps_key: str, batch: tuple) -> list:
    """A plugin `section`'s gradient clipping (`clip_key`) as --clip-grad, and its micro-batches
    a step (`steps_key`) as the global batch's factor: --global-batch-size of the (micro-batch,
    dp) `batch` (None where not known: a product with it; it was a sentence of the --dp size
    beside the command line's --global-batch-size, --micro-batch-size and --dp; a re-test)."""
    clipping = section.get(clip_key)
    flags = []
    if isinstance(clipping, (int, float)) and not isinstance(clipping, bool):
        flags.append(f"--clip-grad {clipping:g}")
    steps = section.get(steps_key)
    if isinstance(steps, int) and not isinstance(steps, bool) and steps > 1:
        micro, dp = batch
        flags.append(global_batch_flag([micro or "--micro-batch-size", steps], dp))
    return flags


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _fsdp(fsdp: Any, fsdp_config: Any) -> tuple[list[str], list[str]]:
    """The Trainer's `fsdp` / `fsdp_config` as megapar-train's (flags, sentences), read as
    transformers 5 reads them: a legacy string or list of options sets `fsdp_config`'s
    `reshard_after_forward` (full_shard True: ZeRO-3; shard_grad_op False: ZeRO-2; FSDP1's
    hybrid_shard / hybrid_shard_zero2 / no_shard by name) and `cpu_offload` (offload)."""
    if not fsdp or fsdp in ("false", "False"):
        return [], []
    config = dict(fsdp_config) if isinstance(fsdp_config, dict) else {}
    config = {k.removeprefix("fsdp_"): v for k, v in config.items()}
    if isinstance(fsdp, (str, list)) and fsdp not in ("true", "True"):
        items = fsdp.split() if isinstance(fsdp, str) else [str(i) for i in fsdp]
        unknown = [i for i in items if i not in FSDP_OPTIONS]
        if unknown:
            return [], [
                f"fsdp {' '.join(unknown)}: not one of the Trainer's options "
                f"({', '.join(FSDP_OPTIONS)}); megapar's FSDP is --zero 3 (--zero 2 for "
                f"shard_grad_op)"
            ]
        for item in items:
            if item == "offload":
                config.setdefault("cpu_offload", True)
            elif item != "auto_wrap":
                config.setdefault("reshard_after_forward", item)
    given = config.get("reshard_after_forward", True)
    # torch's enum's name too (ShardingStrategy._HYBRID_SHARD_ZERO2, as str() of one prints it)
    reshard = str(given).lower().removeprefix("shardingstrategy.").lstrip("_")
    if reshard == "no_shard":  # the Trainer's plain data parallelism, megapar-train's default
        return [], []
    zero = RESHARD_ZERO.get(reshard)
    if zero is None:
        return [], [
            f"FSDP's sharding {given!r}: not one megapar reads (reshard_after_forward true / "
            f"false, or {', '.join(FSDP_OPTIONS[:5])}); megapar's FSDP is --zero 3 (--zero 2 "
            f"for shard_grad_op)"
        ]
    offload = str(config.get("cpu_offload", False)).lower() == "true"
    flags = f"--zero {zero}"
    if offload:
        flags += " --offload-optimizer" + (" --offload-params" if zero == 3 else "")
    return [flags], []


RESHARD_ZERO = {
    "true": 3,
    "full_shard": 3,
    "hybrid_shard": 3,
    "false": 2,
    "shard_grad_op": 2,
    "hybrid_shard_zero2": 2,
}
"""FSDP's `reshard_after_forward` (FSDP2's true / false, FSDP1's strategy by name) as megapar's
ZeRO stage (no_shard: none)."""

FSDP_OPTIONS = (
    "full_shard",
    "shard_grad_op",
    "hybrid_shard",
    "hybrid_shard_zero2",
    "no_shard",
    "offload",
    "auto_wrap",
)
"""The Trainer's `fsdp` options (transformers' `FSDPOption`)."""


def _inline_deepspeed(
    deepspeed: dict,
    flags: list[str],
    said: list[str],
    trainer: dict,
    steps_name: str,
    own: dict[str, str],
    line: frozenset[str],
) -> list[str]:
    """The flags of a DeepSpeed config given inline as the Trainer's `deepspeed` argument that
    the Trainer's own `flags` (of its arguments `trainer`) do not set already (its "auto" values
    are the Trainer's); its keys without an equivalent go to `said`. ConfigError for a value the
    Trainer fills unlike its own, which the Trainer refuses ("mismatch"). Its scheduler section
    replaces the Trainer's lr_scheduler_type (the Trainer then builds none): the decay's flags of
    `flags` give way to its own. `steps_name`: what the Trainer's max_steps is called; `own`:
    the Trainer's own values where its flags' differ (its warmup before a cut to --max-steps);
    `line`: the command line's flags, which set the Trainer's value and DeepSpeed's alike (not
    compared: --weight-decay 0.1 on the line was refused beside the file's two)."""
    lr = float(dict(_pairs(flags)).get("--lr", 5e-5))  # a cosine's floor: a ratio of it
    try:
        more, left, _auto = deepspeed_equivalents(deepspeed, lr=lr)
    except ConfigError as exc:  # a value where DeepSpeed takes a section
        said.append(f"deepspeed: {exc}")
        return []
    scheduler = deepspeed.get("scheduler")
    if isinstance(scheduler, dict) and scheduler.get("type"):  # (WarmupLR: a constant lr)
        replaced: tuple[str, ...] = DECAY_FLAGS
        params = scheduler.get("params")
        if not isinstance(params, dict) or "warmup_num_steps" not in params:  # DeepSpeed's
            replaced += ("--warmup-steps ",)  # 1000 (the Trainer fills the key given alone)
        flags[:] = [f for f in flags if not f.startswith(replaced)]
        said.append(
            f"deepspeed's scheduler {scheduler['type']} replaces the Trainer's "
            f"lr_scheduler_type, as the Trainer lets it"
        )
    ours = dict(_pairs(flags))
    warmup, steps = dict(_pairs(more)).get("--warmup-steps"), ours.get("--max-steps")
    said_so = warmup is not None and _alike(warmup, own["--warmup-steps"])  # by the Trainer's
    if warmup and steps and float(warmup) > float(steps):  # DeepSpeed's 1000 over a shorter run
        more = [f"--warmup-steps {steps}" if f == f"--warmup-steps {warmup}" else f for f in more]
        if not said_so and "--warmup-steps" not in line:  # (the Trainer's own warmup of these
            # steps said it: it was twice; the line's own replaces it: it was said beside it)
            said.append(
                f"deepspeed's scheduler warms up over {warmup} steps, more than "
                f"{steps_name} {steps}, never reaching its peak lr (megapar's warmup ends "
                f"within --max-steps: --warmup-steps {steps})"
            )
    elif warmup and not steps and float(warmup) >= DEFAULT_MAX_STEPS and not said_so:
        said.append(  # (--warmup-steps 1000 was refused next at the default --max-steps 300)
            f"deepspeed's scheduler warms up over {warmup} steps: the --max-steps you choose "
            f"must be more (megapar-train's default is {DEFAULT_MAX_STEPS}), or give a shorter "
            f"--warmup-steps"
        )
    compared = {k: v for k, v in {**ours, **own}.items() if k not in line}
    unlike: list[ConfigError] = []  # every value unlike the Trainer's, in one line (a run
    for name, value in _pairs(more):  # each was a chain of refusals; a re-test)
        key = TRAINER_FILLED.get(name)
        given = _at(deepspeed, key) if key is not None else None
        if key is None or given is None or given == "auto" or name not in compared:
            continue  # (a key it leaves out is DeepSpeed's default, not compared)
        # the file's own value (its lr was translated at the Trainer's, and so never compared)
        if not _alike(str(given), compared[name]):
            shown = value if _alike(str(given), value) else _shown(given)
            unlike.append(_mismatch(key, given, f"{name} {shown}", f"{name} {compared[name]}"))
    steps = deepspeed.get("gradient_accumulation_steps")
    theirs = trainer.get("gradient_accumulation_steps", 1)
    if steps not in (None, "auto") and not _alike(str(steps), str(theirs)):
        unlike.append(
            _mismatch(
                "gradient_accumulation_steps", steps, "", f"gradient_accumulation_steps {theirs}"
            )
        )
    for key, filled in _trainer_filled_others(trainer, compared).items():
        given = _at(deepspeed, key)
        if given is None or given == "auto" or filled is None:
            continue
        value = filled[1]
        same = bool(given) == value if isinstance(value, bool) else _alike(str(given), value)
        if not same:
            unlike.append(_mismatch(key, given, "", filled[0]))
    batch = deepspeed.get("train_batch_size")  # the Trainer's: per device x accumulation x world
    per = _as_int(trainer.get("per_device_train_batch_size", 8)) * _as_int(theirs)
    if batch not in (None, "auto") and per > 0 and (not isinstance(batch, int) or batch % per):
        unlike.append(
            _mismatch(
                "train_batch_size",
                batch,
                "",
                f"per_device_train_batch_size x "
                f"gradient_accumulation_steps = {per} times the number of processes",
            )
        )
    if unlike:
        raise ConfigError("; and ".join(str(exc) for exc in unlike))
    if batch not in (None, "auto") and per > 0:
        said.append(
            f"deepspeed's train_batch_size {batch}: the Trainer's {per} per process on "
            f"{counted(batch // per, 'process', 'processes')}, --global-batch-size {batch} at "
            f"--dp {batch // per}"
        )
        more = [flag for flag in more if not flag.startswith("--global-batch-size ")]
        flags[:] = [flag for flag in flags if not flag.startswith("--global-batch-size ")]
    said += [f"deepspeed's {key}: no equivalent" for key in left]
    return [flag for flag in more if flag.split()[0] not in ours]


def _trainer_filled_others(trainer: dict, ours: dict[str, str]) -> dict[str, Any]:
    """The DeepSpeed keys the Trainer fills from arguments that `TRAINER_FILLED` does not pair by
    flag: {key: (the Trainer's own as a refusal names it, its value)}, None where the Trainer's
    value is not known here."""
    lr, warmup, steps = (ours.get(f) for f in ("--lr", "--warmup-steps", "--max-steps"))
    return {
        "bf16.enabled": (f"bf16 {bool(trainer.get('bf16'))}", bool(trainer.get("bf16"))),
        "fp16.enabled": (f"fp16 {bool(trainer.get('fp16'))}", bool(trainer.get("fp16"))),
        "scheduler.params.warmup_max_lr": (f"--lr {lr}", lr) if lr else None,
        "scheduler.params.warmup_min_lr": ("warmup min lr 0", "0"),
        "scheduler.params.warmup_num_steps": (f"--warmup-steps {warmup}", warmup)
        if warmup
        else None,
        "scheduler.params.total_num_steps": (f"--max-steps {steps}", steps) if steps else None,
    }


def _as_int(value: Any) -> int:
    """A Trainer argument as a whole number; 0 where it is none."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _pairs(flags: list[str]) -> list[tuple[str, str]]:
    """The (flag, value) pairs of translated `flags` ("--adam-beta1 0.9 --adam-beta2 0.95" is
    two); a switch, or a value of several words, is left out."""
    tokens = [t for f in flags for t in f.split()]
    return [
        (t, tokens[i + 1])
        for i, t in enumerate(tokens[:-1])
        if t.startswith("--")
        and not tokens[i + 1].startswith(("--", "("))
        and (i + 2 == len(tokens) or tokens[i + 2].startswith("--"))
    ]


def _shown(value: Any) -> str:
    """A file's value as a flag's: a float as %g (3e-4 is 0.0003)."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def _mismatch(key: str, given: Any, flag: str, own: str) -> ConfigError:
    """The refusal of an inline deepspeed value unlike the Trainer's own, as it refuses it."""
    return ConfigError(
        f"deepspeed's {key} {given!r}{f' ({flag})' if flag else ''} differs from the Trainer's "
        f'own {own}, which the Trainer refuses: set them alike, or the deepspeed one to "auto"'
    )


DECAY_FLAGS = ("--lr-decay ", "--lr-wsd-", "--min-lr ")
"""The flags of a learning rate's decay after warmup (its shape and floor)."""


TRAINER_FILLED = {
    "--micro-batch-size": "train_micro_batch_size_per_gpu",
    "--clip-grad": "gradient_clipping",
    "--lr": "optimizer.params.lr",
    "--weight-decay": "optimizer.params.weight_decay",
    "--adam-eps": "optimizer.params.eps",
    "--adam-beta1": "optimizer.params.betas.0",
    "--adam-beta2": "optimizer.params.betas.1",
}
"""The DeepSpeed keys the Trainer fills from its own arguments (its "auto") and whose value,
given, must equal its own, by megapar-train's flag."""


def _at(data: dict, key: str) -> Any:
    """The value of dotted `key` in `data` (nested tables), None where it is not there."""
    for part in key.split("."):
        if isinstance(data, list) and part.isdigit() and int(part) < len(data):
            data = data[int(part)]  # betas.0
        elif isinstance(data, dict) and part in data:
            data = data[part]
        else:
            return None
    return data


def _alike(a: str, b: str) -> bool:
    """Whether two flag values are the same ("0.5" and "5e-01" are)."""
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def trainer_arguments(
    data: dict,
    path: str,
    refused: Refused | None = None,
    command_line: dict | None = None,
    file_data: dict | None = None,
) -> str:
    """Why `path`, the Trainer's arguments, is not read, with its settings as flags, each the
    command line gives as it gives it (`command_line_wins`; `file_data`: the file's own
    arguments, `data` before the line's values stood in them, whose flags its notes name), or
    the first of them whose value megapar-train refuses (`refused`)."""
    if switched_on(data, "bf16") and switched_on(data, "fp16"):
        return f"{path}: bf16 and fp16 are both true, which the Trainer refuses: set one"
    try:
        flags, said = trainer_flags(data, command_line)
    except ConfigError as exc:  # its inline deepspeed config unlike its own arguments
        return f"{path}: {exc}"
    dp = {k: v for k, v in (command_line or {}).items() if k == "--dp"}  # at the line's dp
    try:
        own = trainer_flags(file_data, dp)[0] if file_data is not None else None
    except ConfigError:  # (unlike its inline deepspeed config alone: the notes name `data`'s)
        own = None
    noted = frozenset({"--lr", "--warmup-steps", *TRAINER_KEYS})  # (at_the_line's, its own)
    batch = {
        "--global-batch-size": batch_words(
            file_data if file_data is not None else data, TRAINER_BATCH, command_line
        )
    }
    flags, notes = command_line_wins(flags, command_line, own, noted, batch)
    said += notes
    what = (
        f"{path} is a Hugging Face Trainer's arguments (TrainingArguments), which megapar-train "
        f"does not read"
    )
    if line := refused_value(what, flags, refused, data):
        return line
    return (  # (the parenthesis is the flags', not the last note's; a re-test)
        f"{what}: give its settings as megapar-train flags: {' '.join(flags)} (the Trainer's "
        f"other arguments have no megapar-train flag, or are its defaults)"
        + "".join(f"; {sentence}" for sentence in said)
    )


ACCELERATE_KEYS = frozenset({"compute_environment", "distributed_type"})
"""Keys every `accelerate config` file holds: a `--config` file with both is one (or with
`distributed_type` alone, of accelerate's values: a file written by hand)."""

ACCELERATE_TYPES = frozenset(
    {
        "NO",
        "MULTI_GPU",
        "MULTI_CPU",
        "MULTI_NPU",
        "MULTI_XPU",
        "FSDP",
        "DEEPSPEED",
        "MEGATRON_LM",
        "XLA",
        "TPU",
    }
)
"""accelerate's `distributed_type` values."""


def is_accelerate_config(data: dict) -> bool:
    """Whether a `--config` file's settings `data` are an accelerate config's."""
    return ACCELERATE_KEYS <= set(data) or str(data.get("distributed_type")) in ACCELERATE_TYPES


ACCELERATE_STRATEGIES = {
    1: "full_shard",
    2: "shard_grad_op",
    3: "no_shard",
    4: "hybrid_shard",
    5: "hybrid_shard_zero2",
}
"""Older `accelerate config` files' `fsdp_sharding_strategy` numbers, by the names they stand for
(newer files give the name, or FSDP2's `fsdp_reshard_after_forward` true / false)."""


def accelerate_config(
    data: dict, path: str, refused: Refused | None = None, command_line: dict | None = None
) -> str:
    """Why `path`, an accelerate config, is not read, with what megapar-train takes instead,
    each flag the command line gives as it gives it (`command_line_wins`), or the first of its
    flags whose value megapar-train refuses (`refused`)."""
    processes = data.get("num_processes") or 1
    kind = str(data.get("distributed_type", "NO"))

    def batch_of(flags: list[str]) -> tuple[int | None, int | None]:
        """The (micro-batch, dp) of the global batch: the command line's, dp else the file's
        processes' (`flags`' --dp)."""
        dp = line_whole(command_line, "--dp") or _as_int(dict(_pairs(flags)).get("--dp"))
        return line_whole(command_line, "--micro-batch-size"), dp or None

    flags = [f"--dp {processes}"] if isinstance(processes, int) and processes > 1 else []
    said: list[str] = []
    file_settings = False  # a DeepSpeed plugin's own file holds the precision
    if kind == "FSDP":
        given = data.get("fsdp_config")
        config = (
            {k.removeprefix("fsdp_"): v for k, v in given.items()}
            if isinstance(given, dict)
            else {}
        )
        strategy = next(
            (
                config[key]
                for key in ("reshard_after_forward", "sharding_strategy")
                if config.get(key) is not None
            ),
            True,
        )
        if isinstance(strategy, str) and strategy.strip().isdigit():  # "2", as accelerate reads
            strategy = int(strategy)
        if isinstance(strategy, (bool, int)):  # (True: 1, full_shard; False: 0, none of them)
            strategy = ACCELERATE_STRATEGIES.get(strategy, strategy)
        more, said = _fsdp(
            True,
            {
                "reshard_after_forward": strategy,
                "cpu_offload": config.get("offload_params", False),
            },
        )
        flags += more
        if config.get("activation_checkpointing") in (True, "true", "True"):
            flags.append("--recompute full")
    elif kind == "DEEPSPEED":
        deepspeed = data.get("deepspeed_config")
        deepspeed = deepspeed if isinstance(deepspeed, dict) else {}
        stage = deepspeed.get("zero_stage")
        if isinstance(stage, str) and stage.strip().isdigit():  # "3", as accelerate reads it
            stage = int(stage)
        elif isinstance(stage, float) and stage.is_integer():  # 2.0
            stage = int(stage)
        given_file = deepspeed.get("deepspeed_config_file")
        if isinstance(given_file, str) and given_file:  # accelerate then reads none of its own
            said.append(
                f"deepspeed_config_file {given_file}: give that file to --config for its "
                "settings as megapar-train flags (accelerate takes the precision, stage, offload, "
                "clipping and accumulation from it, not from this config)"
            )
            file_settings = True
        else:
            # a stage given is its flag (one megapar-train refuses is named, `refused`)
            flags.append(f"--zero {stage}" if stage is not None else "--zero 0, 1, 2 or 3")
            flags += _accelerate_deepspeed(
                deepspeed, stage, data.get("mixed_precision"), said, batch_of(flags)
            )
    elif kind == "MEGATRON_LM":
        megatron = data.get("megatron_lm_config")
        megatron = megatron if isinstance(megatron, dict) else {}
        model_parallel = 1
        for key, flag in (("tp_degree", "--tp"), ("pp_degree", "--pp")):
            degree = megatron.get(f"megatron_lm_{key}")
            if isinstance(degree, int) and not isinstance(degree, bool) and degree > 1:
                flags.append(f"{flag} {degree}")
                model_parallel *= degree
        if model_parallel > 1 and isinstance(processes, int):  # dp: the processes over tp x pp
            flags = [f for f in flags if not f.startswith("--dp ")]
            if processes % model_parallel == 0 and processes > model_parallel:
                flags.insert(0, f"--dp {processes // model_parallel}")
            elif processes % model_parallel:
                said.append(
                    f"num_processes {processes} is no multiple of tp x pp = {model_parallel}, "
                    "which Megatron-LM refuses: the processes are tp x pp x dp"
                )
        if megatron.get("megatron_lm_sequence_parallelism") in (True, "true", "True"):
            flags.append("--sequence-parallel")
        if megatron.get("megatron_lm_recompute_activations") in (True, "true", "True"):
            flags.append("--recompute selective")
        if megatron.get("megatron_lm_use_distributed_optimizer") in (True, "true", "True"):
            flags.append("--zero 1")  # Megatron-LM's distributed optimizer
        flags += _clipping_and_steps(
            megatron,
            "megatron_lm_gradient_clipping",
            "megatron_lm_num_micro_batches",
            batch_of(flags),
        )
    dynamo = data.get("dynamo_config")
    backend = (dynamo if isinstance(dynamo, dict) else {}).get(
        "dynamo_backend", data.get("dynamo_backend", "NO")
    )
    if str(backend).upper() not in ("NO", "NONE", "FALSE"):
        flags.append("--compile")  # megapar compiles each block with inductor
    precision = None if file_settings else data.get("mixed_precision")
    if precision in ("bf16", "fp16"):
        flags.append(f"--precision {precision}")
    elif precision == "fp8":
        flags.append("--fp8 tensorwise")
    machines = data.get("num_machines") or 1
    nodes = (
        "; on several machines run megapar-train under torchrun or launch/slurm.sbatch "
        "(docs/guides/gpus.md)"
        if isinstance(machines, int) and machines > 1
        else ""
    )
    what = f"{path} is an accelerate config, which megapar-train does not read"
    flags, notes = command_line_wins(flags, command_line)
    said += notes
    if line := refused_value(what, flags, refused, data):
        return line
    return (
        f"{what}: megapar-train starts its tp x cp x pp x dp workers itself (no accelerate "
        f"launch); give "
        + (" ".join(flags) if flags else "its settings as megapar-train flags")
        + f" (the processes are tp x cp x pp x dp){nodes}"
        + "".join(f"; {sentence}" for sentence in said)
    )
