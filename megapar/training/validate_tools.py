"""The checks of megapar-eval and megapar-bubble (megapar-train's are in validate.py).

- `check_eval_args`: megapar-eval's flags, its --load checkpoint, --data and --input-ids.
- `check_bubble_args`: megapar-bubble's flags, and a schedule small enough to simulate.

Both raise validate.UsageError (exit code 2) before any model is built or process started.
"""

from __future__ import annotations

import math

import numpy as np

from megapar.data import IndexedDataset, MLMDataset, load_tokenizer
from megapar.launcher import check_local_workers
from megapar.mesh import Layout, LayoutError
from megapar.models.config import CAUSAL_LM_TYPES, ConfigError, config_from_dict
from megapar.pipeline.partition import chunk_specs
from megapar.pipeline.schedules import chunks_per_rank
from megapar.pipeline.simulate import Costs, theoretical_bubble
from megapar.training.bubble import bench_config
from megapar.training.data import missing_files
from megapar.training.tokenizer_checks import check_checkpoint_tokenizer
from megapar.training.validate import UsageError, check_cp_seq_len, flag_of
from megapar.training.validate_resume import checkpoint_manifest


# --- megapar-eval ----------------------------------------------------------------------------
def check_eval_args(args) -> dict:
    """Check megapar-eval's arguments and checkpoint; returns the checkpoint's manifest."""

    for name in ("tp", "pp", "micro_batch_size", "max_batches", "seq_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"{flag_of(name)} {value} is invalid: it must be >= 1")
    manifest = checkpoint_manifest(args.load)
    config = config_from_dict(manifest["model"])
    try:
        config.validate(Layout(args.tp, args.pp, 1))
    except (LayoutError, ConfigError) as exc:
        raise UsageError(str(exc)) from None
    positions = config.max_positions
    if args.data and args.seq_len is None:  # the checkpoint's, as megapar-train --load takes it
        args.seq_len = ((manifest.get("meta") or {}).get("train_config") or {}).get("seq_len")
        if args.seq_len is None:
            raise UsageError(
                f"--data needs --seq-len: --load {args.load} records no sequence "
                f"length (it was not trained by megapar-train); give --seq-len N"
            )
    if args.seq_len and args.seq_len > positions:
        raise UsageError(
            f"--seq-len {args.seq_len} exceeds the model's {positions} positions; lower --seq-len"
        )
    if args.data:
        missing = [f[len(args.data) :] for f in missing_files(args.data)]
        if missing:
            raise UsageError(
                f"--data {args.data}: {', '.join(missing)} not found; pass the prefix "
                f"written by megapar-data --output-prefix (or a Megatron-LM "
                f"dataset's, with --tokenizer)"
            )
        indexed = IndexedDataset(args.data, args.tokenizer)
        tokenizer = load_tokenizer(indexed.tokenizer_spec)
        check_checkpoint_tokenizer(args.load, manifest, tokenizer, args.data)
        _check_batches(args, indexed, tokenizer, config.model_type in CAUSAL_LM_TYPES)
    if args.input_ids:
        _check_ids_file(args.input_ids, positions)
    return manifest


def _check_batches(args, indexed, tokenizer, causal: bool) -> None:
    """UsageError unless --data holds one batch of --micro-batch-size samples at --seq-len (a
    causal LM's windows of seq_len + 1 tokens, BERT's MLM samples, as the workers cut them)."""
    if causal:
        samples, what = (indexed.num_tokens - 1) // args.seq_len, f"windows of {args.seq_len + 1}"
    else:
        try:
            samples = len(MLMDataset(indexed, args.seq_len, tokenizer, args.seed))
        except ValueError as exc:
            raise UsageError(
                f"--data {args.data} at --seq-len {args.seq_len}: {exc}; raise --seq-len "
                f"or give more data"
            ) from None
        what = f"MLM samples of {args.seq_len}"
    if samples < args.micro_batch_size:
        raise UsageError(
            f"--data {args.data} has {samples} {what} tokens, fewer than one batch of "
            f"--micro-batch-size {args.micro_batch_size}; lower --seq-len or --micro-batch-size"
        )


def _check_ids_file(path: str, positions: int) -> None:
    try:
        ids = np.load(path, allow_pickle=False, mmap_mode="r")
    except FileNotFoundError:
        raise UsageError(f"--input-ids {path}: no such file") from None
    except (ValueError, OSError) as exc:
        raise UsageError(f"--input-ids {path}: not a .npy array of token ids ({exc})") from None
    if not np.issubdtype(ids.dtype, np.integer):
        raise UsageError(
            f"--input-ids {path} holds {ids.dtype} values; token ids must be "
            f"integers (e.g. np.save(path, ids.astype(np.int64)))"
        )
    if ids.ndim != 2 or 0 in ids.shape:
        raise UsageError(
            f"--input-ids must be a non-empty [batch, seq] array, got shape {tuple(ids.shape)}"
        )
    if ids.shape[1] > positions:
        raise UsageError(
            f"--input-ids has sequences of {ids.shape[1]} tokens, more than the "
            f"model's {positions} positions; shorten them"
        )


# --- megapar-bubble --------------------------------------------------------------------------
MAX_SIMULATED_ACTIONS = 50_000
"""--simulate / --show-schedule refuse schedules with more actions than this (forwards and
backwards of every stage, chunk and micro-batch; the simulator is pure Python, ~2 s here)."""
MAX_SIMULATED_STAGES = 256
"""--simulate refuses more stages than this (its cost also grows with the square of pp)."""


def check_bubble_args(args) -> None:
    for name in (
        "pp",
        "microbatches",
        "tp",
        "cp",
        "steps",
        "micro_batch_size",
        "seq_len",
        "virtual_stages",
    ):
        value = getattr(args, name)
        if value < 1:
            raise UsageError(f"{flag_of(name)} {value} is invalid: it must be >= 1")
    for name in ("fwd_ms", "bwd_ms", "p2p_ms", "bwd_input_ms", "bwd_weight_ms"):
        value = getattr(args, name)
        positive = name in ("fwd_ms", "bwd_ms")  # a split backward part may cost nothing
        if value is not None and not (
            math.isfinite(value) and value >= (1e-300 if positive else 0.0)
        ):
            need = "> 0" if positive else ">= 0"
            raise UsageError(
                f"{flag_of(name)} {value} is invalid: a cost must be a finite "
                f"number of milliseconds {need}"
            )
    actions = 2 * args.pp * args.microbatches * max(1, args.virtual_stages)
    if actions > MAX_SIMULATED_ACTIONS or args.simulate and args.pp > MAX_SIMULATED_STAGES:
        v = f" x --virtual-stages {args.virtual_stages}" if args.virtual_stages > 1 else ""
        raise UsageError(
            f"--pp {args.pp} x --microbatches {args.microbatches}{v} is "
            f"{actions:,} actions on {args.pp} stages, more than megapar-bubble "
            f"measures or simulates in seconds ({MAX_SIMULATED_ACTIONS:,} actions, "
            f"{MAX_SIMULATED_STAGES} stages); {_formula_instead(args)}"
        )
    if (
        not (args.simulate and args.fwd_ms is not None)
        and not args.show_schedule
        and not args.oversubscribe
    ):  # real processes: one per stage, tp and cp rank
        cp = f" x --cp {args.cp}" if args.cp > 1 else ""
        check_local_workers(args.pp * args.tp * args.cp, f"--pp {args.pp} x --tp {args.tp}{cp}")
    if args.simulate and args.fwd_ms is not None:
        return  # no model is built

    try:
        chunks = chunks_per_rank(args.schedule, args.virtual_stages)  # 2 for the V schedules
        config = bench_config(args.model, args.pp, chunks)
        config.validate(Layout(args.tp, args.pp, 1, cp=args.cp))
        if chunks > 1:
            chunk_specs(config.num_layers, args.pp, 0, chunks)  # enough layers?
    except (LayoutError, ConfigError) as exc:
        raise UsageError(str(exc)) from None

    check_cp_seq_len(args.seq_len, Layout(args.tp, args.pp, 1, cp=args.cp))
    positions = config.max_positions
    if args.seq_len > positions:
        raise UsageError(
            f"--seq-len {args.seq_len} exceeds the model's {positions} positions; lower --seq-len"
        )


def _formula_instead(args) -> str:
    """The schedule's published bubble at the sizes and costs given (F 1, backward 2 x F, B
    and W half of it, unless told): what an oversized request is told instead of a run."""
    fwd = args.fwd_ms or 1.0
    costs = Costs(
        fwd,
        args.bwd_ms or 2 * fwd,
        bwd_input_ms=args.bwd_input_ms,
        bwd_weight_ms=args.bwd_weight_ms,
    )
    b_in, b_w = costs.duration_ms("backward_input"), costs.duration_ms("backward_weight")
    value = theoretical_bubble(
        args.pp, args.microbatches, args.schedule, args.virtual_stages, fwd, b_in, b_w
    )
    if math.isnan(value):
        return f"{args.schedule}'s published formula does not apply to these costs either"
    bound = " (a lower bound)" if args.schedule in ("zb-v", "dualpipev") else ""
    return f"{args.schedule}'s bubble formula gives {value:.4f}{bound}, with no run"
