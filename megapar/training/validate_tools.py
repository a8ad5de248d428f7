"""The checks of megapar-eval and megapar-bubble (megapar-train's are in validate.py).

- `check_eval_args`: megapar-eval's flags, its --load checkpoint, --data and --input-ids.
- `load_input_ids`: --input-ids' array, from a .npy file only, never unpickled.
- `check_bubble_measurement`: megapar-bubble's flags where it builds a model (its sizes and
  costs: `validate_bubble.check_bubble_args`, which needs no torch).

Both raise validate.UsageError (exit code 2) before any model is built or process started.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Collection

import numpy as np

from megapar.checkpoint.format import CheckpointError
from megapar.checkpoint.manifest import read_manifest
from megapar.data import IndexedDataset, MLMDataset, SFTDataset
from megapar.data.preprocess import recorded_unknown_note
from megapar.env_seconds import problem as env_problem
from megapar.launcher import check_local_workers, under_launcher
from megapar.mesh import Layout, LayoutError
from megapar.models.config import CAUSAL_LM_TYPES, ConfigError, config_from_dict
from megapar.pipeline.partition import chunk_specs
from megapar.pipeline.schedules import chunks_per_rank, placement_of
from megapar.training.bubble import bench_config
from megapar.training.config import TrainConfig
from megapar.training.data import discard_tokenized, is_megatron, missing_files
from megapar.training.eval_text import (
    check_text_options,
    data_tokenizer,
    is_text,
    text_tokenizer,
    tokenize_text,
    trained_sft_keys,
)
from megapar.training.ranges import HIGHEST
from megapar.training.tokenizer_checks import (
    check_checkpoint_tokenizer,
    check_dataset_tokenizer,
    take_moved_copy,
    unlike_vocab_note,
)
from megapar.training.validate import (
    UsageError,
    check_cp_seq_len,
    check_mlm_seq_len,
    check_mlm_token_types,
    flag_of,
)
from megapar.training.validate_resume import checked_step, checkpoint_manifest, worker_verify
from megapar.wording import counted


# --- megapar-eval ----------------------------------------------------------------------------
def check_eval_args(args, given: Collection[str] = ()) -> dict:
    """Check megapar-eval's arguments and checkpoint (`given`: the flags' dests the command
    line set, `OneLineParser.given`); returns the checkpoint's manifest. Sets
    ``args.seq_len_note``: the lines saying which --seq-len a checkpoint that records none gets
    and that raw --data is read as the records the checkpoint trained on (`trained_sft_keys`)
    (None where neither applies), for the caller to print once its own checks pass."""

    wrong = env_problem()  # read at import, where an invalid value falls back to the default
    if wrong:
        raise UsageError(wrong)
    for name in ("tp", "pp", "cp", "micro_batch_size", "max_batches", "seq_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"{flag_of(name)} {value} is invalid: it must be >= 1")
    layout = Layout(args.tp, args.pp, 1, cp=args.cp)
    if not args.oversubscribe and not under_launcher():  # one process per tp, cp, pp rank
        cp = f" x --cp {args.cp}" if args.cp > 1 else ""
        try:  # before the checkpoint's files are hashed
            check_local_workers(args.tp * args.pp * args.cp, f"--tp {args.tp}{cp} x --pp {args.pp}")
        except ValueError:
            _refuse_layout(args.load, layout)  # --pp 9 of 4 layers: that, not the processes
            raise
    manifest = checkpoint_manifest(args.load)  # sha256 where the ranks then check sizes only
    args.load_step, args.load_verify = checked_step(args.load, manifest), worker_verify()
    config = config_from_dict(manifest["model"])
    _check_layout(config, layout)
    positions = config.max_positions
    note = None  # said once every check has passed (a refusal stays one line)
    if args.data and args.seq_len is None:  # the checkpoint's, as megapar-train --load takes it
        args.seq_len = ((manifest.get("meta") or {}).get("train_config") or {}).get("seq_len")
        if args.seq_len is None:
            args.seq_len, note = untrained_seq_len(args.load, positions)
    if args.seq_len and args.seq_len > positions:
        raise UsageError(
            f"--seq-len {args.seq_len} exceeds the model's {positions} positions; lower --seq-len"
        )
    if args.data and args.seq_len:
        check_cp_seq_len(args.seq_len, layout)
    causal = config.model_type in CAUSAL_LM_TYPES
    if "seed" in given and causal:  # before any text is tokenized
        raise UsageError(
            f"--seed {args.seed} would be ignored: it seeds BERT's masking, and the "
            f"checkpoint holds a {config.model_type} (its loss masks nothing); drop it"
        )
    highest = HIGHEST["seed"][0]
    if not 0 <= args.seed <= highest:  # as megapar-train's (it failed in rank 0's masking)
        raise UsageError(
            f"--seed {args.seed} is invalid: it must be a whole number from 0 to {highest:,} "
            f"(as megapar-train's; the default is 1234)"
        )
    if args.sft_keys is not None and not causal:
        raise UsageError(
            f"--sft-keys {args.sft_keys} scores a causal language model's responses, and the "
            f"checkpoint holds a {config.model_type} (masked-LM samples); drop --sft-keys"
        )
    sft_note = trained_sft_keys(args, manifest) if args.data and causal else None
    args.max_batches_given = "max_batches" in given
    left_note = None
    if args.data:
        check_text_options(args)  # before anything is read or tokenized
        if not causal:
            check_mlm_seq_len(args.seq_len)
            check_mlm_token_types(config)
        args.data_shown = args.data  # messages name the text, not its cached dataset
        tokenized: list[str] = []  # a copy made now goes again when the text is refused
        try:
            if is_text(args.data):  # tokenized into --data-cache as megapar-train does
                args.data = tokenize_text(args, manifest, config.vocab_size, tokenized)
            else:  # a prepared dataset: its unknown tokens, as megapar-train says them
                _say_unknown_tokens(args.data)
            left_note = _check_data(args, manifest, causal, config.vocab_size)
        except BaseException:
            discard_tokenized(tokenized)
            raise
    if args.input_ids:
        _check_bert_inputs(args, _check_ids_file(args.input_ids, positions, args.cp), config)
    paragraphs = getattr(args, "paragraphs_note", None)  # raw text's documents
    notes = [n for n in (note, sft_note, paragraphs, left_note) if n]  # once its checks pass
    args.seq_len_note = "\n".join(notes) or None
    return manifest


def _say_unknown_tokens(prefix: str) -> None:
    """megapar-eval's warning where a prepared dataset's metadata records that 1 % or more of
    its tokens are its tokenizer's unknown token (`unknown_tokens_note`; raw text is told by
    the tokenizing itself); nothing where it does not read (its own checks name it)."""
    try:
        meta = IndexedDataset(prefix).meta
    except (OSError, ValueError):
        return
    said = recorded_unknown_note(meta)
    if said:
        print(f"megapar-eval: warning: --data {prefix}: {said}", file=sys.stderr)


def _refuse_layout(load: str, layout: Layout) -> None:
    """UsageError where the model of checkpoint `load` (its manifest read, not verified) cannot
    take `layout`; nothing where it can, or where the manifest does not read (its own checks
    say why later)."""
    try:
        config = config_from_dict(read_manifest(os.path.expanduser(load))["model"])
    except (CheckpointError, ConfigError, KeyError, OSError, TypeError, ValueError):
        return
    _check_layout(config, layout)


def _check_layout(config, layout: Layout) -> None:
    """UsageError (one line) where model `config` cannot take `layout`."""
    try:
        config.validate(layout)
    except (LayoutError, ConfigError) as exc:
        raise UsageError(str(exc)) from None


def _check_data(args, manifest: dict, causal: bool, vocab_size: int) -> str | None:
    """The checks of --data as a dataset prefix (raw text already tokenized): its files, its
    tokenizer against the checkpoint's, and one batch's worth of samples. Returns the lines
    naming the samples the whole batches leave out (`_left_out`) and a tokenizer far smaller
    than the model's vocabulary (`unlike_vocab_note`), or None."""
    missing = [os.path.basename(f) for f in missing_files(args.data)]
    if missing:
        raise UsageError(
            f"--data {args.data}: {', '.join(missing)} not found; pass the prefix "
            f"written by megapar-data --output-prefix, or raw text (.txt / .jsonl "
            f"or a directory of them; or a Megatron-LM dataset's prefix, with --tokenizer)"
        )
    recorded = (manifest.get("meta") or {}).get("tokenizer")
    unrecorded = is_megatron(args.data) and not os.path.isfile(args.data + ".json")
    if not args.tokenizer and unrecorded and isinstance(recorded, dict):
        # a Megatron-LM dataset records no tokenizer: the checkpoint's, as megapar-train
        # --load takes it
        args.tokenizer = text_tokenizer(args, manifest)[0]
    indexed = IndexedDataset(args.data, args.tokenizer)
    if os.path.isfile(args.data + ".json"):  # its tokenizer's files copied elsewhere: given,
        # or the checkpoint's (which trained with them)
        take_moved_copy(
            indexed.tokenizer_spec,
            args.tokenizer or (recorded.get("path") if isinstance(recorded, dict) else None),
        )
    tokenizer = data_tokenizer(args, indexed)
    shown = getattr(args, "data_shown", args.data)
    if shown == args.data:  # text: tokenized with --tokenizer
        check_dataset_tokenizer(args.data, indexed.tokenizer_spec, tokenizer)
    check_checkpoint_tokenizer(args.load, manifest, tokenizer, args.data)
    name = (
        f"--tokenizer {args.tokenizer}"
        if shown != args.data or args.tokenizer
        else f"the tokenizer --data {shown} was made with ({tokenizer.path})"
    )
    unlike = unlike_vocab_note(args.load, manifest, tokenizer, vocab_size, name)
    notes = [_check_batches(args, indexed, tokenizer, causal), unlike and f"megapar-eval: {unlike}"]
    return "\n".join(n for n in notes if n) or None


def _check_batches(args, indexed, tokenizer, causal: bool) -> str | None:
    """UsageError unless --data holds one batch of --micro-batch-size samples at --seq-len (a
    causal LM's windows of seq_len + 1 tokens, a record each of a dataset of prompt / response
    records, BERT's MLM samples, as the workers cut them). Returns the line naming the samples
    whole batches leave out (`_left_out`), or None."""
    shown = getattr(args, "data_shown", args.data)
    if causal and indexed.prompt_lengths is not None:
        samples = indexed.num_docs
        what = f"record{'s' * (samples != 1)} (samples) of up to {args.seq_len + 1}"
    elif causal:
        samples = (indexed.num_tokens - 1) // args.seq_len
        what = f"window{'s' * (samples != 1)} of {args.seq_len + 1}"
    else:
        try:
            samples = len(MLMDataset(indexed, args.seq_len, tokenizer, args.seed))
        except ValueError as exc:
            raise UsageError(f"--data {shown}: {exc}; give more data") from None
        what = f"MLM sample{'s' * (samples != 1)} of {args.seq_len}"
    if samples == 0:  # no smaller batch helps: only more data or shorter samples
        held = (
            counted(indexed.num_tokens, "token")
            if causal
            else counted(indexed.num_docs, "document")
        )
        raise UsageError(
            f"--data {shown} has 0 {what} tokens (it holds {held}); use more data or a "
            f"shorter --seq-len"
        )
    if samples < args.micro_batch_size:
        records = causal and indexed.prompt_lengths is not None  # a sample each at any --seq-len
        fix = (
            "--micro-batch-size or give more records"
            if records
            else "--seq-len or --micro-batch-size"
        )
        raise UsageError(
            f"--data {shown} has {samples} {what} tokens, fewer than one batch of "
            f"--micro-batch-size {args.micro_batch_size}; lower {fix}"
        )
    scored = min(args.max_batches, samples // args.micro_batch_size) * args.micro_batch_size
    if causal and indexed.prompt_lengths is not None:
        unlearnt = _check_responses(args, indexed, shown, scored)
        notes = [_left_out(args, shown, samples, scored, "record"), unlearnt]
        return "\n".join(n for n in notes if n) or None
    if causal:
        return _left_out(args, shown, samples, scored, "window", args.seq_len)
    return _left_out(args, shown, samples, scored, "MLM sample")


def _left_out(
    args, shown: str, samples: int, scored: int, unit: str, tokens_each: int = 0
) -> str | None:
    """The line saying that whole batches leave the last samples out (`samples` of them, not a
    multiple of --micro-batch-size; `scored` the first ones evaluated) where --max-batches
    would take them all, with a --micro-batch-size that scores every one: `unit` names a
    sample (a prompt / response record, a causal LM's window, whose `tokens_each` predicted
    tokens are named too, or BERT's MLM sample). None where every sample is scored or fewer
    batches were asked for."""
    b = args.micro_batch_size
    if args.max_batches * b < samples:
        given = getattr(args, "max_batches_given", True)
        return None if given else _capped(args, shown, samples, unit)
    if scored == samples:
        return None
    # the divisor of `samples` nearest --micro-batch-size in --max-batches batches, up to twice
    # the size; else the nearest at all (1 at worst, not a prime count's one batch of them all)
    # with the --max-batches its batches need
    divisors = [d for d in range(1, samples + 1) if samples % d == 0]
    fit = [d for d in divisors if d <= 2 * b and samples // d <= args.max_batches]
    size = min(fit or divisors, key=lambda d: (abs(d - b), d))
    more = f" --max-batches {samples // size}" if samples // size > args.max_batches else ""
    left = samples - scored
    tokens = f" ({counted(left * tokens_each, 'predicted token')})" if tokens_each else ""
    return (
        f"megapar-eval: scores {scored:,} of the {counted(samples, unit)} of --data {shown} "
        f"({counted(scored // b, 'batch', 'batches')} of --micro-batch-size {b}); the last "
        f"{left:,}{tokens} {'is' if left == 1 else 'are'} left out, as only whole batches are "
        f"scored: --micro-batch-size {size}{more} scores every one"
    )


def _capped(args, shown: str, samples: int, unit: str) -> str:
    """The line saying that the default --max-batches scores only the first of the `samples`
    (the command line named no --max-batches) and the --max-batches that scores them all."""
    b, k = args.micro_batch_size, args.max_batches
    every, left = divmod(samples, b)
    rest = (
        "every one" if left == 0 else f"all but the last {left:,} (only whole batches are scored)"
    )
    return (
        f"megapar-eval: scores the first {k * b:,} of the {counted(samples, unit)} of --data "
        f"{shown} (the default --max-batches {k} of --micro-batch-size {b}): --max-batches "
        f"{every} scores {rest}"
    )


def _check_responses(args, indexed, shown: str, used: int) -> str | None:
    """UsageError where none of the first `used` records (those the batches evaluate) keeps a
    response token at --seq-len (every prompt fills its sample): the loss would be over no
    token, reported as 0. Returns the line naming how many of them keep none (they add nothing
    to the loss, as megapar-train's line counts them), or None."""
    records = SFTDataset(indexed, args.seq_len)
    kept = np.minimum(records.length[:used], args.seq_len + 1) > records.prompt[:used]
    if kept.all():
        return None
    if kept.any():
        lost = int((~kept).sum())
        return (
            f"megapar-eval: {lost:,} of the {counted(used, 'record')} scored keep"
            f"{'s' * (lost == 1)} no response token at --seq-len {args.seq_len} (a prompt that "
            f"fills the sample, or a record of no text): they add nothing to the loss"
        )
    raise UsageError(
        f"--data {shown}: none of the {used:,} records evaluated keeps a response token "
        f"at --seq-len {args.seq_len} (the shortest prompt is "
        f"{int(records.prompt[:used].min())} tokens), so there is no loss to report; raise "
        f"--seq-len to at least {int(records.prompt[:used].min())}"
    )


NPY_MAGIC = b"\x93NUMPY"
"""The first bytes of every .npy file (numpy's format, any version)."""


def _how_to_write_ids(path: str, head: bytes, flag: str = "--input-ids") -> str:
    """How to write --input-ids as megapar-eval reads it: for JSON ids (`head`, the file's
    first bytes, or its name says so), the command that converts `path`; else np.save."""
    if path.lower().endswith(".json") or head.lstrip()[:1] in (b"[", b"{"):
        npy = os.path.splitext(path)[0] + ".npy"
        code = (
            f"import json, numpy as np; np.save({json.dumps(npy)}, "
            f"np.asarray(json.load(open({json.dumps(path)})), dtype=np.int64))"
        )
        return f"convert it with: {shlex.join(['python3', '-c', code])}"
    name = {"--attention-mask": "mask", "--token-type-ids": "types"}.get(flag, "ids")
    return f"write one with np.save('{name}.npy', np.asarray({name}, dtype=np.int64))"


def untrained_seq_len(load: str, positions: int) -> tuple[int, str]:
    """--seq-len for a checkpoint that records none (imported by megapar-convert --from-hf, not
    trained by megapar-train): megapar-train's default, capped at the model's `positions` as
    megapar-train caps it, and the note that says so (printed once every argument passed)."""
    default = TrainConfig.seq_len
    seq_len = min(default, positions)
    why = (
        f"the model's {positions} positions (megapar-train's default {default}, capped at them)"
        if seq_len < default
        else f"megapar-train's default {default}"
    )
    return seq_len, (
        f"megapar-eval: --seq-len not given and --load {load} records none (it was not trained "
        f"by megapar-train): using {why}; give --seq-len N for another"
    )


def load_input_ids(path: str, mmap: bool = False, flag: str = "--input-ids") -> np.ndarray:
    """--input-ids' array (or `flag`'s: --attention-mask, --token-type-ids): a .npy file
    (numpy's format), read with pickling refused (an object array is refused too). UsageError,
    naming the file type accepted and how to write one, for anything else (JSON, .npz, text).
    `mmap`: mapped, not read (for checking its shape)."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except FileNotFoundError:
        raise UsageError(f"{flag} {path}: no such file") from None
    except OSError as exc:
        raise UsageError(f"{flag} {path}: {exc.strerror or exc}") from None
    accepted = "megapar-eval reads a [batch, seq] integer array from a .npy file"
    if not head.startswith(NPY_MAGIC):
        what = "a JSON file" if head.lstrip()[:1] in (b"[", b"{") else "not a .npy file"
        what = "a .npz archive" if head.startswith(b"PK\x03\x04") else what
        raise UsageError(
            f"{flag} {path} is {what}; {accepted}: {_how_to_write_ids(path, head, flag)}"
        )
    how = _how_to_write_ids(path, b"", flag)
    try:
        with open(path, "rb") as f:  # the header: an object array is refused before it is read
            read_header = {
                (1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0,
            }.get(np.lib.format.read_magic(f))
            dtype = read_header(f)[2] if read_header else None
        if dtype is None or not dtype.hasobject:
            return np.load(path, allow_pickle=False, mmap_mode="r" if mmap else None)
    except ValueError as exc:  # a damaged header or data (numpy's message)
        raise UsageError(f"{flag} {path} is a damaged .npy file ({exc}); {how}") from None
    except OSError as exc:
        raise UsageError(f"{flag} {path}: {exc.strerror or exc}") from None
    raise UsageError(
        f"{flag} {path} holds Python objects, not numbers (megapar never unpickles a "
        f"file); {accepted}: {how}"
    )


def _check_ids_file(path: str, positions: int, cp: int = 1) -> tuple[int, ...]:
    """--input-ids: a non-empty [batch, seq] integer array the model's positions hold and the
    cp split cuts (seq a multiple of 2 x cp); returns its shape."""
    ids = load_input_ids(path, mmap=True)
    if not np.issubdtype(ids.dtype, np.integer):
        raise UsageError(
            f"--input-ids {path} holds {ids.dtype} values; token ids must be "
            f"integers (e.g. np.save(path, ids.astype(np.int64)))"
        )
    if ids.ndim != 2 or 0 in ids.shape:
        fix = (
            f"one sequence of {ids.shape[0]} ids is ids.reshape(1, {ids.shape[0]})"
            if ids.ndim == 1 and ids.size
            else "save a [batch, seq] integer array of at least one id"
        )
        raise UsageError(
            f"--input-ids must be a non-empty [batch, seq] array, got shape "
            f"{tuple(ids.shape)}; {fix}"
        )
    if ids.shape[1] > positions:
        raise UsageError(
            f"--input-ids has sequences of {ids.shape[1]} tokens, more than the "
            f"model's {positions} positions; shorten them"
        )
    if cp > 1 and ids.shape[1] % (2 * cp):
        raise UsageError(
            f"--input-ids has sequences of {ids.shape[1]} tokens, not a multiple of 2 x cp = "
            f"{2 * cp}: --cp {cp} cuts each sequence into {2 * cp} chunks; pad them (BERT: with "
            f"--attention-mask 0 on the padding; a causal LM: on the right) or lower --cp"
        )
    return tuple(ids.shape)


def _check_bert_inputs(args, shape: tuple[int, ...], config) -> None:
    """--attention-mask / --token-type-ids: BERT's only (megapar's causal LMs take neither),
    each an integer array of --input-ids' shape: the mask 0 / 1 with a 1 in every row, the
    types below the model's type_vocab_size."""
    causal = config.model_type in CAUSAL_LM_TYPES
    for flag, path in (
        ("--attention-mask", args.attention_mask),
        ("--token-type-ids", args.token_type_ids),
    ):
        if path is None:
            continue
        if causal:
            why = (
                "its attention is causal over every token (pad on the right and read the "
                "real tokens' logits)"
                if flag == "--attention-mask"
                else "it has no token-type embedding"
            )
            raise UsageError(
                f"{flag} is BERT's input, and the checkpoint holds a {config.model_type}: {why}; "
                f"drop {flag}"
            )
        values = load_input_ids(path, mmap=True, flag=flag)
        if not np.issubdtype(values.dtype, np.integer) and values.dtype != np.bool_:
            raise UsageError(
                f"{flag} {path} holds {values.dtype} values; it must be integers (e.g. "
                f"np.save(path, values.astype(np.int64)))"
            )
        if tuple(values.shape) != shape:
            raise UsageError(
                f"{flag} {path} has shape {tuple(values.shape)}, and --input-ids {shape}; give "
                f"one value per token"
            )
        values = np.asarray(values, dtype=np.int64)
        if flag == "--attention-mask":
            if not np.isin(values, (0, 1)).all():
                raise UsageError(
                    f"{flag} {path} holds {values[~np.isin(values, (0, 1))][0]}; it holds 1 "
                    f"for a token and 0 for padding"
                )
            empty = np.flatnonzero(values.sum(axis=1) == 0)
            if empty.size:
                raise UsageError(
                    f"{flag} {path}: row {empty[0]} is all 0 (no token to attend to); give "
                    f"every row at least one 1"
                )
        elif values.min() < 0 or values.max() >= config.type_vocab_size:
            bad = values.max() if values.max() >= config.type_vocab_size else values.min()
            raise UsageError(
                f"{flag} {path} holds {bad}, outside the model's {config.type_vocab_size} "
                f"token types (0-{config.type_vocab_size - 1})"
            )


# --- megapar-bubble --------------------------------------------------------------------------
def check_bubble_measurement(args, flags: str = "given") -> None:
    """megapar-bubble's flags where it builds a model (a measurement, a simulation of measured
    costs): the local processes a measurement starts, the model's layers and positions against
    --pp, --virtual-stages, --tp, --cp and --seq-len; `flags` says whether --schedule was
    "given" or is the "default". After `check_bubble_args`."""
    if not args.oversubscribe:  # one process per stage, tp, cp rank
        cp = f" x --cp {args.cp}" if args.cp > 1 else ""
        check_local_workers(args.pp * args.tp * args.cp, f"--pp {args.pp} x --tp {args.tp}{cp}")
    try:
        layers = bench_config(args.model, args.pp).num_layers if args.model else None
        chunks = chunks_per_rank(  # 2 for the V schedules; a --model's layers bound the fix
            args.schedule, args.virtual_stages, flags=flags, layers=layers, pp=args.pp
        )
        config = bench_config(args.model, args.pp, chunks)
        if chunks > 1:  # first: the V's and the loop's lines name the --pp their chunks take
            placement = placement_of(args.schedule)
            chunk_specs(config.num_layers, args.pp, 0, chunks, placement)  # enough layers?
        config.validate(Layout(args.tp, args.pp, 1, cp=args.cp))
    except (LayoutError, ConfigError) as exc:
        raise UsageError(str(exc)) from None

    check_cp_seq_len(args.seq_len, Layout(args.tp, args.pp, 1, cp=args.cp))
    positions = config.max_positions
    if args.seq_len > positions:
        raise UsageError(
            f"--seq-len {args.seq_len} exceeds the model's {positions} positions; lower --seq-len"
        )
