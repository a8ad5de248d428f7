"""A DeepSpeed config (ds_config.json) read as megapar-train's flags: what a DeepSpeed user's
`--config ds.json` is told to give instead (megapar-train does not read DeepSpeed's format)."""

from __future__ import annotations

import json
import math
import os
import shlex
from typing import Any

from megapar.models.config import ConfigError
from megapar.training.line_over_file import named_at_the_line

DEEPSPEED_KEYS = frozenset(
    {"train_batch_size", "train_micro_batch_size_per_gpu", "zero_optimization", "fp16", "bf16"}
)
"""Keys that make a `--config` file a DeepSpeed config (ds_config.json)."""

ZERO_KEYS_READ = frozenset(
    {
        "stage",
        "offload_optimizer",
        "offload_param",
        "stage3_param_persistence_threshold",
        "reduce_bucket_size",
        "reduce_scatter",  # megapar's ZeRO 2 / 3 always reduce-scatter
        "contiguous_gradients",  # megapar's gradients always live in one buffer
        "overlap_comm",  # megapar's bucketed reductions always overlap the backward
    }
)
"""zero_optimization's keys with a megapar equivalent, or whose behaviour megapar always has;
the others (stage3_prefetch_bucket_size, sub_group_size, ...) are named as having none."""


def is_deepspeed_config(data: dict) -> bool:
    """Whether a `--config` file's top-level settings (`data`) are a DeepSpeed config's: one of
    `DEEPSPEED_KEYS` (fp16 / bf16 as sections: ``bf16: true`` alone is another tool's flag,
    megapar's --precision bf16), or an optimizer / scheduler section as DeepSpeed writes it,
    ``{"type": ..., "params": {...}}`` (torchtitan's [optimizer] has name, lr, eps instead)."""
    if any(
        k in data and (k not in ("fp16", "bf16") or isinstance(data[k], dict))
        for k in DEEPSPEED_KEYS
    ):
        return True
    return any(
        isinstance(data.get(k), dict) and {"type", "params"} & set(data[k])
        for k in ("optimizer", "scheduler")
    )


OPTIMIZER_PARAMS_READ = frozenset({"lr", "eps", "weight_decay", "betas", "torch_adam"})
"""An optimizer section's params with a megapar equivalent (torch_adam: which Adam kernel, the
same numbers); the others are named as having none."""


SECTION_EXAMPLES = (
    ("zero_optimization.offload", '{"device": "cpu"}'),
    ("zero_optimization", '{"stage": 2}'),
    ("fp16", '{"enabled": true}'),
    ("bf16", '{"enabled": true}'),
    ("scheduler.params", '{"warmup_num_steps": 100}'),
    ("scheduler", '{"type": "WarmupLR", "params": {...}}'),
    ("optimizer.params", '{"lr": 0.001}'),
    ("", '{"type": "AdamW", "params": {"lr": 0.001}}'),
)
"""What a section of a DeepSpeed config looks like, by where it goes (the first that matches)."""


def _section(value: Any, where: str) -> dict:
    """`value`, a section of the config at `where` (``zero_optimization.offload_optimizer``),
    or a ConfigError naming what DeepSpeed takes there (a value given where a section goes made
    a traceback)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(
            f"{where} is {json.dumps(value)}: DeepSpeed takes a section there ({{...}}, e.g. "
            + next(example for start, example in SECTION_EXAMPLES if where.startswith(start))
            + ")"
        )
    return value


PEAK_SCHEDULERS = ("WarmupLR", "WarmupDecayLR")
"""DeepSpeed's schedulers that train at their warmup_max_lr (default 1e-3) whatever the
optimizer's lr (WarmupCosineLR scales the optimizer's by ratios)."""

DEEPSPEED_DECAYS = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}
"""DeepSpeed's warmup schedulers as megapar's --lr-decay (what follows their warmup)."""


def _flag_value(value: Any) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1000:
        return str(int(value))  # 1e5, not 100000.0
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def global_batch_flag(factors: list, dp: int | None) -> str:
    """--global-batch-size for another tool's per-GPU batch `factors` (the micro-batch, the
    accumulation steps): their product times the given `dp`, or, where a factor is no whole
    number or dp is not given, the product said as one (``(8 x dp)``)."""
    whole = all(isinstance(f, int) and not isinstance(f, bool) for f in factors)
    if whole and dp is not None:
        return f"--global-batch-size {math.prod(factors) * dp}"
    shown = str(math.prod(factors)) if whole else " x ".join(map(_flag_value, factors))
    return f"--global-batch-size ({shown} x dp)"


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _offload(zero: dict, part: str) -> str | None:
    """zero_optimization's `part` (offload_optimizer / offload_param) device where it offloads
    (cpu, nvme), else None."""
    section = zero.get(part)
    device = section.get("device") if isinstance(section, dict) else None
    return device if device in ("cpu", "nvme") else None


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
"""DeepSpeed's batch keys: train_batch_size = micro-batch x accumulation steps x GPUs."""

DEEPSPEED_BATCH = (("train_micro_batch_size_per_gpu", 1), ("gradient_accumulation_steps", 1))
"""DeepSpeed's per-GPU batch keys and their defaults (x the GPUs: train_batch_size)."""


def _implied_dp(data: dict) -> int | None:
    """The data-parallel size DeepSpeed's three batch keys, all given, imply (train_batch_size
    over micro-batch x accumulation steps); None where one is missing."""
    if not all(_whole(data.get(k)) for k in BATCH_KEYS):
        return None
    train, micro, steps = (data[k] for k in BATCH_KEYS)
    return train // (micro * steps)


def _check_batch(data: dict, dp: int | None) -> None:
    """ConfigError where DeepSpeed would refuse the config's batch keys: train_batch_size must be
    train_micro_batch_size_per_gpu x gradient_accumulation_steps x the data-parallel GPUs (the
    given `dp` where there is one) for whole numbers of each."""
    keys = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    train = data.get("train_batch_size")
    factors = {k: data[k] for k in keys if _whole(data.get(k))}
    if _whole(train) and not factors and dp is not None and train % dp:  # type: ignore[operator]
        raise ConfigError(
            f"train_batch_size {train} is no multiple of --dp {dp}, which DeepSpeed refuses "
            "(train_batch_size = micro-batch x accumulation steps x GPUs): correct one of them"
        )
    if not _whole(train) or not factors:
        return
    per_gpu = math.prod(factors.values())
    named = " x ".join(f"{k} {v}" for k, v in factors.items())
    if train % per_gpu:
        raise ConfigError(
            f"train_batch_size {train} is no multiple of {named}, which DeepSpeed refuses "
            "(train_batch_size = micro-batch x accumulation steps x GPUs): correct one of them"
        )
    if dp is None:
        return
    whole = len(factors) == 2
    if train != per_gpu * dp if whole else train % (per_gpu * dp):
        raise ConfigError(
            f"train_batch_size {train} is {'not' if whole else 'no multiple of'} {named} x "
            f"--dp {dp} = {per_gpu * dp}, which DeepSpeed refuses: correct one of them"
        )


DYNAMIC_SCALER_KEYS = (
    "initial_scale_power",
    "loss_scale_window",
    "min_loss_scale",
    "hysteresis",
    "consecutive_hysteresis",
)
"""An fp16 section's keys of DeepSpeed's dynamic loss scaler (unused with a static scale)."""


def fp16_scaler(fp16: dict) -> tuple[list[str], list[str]]:
    """An enabled fp16 section's loss-scaler keys as megapar-train's flags (DeepSpeed's
    defaults where a key is absent and megapar's default differs: hysteresis 2; a static
    loss_scale > 0, which DeepSpeed takes instead of the dynamic keys, alone), and the keys
    with no equivalent."""
    flags: list[str] = []
    left: list[str] = []
    if fp16.get("loss_scale", 0) not in (0, 0.0, "0"):
        dynamic = [k for k in DYNAMIC_SCALER_KEYS if k in fp16]
        if dynamic:  # DeepSpeed ignores them beside a static scale, as megapar-train would
            left.append(f"fp16.{', fp16.'.join(dynamic)} (unused with a static loss_scale)")
        return [f"--loss-scale {_flag_value(fp16['loss_scale'])}"], left
    if "initial_scale_power" in fp16:
        flags.append(f"--initial-loss-scale {_flag_value(2 ** int(fp16['initial_scale_power']))}")
    for name, flag in (
        ("loss_scale_window", "--loss-scale-window"),
        ("min_loss_scale", "--min-loss-scale"),
    ):
        if name in fp16:
            flags.append(f"{flag} {_flag_value(fp16[name])}")
    flags.append(f"--hysteresis {_flag_value(fp16.get('hysteresis', 2))}")
    if fp16.get("consecutive_hysteresis") in (True, "true", 1):
        left.append(
            "fp16.consecutive_hysteresis (megapar's hysteresis is restored when the scale "
            "grows, not after each clean step)"
        )
    return flags, left


def deepspeed_equivalents(
    data: dict,
    dp: int | None = None,
    lr: float | None = None,
    default_lr: float | None = None,
    file_batch: dict | None = None,
    command_line: dict | None = None,
) -> tuple[list[str], list[str], list[str]]:
    """A DeepSpeed config's settings as megapar-train flags, the keys that have none, and the
    keys whose value is "auto" (the Hugging Face Trainer's, filled from its arguments). A
    global batch from the micro-batch and the accumulation steps is a number at the command
    line's --dp `dp`, else said as a product with dp. `lr`: the learning rate the run trains at
    over the file's (the command line's --lr, or the Trainer's): the --lr said, and the
    WarmupCosineLR floor its ratio of it; None: the file's, else megapar-train's `default_lr`,
    said beside the floor it sets (neither: the floor is said as a ratio of --lr, no flag).
    `file_batch`: the file's own settings where the command line's stand in `data`'s batch keys:
    DeepSpeed's checks of its batch, and the dp its batch keys imply, are the file's (the line's
    --micro-batch-size 2 made a file's 8 GPUs 16). `command_line`: the command line's flags
    (`command_line_wins`): its --max-steps stands in total_num_steps and is called the line's,
    and its --warmup-steps is the warmup, nothing of the file's cut or said beside it."""
    total_name = named_at_the_line(command_line, "--max-steps", "total_num_steps")
    line_warmup = (command_line or {}).get("--warmup-steps")
    flags: list[str] = []
    left: list[str] = []
    auto: list[str] = []

    def without_auto(tree: dict, where: str) -> dict:
        """`tree` less the Hugging Face Trainer's "auto" values (it fills them from its own
        arguments), whose dotted keys go to `auto`."""
        kept = {}
        for key, value in tree.items():
            if value == "auto":
                auto.append(where + key)
            else:
                kept[key] = (
                    without_auto(value, f"{where}{key}.") if isinstance(value, dict) else value
                )
        return kept

    data = without_auto(data, "")

    def on(section: Any) -> bool:
        return isinstance(section, dict) and section.get("enabled") in (True, "true", 1)

    if all(isinstance(data.get(k), dict) and on(data[k]) for k in ("fp16", "bf16")):
        raise ConfigError("fp16 and bf16 are both enabled, which DeepSpeed refuses: enable one")
    own = data if file_batch is None else file_batch
    moved = any(own.get(k) != data.get(k) for k in BATCH_KEYS)  # by the line: its --dp is
    _check_batch(own, None if moved else dp)  # then checked with the line's batch, by megapar
    implied = _implied_dp(own)
    if dp is None and implied is not None and implied > 1:  # the three batch keys fix dp
        flags.append(f"--dp {implied}")
    for key, value in data.items():
        if key == "train_batch_size":
            flags.append(f"--global-batch-size {_flag_value(value)}")
        elif key == "train_micro_batch_size_per_gpu":
            flags.append(f"--micro-batch-size {_flag_value(value)}")
            batch = ("train_batch_size", "gradient_accumulation_steps")
            if not any(k in data or k in auto for k in batch):
                # DeepSpeed accumulates nothing then; megapar-train's default batch is 16
                flags.append(global_batch_flag([value], dp))
        elif key == "gradient_accumulation_steps" and "train_batch_size" not in data:
            micro = data.get("train_micro_batch_size_per_gpu", "micro-batch")
            flags.append(global_batch_flag([micro, value], dp))
        elif key == "gradient_accumulation_steps" and (
            "train_micro_batch_size_per_gpu" in data or "train_micro_batch_size_per_gpu" in auto
        ):
            continue  # train_batch_size says it, with the micro-batch (or the Trainer's)
        elif key == "gradient_accumulation_steps":  # the micro-batch DeepSpeed derives
            per_rank = _whole(data["train_batch_size"]) and _whole(value)
            micro = data["train_batch_size"] // value if per_rank else None
            if micro is not None and dp is not None and micro % dp == 0:
                flags.append(f"--micro-batch-size {micro // dp}")
            elif micro is not None and dp is None:
                flags.append(f"--micro-batch-size ({micro} / dp)")
        elif key == "gradient_clipping":
            flags.append(f"--clip-grad {_flag_value(value)}")
        elif key == "steps_per_print":
            flags.append(f"--log-interval {_flag_value(value)}")
        elif key in ("fp16", "bf16") and isinstance(value, dict):
            if on(value):
                flags.append(f"--precision {key}")
            scaler = "loss_scale" in value or any(k in value for k in DYNAMIC_SCALER_KEYS)
            if key == "fp16" and on(value):
                fp16_flags, fp16_left = fp16_scaler(value)
                flags += fp16_flags
                left += fp16_left
            elif key == "fp16" and "fp16.enabled" in auto and scaler:  # the Trainer's --fp16
                fp16_flags, fp16_left = fp16_scaler(value)
                auto[auto.index("fp16.enabled")] = (
                    f"fp16.enabled (where the Trainer runs fp16: --precision fp16 "
                    f"{' '.join(fp16_flags)})"
                )
                left += fp16_left
        elif key in ("zero_optimization", "fp16", "bf16", "optimizer", "scheduler") and not (
            isinstance(value, dict)
        ):
            _section(value, key)  # a value where DeepSpeed takes a section: one line
        elif key == "zero_optimization":
            stage = value.get("stage", 0)
            if isinstance(stage, float) and stage.is_integer():
                stage = int(stage)  # 3.0
            if "zero_optimization.stage" not in auto:
                flags.append(f"--zero {_flag_value(stage)}")
            for part, flag in (
                ("offload_optimizer", "--offload-optimizer"),
                ("offload_param", "--offload-params"),
            ):
                device = _section(value.get(part), f"zero_optimization.{part}").get(
                    "device", "none"
                )
                alone = part == "offload_param" and _offload(value, "offload_optimizer") is None
                if device in ("cpu", "nvme") and part == "offload_param" and stage not in (3, "3"):
                    left.append(
                        "zero_optimization.offload_param (DeepSpeed offloads parameters at "
                        "stage 3 only)"
                    )
                elif device == "cpu" and alone:
                    left.append(
                        "zero_optimization.offload_param without offload_optimizer (megapar "
                        "offloads the parameters with the optimizer state: --offload-optimizer "
                        "--offload-params)"
                    )
                elif device == "cpu":
                    flags.append(flag)
                    ratio = _section(value.get(part), f"zero_optimization.{part}").get("ratio", 1)
                    if part == "offload_optimizer" and ratio not in (1, 1.0):
                        left.append(
                            f"zero_optimization.offload_optimizer.ratio {_flag_value(ratio)} "
                            "(megapar offloads all of the optimizer state)"
                        )
                elif device not in ("none", None):
                    left.append(f"zero_optimization.{part}.device {device} (the host only)")
            filled = "zero_optimization.stage3_param_persistence_threshold" in auto
            if "stage3_param_persistence_threshold" in value or (stage in (3, "3") and not filled):
                # DeepSpeed's default is 1e5 elements, megapar-train's 0
                threshold = _flag_value(value.get("stage3_param_persistence_threshold", 100000))
                flags.append(f"--zero3-persistence-threshold {threshold}")
            if "reduce_bucket_size" in value:  # elements; megapar's gradients are fp32
                elements = value["reduce_bucket_size"]
                whole = isinstance(elements, (int, float)) and float(elements).is_integer()
                if isinstance(elements, bool) or not whole or elements < 1:  # (5e8 is whole)
                    raise ConfigError(
                        f"zero_optimization.reduce_bucket_size {json.dumps(elements)} is "
                        f"invalid: DeepSpeed's bucket is a whole number of elements > 0 "
                        f"(megapar's --grad-bucket-mb, 4 bytes each)"
                    )
                mb = _flag_value(float(f"{elements * 4 / 2**20:.7g}"))  # 100 elements: not 0.0
                flags.append(f"--grad-bucket-mb {mb}")
            left += [
                f"zero_optimization.{part}"
                for part in value
                if part not in ZERO_KEYS_READ and value[part] not in (False, None)
            ]
        elif key == "optimizer" and isinstance(value, dict):
            kind = str(value.get("type", "")).lower()
            if kind in ("adam", "adamw", "lamb", "sgd"):
                flags.append(f"--optimizer {'adamw' if kind == 'adam' else kind}")
            elif "type" not in value and "optimizer.type" not in auto:
                left.append("optimizer.type (none given, which DeepSpeed refuses)")
            elif "type" in value:
                left.append(f"optimizer.type {value.get('type')}")
            params = _section(value.get("params"), "optimizer.params")
            # WarmupLR / WarmupDecayLR train at their warmup_max_lr (DeepSpeed's default 1e-3),
            # not the optimizer's lr: the scheduler's --lr, said once
            scheduler = _section(data.get("scheduler"), "scheduler")
            scheduler_lr = scheduler.get("type") in PEAK_SCHEDULERS
            for name, flag in (("lr", "--lr"), ("eps", "--adam-eps")):
                if name in params and not (name == "lr" and scheduler_lr):
                    given = lr if name == "lr" and lr is not None else params[name]
                    flags.append(f"{flag} {_flag_value(given)}")  # --lr: the line's
            if "lr" in value:
                left.append("optimizer.lr (DeepSpeed reads the lr from optimizer.params)")
            # DeepSpeed's optimizers decay nothing unless told (megapar-train's default is 0.1)
            if "optimizer.params.weight_decay" not in auto:
                flags.append(f"--weight-decay {_flag_value(params.get('weight_decay', 0))}")
            betas = params.get("betas")
            if betas is not None and kind == "sgd":  # torch's SGD takes no betas
                left.append(
                    f"optimizer.params.betas {json.dumps(betas)} (SGD has none: DeepSpeed's "
                    "torch.optim.SGD refuses them)"
                )
            elif isinstance(betas, list) and len(betas) == 2:
                flags.append(f"--adam-beta1 {betas[0]} --adam-beta2 {betas[1]}")
            elif betas is not None:
                left.append(f"optimizer.params.betas {json.dumps(betas)} (two: beta1, beta2)")
            elif kind in ("adam", "adamw", "lamb") and "optimizer.params.betas" not in auto:
                flags.append("--adam-beta2 0.999")  # DeepSpeed's (torch's), not megapar's 0.95
            left += _optimizer_params_left(kind, params)
        elif key == "scheduler" and isinstance(value, dict):
            params = _section(value.get("params"), "scheduler.params")
            kind = str(value.get("type", ""))
            decay = DEEPSPEED_DECAYS.get(kind)
            if decay is not None:  # megapar's default, cosine, would decay a WarmupLR's lr
                flags.append(f"--lr-decay {decay}")
            else:
                left.append(f"scheduler.type {kind}")
            # DeepSpeed's defaults: 1000 warmup steps (within total_num_steps), a peak of 1e-3
            # (not where the Trainer fills the key: "auto")
            given_auto = {k.rpartition(".")[2] for k in auto if k.startswith("scheduler.params.")}
            default = 1000 if decay is not None and "warmup_num_steps" not in given_auto else None
            warmup = params.get("warmup_num_steps", default)
            total = params.get("total_num_steps")
            if line_warmup is not None:  # (a cut of the file's was noted as "the file's", and
                warmup = line_warmup.split()[-1]  # its warmup above the line's; a re-test)
            elif isinstance(warmup, (int, float)) and isinstance(total, (int, float)):
                if warmup > total:
                    left.append(
                        f"scheduler.params.warmup_num_steps {_flag_value(warmup)} above "
                        f"{total_name} {_flag_value(total)} (DeepSpeed warms up over all "
                        f"{_flag_value(warmup)}, never reaching its peak lr; megapar's warmup "
                        "ends within --max-steps)"
                    )
                warmup = min(warmup, total)
            needs_total = kind in ("WarmupDecayLR", "WarmupCosineLR")
            if needs_total and total is None and "total_num_steps" not in given_auto:
                left.append(
                    f"scheduler.params.total_num_steps (none given, which DeepSpeed's {kind} "
                    "requires: give --max-steps)"
                )
            start = params.get("warmup_min_lr", 0)
            if kind == "WarmupLR" and start not in (0, 0.0, None):
                left.append(
                    f"scheduler.params.warmup_min_lr {_flag_value(start)} (megapar's warmup "
                    "rises from 0)"
                )
            ratio_start = params.get("warmup_min_ratio", 0)
            if kind == "WarmupCosineLR" and ratio_start not in (0, 0.0, None):
                left.append(
                    f"scheduler.params.warmup_min_ratio {_flag_value(ratio_start)} (megapar's "
                    "warmup rises from 0)"
                )
            if warmup is not None:
                flags.append(f"--warmup-steps {_flag_value(warmup)}")
            if total is not None:
                flags.append(f"--max-steps {_flag_value(total)}")
            if kind in PEAK_SCHEDULERS and "warmup_max_lr" not in given_auto:
                peak_lr = lr if lr is not None else params.get("warmup_max_lr", 0.001)
                flags.append(f"--lr {_flag_value(peak_lr)}")
            if kind == "WarmupDecayLR" and "warmup_min_lr" not in given_auto:  # linearly to it
                flags.append(f"--min-lr {_flag_value(params.get('warmup_min_lr', 0))}")
            elif kind == "WarmupCosineLR":  # its floor: a ratio of the optimizer's lr
                ratio = params.get("cos_min_ratio", 0.0001)
                optimizer = _section(data.get("optimizer"), "optimizer")
                peak = _section(optimizer.get("params"), "optimizer.params").get("lr")
                peak = lr if lr is not None else peak  # the command line's --lr: the run's
                number = (int, float)
                if not isinstance(ratio, number) or isinstance(ratio, bool):
                    left.append(f"scheduler.params.cos_min_ratio {json.dumps(ratio)} (no number)")
                elif isinstance(peak, number) and not isinstance(peak, bool):
                    flags.append(f"--min-lr {float(peak) * ratio:.6g}")
                else:  # (it was '--min-lr (--lr x cos_min_ratio 0.1)', which no shell takes)
                    at = f"--lr x {_flag_value(ratio)}"
                    if default_lr is not None:
                        flags.append(f"--min-lr {default_lr * ratio:.6g}")
                        at = (
                            f"--min-lr {default_lr * ratio:.6g} is at megapar-train's --lr "
                            f"{_flag_value(default_lr)}"
                        )
                    left.append(
                        f"scheduler.params.cos_min_ratio {_flag_value(ratio)} (of the "
                        f"optimizer's lr, which the file does not give: {at})"
                    )
            log = params.get("warmup_type", "log") == "log" and warmup not in (0, None)
            if decay is not None and log and line_warmup is None:  # the line's warmup is the
                # run's (linear, as megapar's): the file's type is not in it (a re-test)
                left.append("scheduler.params.warmup_type log (megapar's warmup is linear)")
        elif key in ("tensorboard", "wandb") and isinstance(value, dict):  # its monitors (a
            if not on(value):  # tensorboard section was a --tensorboard of the dict; a re-test)
                continue  # off: megapar-train's default, reporting nowhere
            where, project = value.get("output_path"), value.get("project")
            if key == "tensorboard" and isinstance(where, str) and where:
                job = value.get("job_name") or "DeepSpeedJobName"  # DeepSpeed's default
                flags.append(f"--tensorboard {shlex.quote(os.path.join(where, str(job)))}")
            elif key == "wandb" and isinstance(project, str) and project:
                flags.append(f"--wandb-project {shlex.quote(project)}")
            else:
                fix = "--tensorboard DIR" if key == "tensorboard" else "--wandb-project NAME"
                left.append(f"{key} (give {fix})")
        elif key == "activation_checkpointing":
            left.append(
                "activation_checkpointing (it tunes the model's own checkpoint calls; "
                "megapar's --recompute full recomputes every block)"
            )
        else:
            left.append(key)
    # DeepSpeed's defaults where megapar-train's differ: no clipping, and without a scheduler
    # section a constant lr from the first step (a config with "auto" values is the Hugging
    # Face Trainer's, which clips and schedules by its own arguments)
    if not auto and "gradient_clipping" not in data:
        flags.append("--clip-grad 0")
    if not auto and "scheduler" not in data:
        flags.append("--lr-decay constant --warmup-steps 0")
    return flags, left, auto


def _optimizer_params_left(kind: str, params: dict) -> list[str]:
    """An optimizer section's params that megapar-train has no flag for, each said with what
    megapar does instead where that differs from DeepSpeed's."""
    left = []
    for name, value in params.items():
        if name in OPTIMIZER_PARAMS_READ:
            continue
        if name == "adam_w_mode" and value in (True, "true", 1):
            continue  # AdamW: megapar's adamw
        if name == "adam_w_mode":
            left.append(
                "optimizer.params.adam_w_mode false (Adam with L2 decay in the gradient; "
                "megapar's adamw decays the weights apart from it)"
            )
        elif name == "momentum" and kind == "sgd":
            if value != 0.9:
                left.append(f"optimizer.params.momentum {value} (megapar's sgd uses 0.9)")
        else:
            left.append(f"optimizer.params.{name} {json.dumps(value)}")
    if kind == "sgd" and "momentum" not in params:  # torch's (DeepSpeed's) SGD: 0
        left.append("optimizer.params.momentum (DeepSpeed's default 0; megapar's sgd uses 0.9)")
    return left
