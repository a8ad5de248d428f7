"""The ranges of megapar-train's numeric settings (`RULES`) and the check of a run's settings
against them (`check_ranges`): read by megapar-train's checks (`megapar.training.validate`),
`megapar.prepare`'s, and the flags another tool's config is translated into
(`megapar.training.config`)."""

from __future__ import annotations

import dataclasses
import math

from megapar.env_seconds import MAX_SECONDS, MIN_SECONDS
from megapar.training.usage import UsageError, flag_of

Rule = tuple[str, str, float, bool] | tuple[str, str, float, bool, tuple[int, str]]
"""A setting's range: (field, kind, lowest allowed, lowest is allowed itself[, (value that turns
it off, meaning)]); kind "int" or "float" (finite)."""

RULES: list[Rule] = [
    ("tp", "int", 1, True),
    ("cp", "int", 1, True),
    ("pp", "int", 1, True),
    ("dp", "int", 1, True),
    ("ep", "int", 1, True),
    ("expert_tensor_parallel_size", "int", 1, True),
    ("seq_len", "int", 1, True),
    ("micro_batch_size", "int", 1, True),
    ("global_batch_size", "int", 1, True),
    ("max_steps", "int", 1, True),
    ("warmup_steps", "int", 0, True),
    ("lr_decay_steps", "int", 1, True, (0, "--max-steps")),
    ("lr_wsd_decay_steps", "int", 1, True, (0, "--lr-wsd-decay-fraction of --max-steps")),
    ("lr_wsd_decay_fraction", "float", 0.0, False),
    ("eval_interval", "int", 0, True),
    ("eval_steps", "int", 1, True),
    ("save_interval", "int", 0, True),
    ("keep_latest_k", "int", 0, True),
    ("log_interval", "int", 1, True),
    ("seed", "int", 0, True),
    ("eod_id", "int", 0, True),
    ("lr", "float", 0.0, False),
    ("min_lr", "float", 0.0, True),
    ("weight_decay", "float", 0.0, True),
    ("clip_grad", "float", 0.0, True),
    ("peak_tflops", "float", 0.0, False),
    ("timeout_s", "float", MIN_SECONDS, True),
    ("nccl_timeout_s", "float", MIN_SECONDS, True),
    ("val_fraction", "float", 0.0, True),
    ("virtual_stages", "int", 1, True),
    ("decoder_first_pipeline_num_layers", "int", 1, True),
    ("decoder_last_pipeline_num_layers", "int", 1, True),
    ("adam_eps", "float", 0.0, False),
    ("grad_bucket_mb", "float", 0.0, False),
    ("adam_beta1", "float", 0.0, True),
    ("adam_beta2", "float", 0.0, True),
    ("muon_momentum", "float", 0.0, True),
    ("powersgd_rank", "int", 1, True),
    ("loss_chunk_tokens", "int", 1, True, (0, "the whole logits at once")),
    ("label_smoothing", "float", 0.0, True),
    ("z_loss", "float", 0.0, True),
    ("moe_aux_loss_coef", "float", 0.0, True),
    ("moe_z_loss_coef", "float", 0.0, True),
    ("moe_capacity_factor", "float", 0.0, False, (0, "dropless")),
    ("moe_bias_update_rate", "float", 0.0, True),
    ("lr_scale_with_batch", "int", 1, True, (0, "off")),
    ("max_nonfinite_steps", "int", 1, True, (0, "never stop")),
    ("loss_scale", "float", 0.0, False, (0, "dynamic")),
    ("initial_loss_scale", "float", 0.0, False),
    ("min_loss_scale", "float", 0.0, False),
    ("loss_scale_window", "int", 1, True),
    ("hysteresis", "int", 1, True),
    ("exit_interval", "int", 1, True, (0, "never")),
    ("record_step", "int", 1, True, (0, "none")),
    ("replay", "int", 1, True, (0, "off")),
    ("exit_duration_mins", "float", 0.0, False, (0, "no limit")),
    ("straggler_factor", "float", 1.0, False, (0, "off")),
    ("world_size", "int", 1, True),
    ("gpus_per_node", "int", 1, True),
    ("gpu_memory_gb", "float", 0.0, False),
]


_MILLISECONDS = "torch counts a wait in whole milliseconds: a shorter one times out at once"

WHY = {"timeout_s": _MILLISECONDS, "nccl_timeout_s": _MILLISECONDS}
"""Why a setting's lowest value is what `RULES` says, where that is not plain."""

BELOW_ONE = {
    "adam_beta1": "",
    "adam_beta2": "",
    "muon_momentum": "",
    "label_smoothing": "",
    "val_fraction": "it is the share of documents held out, ",
}
"""The settings that must also be below 1 (in [0, 1)), with what the refusal says of them."""


HIGHEST = {
    "seed": (
        2**32 - 1,
        "megapar offsets it per rank and multiplies it into PowerSGD's seeds, which must fit "
        "torch's 64 bits",
    ),
}
"""The settings with a highest allowed value, and why."""


def default_of(cfg, name: str):
    """The default of setting `name` of config `cfg` (a dataclass)."""
    return next(f.default for f in dataclasses.fields(cfg) if f.name == name)


def check_ranges(cfg, keyword: str | None = None, defaults: bool = True) -> None:
    """UsageError for the first numeric setting outside its `RULES` range; whole numbers
    from a --config file (32.0) become ints. `keyword`: the function whose keywords the
    settings are (e.g. "megapar.prepare"), named as `name=value` instead of by their flags
    (and without the flag's default, which that function may not share); `defaults=False`:
    without the defaults either (a value of another tool's config, whose defaults differ)."""
    defaults = defaults and keyword is None
    for name, kind, low, inclusive, *off in RULES:
        value = getattr(cfg, name)
        if value is None or (off and value == off[0][0] and not isinstance(value, bool)):
            continue
        bound = f">= {low}" if inclusive else f"> {low}"
        if name in HIGHEST and inclusive:  # its whole range, as a value above it is told
            bound = f"from {low} to {HIGHEST[name][0]:,}"
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
            default = default_of(cfg, name) if defaults else None
            if name in BELOW_ONE:  # its whole range, as a value of 1 or more is told
                _below_one(cfg, name, value, keyword, defaults)
            short = isinstance(value, (int, float)) and math.isfinite(value) and value < low
            said = [WHY[name]] if name in WHY and short else []
            said += [f"the default is {default}"] if default is not None else []
            hint = f" ({'; '.join(said)})" if said else ""
            if off:
                hint = f", or {off[0][0]} for {off[0][1]}" + (
                    " (the default)" if default == off[0][0] else hint
                )
            shown = f"{keyword}: {name}={value!r}" if keyword else f"{flag_of(name)} {value}"
            raise UsageError(f"{shown} is invalid: it must be {what} {bound}{hint}")
    for name in BELOW_ONE:
        value = getattr(cfg, name)
        if value >= 1:
            _below_one(cfg, name, value, keyword, defaults)
    for name, (highest, why) in HIGHEST.items():
        value = getattr(cfg, name)
        if value > highest:
            shown = f"{keyword}: {name}={value!r}" if keyword else f"{flag_of(name)} {value}"
            default = f"; the default is {default_of(cfg, name)}" if defaults else ""
            raise UsageError(
                f"{shown} is invalid: it must be a whole number from 0 to {highest:,} ({why}"
                f"{default})"
            )
    for name in ("timeout_s", "nccl_timeout_s"):
        value = getattr(cfg, name)
        if value <= MAX_SECONDS:
            continue
        shown = f"{keyword}: {name}=" if keyword else f"{flag_of(name)} "
        default = f" (the default is {default_of(cfg, name)})" if defaults else ""
        text = f"{value:.10g}"  # 1e+15, 1000000001: not 1e+09, the bound itself
        raise UsageError(
            f"{shown}{text if float(text) == value else repr(value)} is invalid: at most "
            f"{MAX_SECONDS:g} s (about 31 years; torch's rendezvous store counts its wait in "
            f"nanoseconds and fails at once from about 1e10 s); give a finite wait in "
            f"seconds{default}"
        )


def _below_one(cfg, name: str, value, keyword: str | None, defaults: bool) -> None:
    """UsageError for `BELOW_ONE` setting `name` out of [0, 1), said with its whole range."""
    shown = f"{keyword}: {name}={value!r}" if keyword else f"{flag_of(name)} {value}"
    default = f" (the default is {default_of(cfg, name)})" if defaults else ""
    raise UsageError(f"{shown} is invalid: {BELOW_ONE[name]}it must be in [0, 1){default}")
