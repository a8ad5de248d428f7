"""Flags given that a megapar-train run would not read: `check_unused` refuses them (each would
be ignored without a word), naming the setting each needs, before any worker starts."""

from __future__ import annotations

import os

from megapar.data.blended import data_paths
from megapar.data.inputs import expand_inputs, is_raw_text, reads_key
from megapar.training.usage import UsageError, flag_of, flag_with_value
from megapar.training.validate_sharding import offload_params_problem
from megapar.wording import and_list


def check_unused(cfg, given: set[str]) -> None:
    """UsageError, one line, for the settings in `given` (the user's flags and --config keys, not
    those taken from a checkpoint) that this run would not read, by reason, naming what each
    needs."""
    adam = cfg.optimizer in ("adamw", "lamb", "muon")
    prepared, keyed = _data_kinds(cfg.data)
    # a fix that would be refused next: the dynamic scale's flags beside a static --loss-scale
    # (at fp32 "add --precision fp16" was then refused for them), --lr-wsd-decay-fraction beside
    # --lr-wsd-decay-steps ("add --lr-decay wsd" then refused it)
    dynamic = [
        n
        for n in ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")
        if n in given
    ]
    static = "loss_scale" in given and cfg.loss_scale and dynamic
    fp16_fix = "add --precision fp16" + (
        f" and drop {and_list([flag_of(n) for n in dynamic])} (--loss-scale "
        f"{cfg.loss_scale:g} is static)"
        if static
        else ""
    )
    both_wsd = {"lr_wsd_decay_steps", "lr_wsd_decay_fraction"} <= given and cfg.lr_wsd_decay_steps
    wsd_fix = "add --lr-decay wsd" + (
        " and drop --lr-wsd-decay-fraction (--lr-wsd-decay-steps sets the decay's length)"
        if both_wsd
        else ""
    )
    rules = [
        (
            "save_interval",
            bool(cfg.save) or cfg.dry_run or cfg.save_interval == 0,
            "it is how often checkpoints go into --save, and no --save is given",
            "give --save DIR too",
        ),
        (
            "keep_latest_k",
            bool(cfg.save) or cfg.dry_run or cfg.keep_latest_k == 0,
            "it is how many checkpoints --save keeps, and no --save is given",
            "give --save DIR too",
        ),
        (
            "powersgd_rank",
            cfg.grad_compression == "powersgd",
            f"it is PowerSGD's rank, and --grad-compression is {cfg.grad_compression}",
            "add --grad-compression powersgd"
            + (" with --zero 0 (PowerSGD compresses all-reduced gradients)" if cfg.zero else ""),
        ),
        (
            "eval_interval",
            cfg.val_fraction > 0 or cfg.eval_interval == 0,
            "validation runs on the --val-fraction split, and --val-fraction 0 holds none out",
            "give --val-fraction > 0 (e.g. 0.05)",
        ),
        (
            "eval_steps",
            cfg.eval_interval > 0 and cfg.val_fraction > 0,
            "it is how many batches a validation takes, and "
            + (
                "--val-fraction 0 holds no validation split"
                if cfg.eval_interval
                else "--eval-interval 0 turns validation off"
            ),
            "give --val-fraction > 0" if cfg.eval_interval else "give --eval-interval N",
        ),
        (
            "cp_comm_type",
            cfg.cp > 1 or cfg.cp_comm_type == "auto",
            "it chooses how context-parallel attention communicates, and --cp 1 has none",
            "add --cp N (N > 1)",
        ),
        (
            "eod_id",
            cfg.attention_mask_type == "block_causal"
            or cfg.reset_position_ids
            or cfg.eod_mask_loss,
            "it is the end-of-document token that --attention-mask-type block_causal, "
            "--reset-position-ids and --eod-mask-loss read, and none is given",
            "add one of them",
        ),
        (
            "profile_dir",
            bool(cfg.profile_steps),
            "it is where the traces of --profile-steps go",
            "add --profile-steps A:B",
        ),
        *(
            (
                name,
                not prepared,
                f"--data is tokenized data, and {flag_of(name)} is for the raw text "
                f"megapar-train tokenizes (.txt / .jsonl / .json / .parquet)",
                None,
            )
            for name in ("jsonl_key", "allow_invalid_utf8")
        ),
        (
            "jsonl_key",
            keyed,
            "no --data input is .jsonl / .json / .parquet (a .txt file's text is all of it)",
            None,
        ),
        *(
            (
                name,
                cfg.precision == "fp16",
                f"it sets the fp16 loss scale, and --precision is {cfg.precision} (no loss "
                f"scaling)",
                fp16_fix,
            )
            for name in (
                "loss_scale",
                "initial_loss_scale",
                "min_loss_scale",
                "loss_scale_window",
                "hysteresis",
            )
        ),
        *(
            (
                name,
                not cfg.loss_scale,
                f"it sets the dynamic loss scale, and --loss-scale {cfg.loss_scale:g} is static",
                "drop --loss-scale",
            )
            for name in ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")
        ),
        *(
            (
                name,
                cfg.lr_decay == "wsd",
                f"it shapes the final decay of --lr-decay wsd, and --lr-decay is {cfg.lr_decay}",
                wsd_fix,
            )
            for name in ("lr_wsd_decay_steps", "lr_wsd_decay_fraction", "lr_wsd_decay_style")
        ),
        (
            "min_lr",
            cfg.lr_decay != "constant",
            "it is where the decay ends, and --lr-decay constant holds --lr after warmup",
            "give --lr-decay cosine, linear or wsd",
        ),
        (
            "lr_decay_steps",  # (said as --min-lr's: one line names both)
            cfg.lr_decay != "constant",
            "it is where the decay ends, and --lr-decay constant holds --lr after warmup",
            "give --lr-decay cosine, linear or wsd",
        ),
        (
            "lr_wsd_decay_fraction",
            cfg.lr_wsd_decay_steps == 0,
            f"--lr-wsd-decay-steps {cfg.lr_wsd_decay_steps} sets the final decay's length",
            None,
        ),
        *(
            (
                name,
                adam,
                f"--optimizer {cfg.optimizer} has no Adam moments",
                "use --optimizer adamw",
            )
            for name in ("adam_beta1", "adam_beta2", "adam_eps")
        ),
        *(
            (
                name,
                cfg.optimizer == "muon",
                f"it is Muon's, and --optimizer is {cfg.optimizer}",
                "add --optimizer muon",
            )
            for name in ("muon_momentum", "muon_adjust_lr", "muon_distributed")
        ),
        *(
            (
                name,
                cfg.zero == 3 or not value,
                f"it applies to --zero 3, and --zero is {cfg.zero}"
                + (
                    " (which reduces every micro-batch already)"
                    if cfg.zero == 2 and name == "zero3_reduce"
                    else ""
                ),
                "add --zero 3",
            )
            for name, value in (
                ("zero3_keep_params", cfg.zero3_keep_params),
                ("zero3_reduce", cfg.zero3_reduce != "step"),
                ("zero3_persistence_threshold", cfg.zero3_persistence_threshold),
            )
        ),
        *(
            (
                name,
                cfg.fp8 != "off" or not value,
                "it applies to --fp8, and --fp8 is off",
                "add --fp8 tensorwise (or --fp8 rowwise)",
            )
            for name, value in (
                ("fp8_emulate", cfg.fp8_emulate),
                ("fp8_layers", cfg.fp8_layers != "auto"),
            )
        ),
        (
            "muon_distributed",
            cfg.optimizer != "muon" or cfg.zero > 0,
            "it splits the orthogonalisation of ZeRO's sharded updates over the data-parallel "
            "ranks, and at --zero 0 every data-parallel rank holds whole matrices (nothing to "
            "exchange over dp; under --tp each tp-split matrix is all-gathered over tp either "
            "way)",
            "use --zero 1, 2 or 3",
        ),
    ]
    unused = [
        (name, why, fix) for name, applies, why, fix in rules if name in given and not applies
    ]
    offload = offload_params_problem(cfg) if "offload_params" in given else None
    if not unused:
        return  # (--offload-params alone: check_zero3 says it)
    reasons = list(dict.fromkeys((why, fix) for _, why, fix in unused))
    said: list[tuple[str, list[str], str | None]] = []  # every reason at once (dropping the
    done: set[str] = set()  # flags of the one named was refused next for another's), each
    for why, fix in reasons:  # with all its flags not named already (--initial-loss-scale and
        names = [n for n, w, f in unused if (w, f) == (why, fix) and n not in done]  # --min-
        if names:  # loss-scale at fp32: one reason)
            said.append((why, names, fix))
            done.update(names)
    lines = []
    for why, names, fix in said:
        shown = and_list(
            [
                flag_of(n)
                if isinstance(getattr(cfg, n), bool)
                else flag_with_value(n, getattr(cfg, n))
                for n in names
            ]
        )
        drop = f"drop {and_list([flag_of(n) for n in names])}"
        if len(names) > 1 and why.startswith("it "):  # "it sets the fp16 loss scale": of each
            why = f"each {why.removeprefix('it ')}"
        ignored = f"{shown} would be ignored: {why}"
        lines.append(f"{ignored}: {fix}, or {drop}" if fix else f"{ignored}; {drop}")
    if offload:  # said with the others (it was refused in a run of its own next; a re-test)
        lines.append(offload)
    raise UsageError("; and ".join(lines))


def _data_kinds(data) -> tuple[bool, bool]:
    """Whether every part of --data is a dataset already tokenized (its PREFIX.bin is there),
    and whether some raw-text part holds a .jsonl / .json / .parquet file (where --jsonl-key
    is read); a path that is not there counts as both (its own check names it)."""
    try:
        paths = [os.path.expanduser(p) if p else None for p in data_paths(data)]
        texts = expand_inputs([p for p in paths if p and is_raw_text(p)])  # None: the .txt sample
    except (ValueError, FileNotFoundError):  # a malformed blend, a missing path: named later
        return False, True
    prepared = all(p is not None and os.path.isfile(p + ".bin") for p in paths)
    return prepared, prepared or reads_key(texts)
