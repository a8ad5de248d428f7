"""Raw text as megapar-eval's --data: tokenized with the tokenizer the --load checkpoint trained
with (or --tokenizer) into --data-cache, by megapar-train's own path (`resolve_data_prefix`,
which calls `ensure_dataset`: a document per blank-line-separated paragraph, the cache keyed by
the text's and the tokenizer files' content). The same text and tokenizer therefore give the
same dataset as megapar-train's cache, and as `megapar-data --split-lines` makes of it.

Everything here runs in the launching process, before any worker starts; refusals are
`UsageError` / `ValueError` / `OSError` lines (megapar-eval prints them, exit 2).
"""

from __future__ import annotations

import json
import os
import sys

from megapar.data import IndexedDataset, load_tokenizer
from megapar.data.blended import data_paths
from megapar.data.inputs import (
    SFT_SUFFIXES,
    expand_inputs,
    is_raw_text,
    iter_records,
    parse_sft_keys,
    reads_key,
)
from megapar.training.config import TrainConfig
from megapar.training.data import load_dataset_tokenizer, resolve_data_prefix
from megapar.training.tokenizer_checks import (
    check_checkpoint_tokenizer,
    data_tokenizer_spec,
    recorded_as_trained,
)
from megapar.training.validate import UsageError, check_writable, flag_of
from megapar.training.validate_sft import check_sft_keys
from megapar.wording import and_list

TEXT_OPTIONS = ("jsonl_key", "sft_keys", "allow_invalid_utf8", "data_cache")
"""megapar-eval's options for raw text (their parser defaults, None / False, mean not given)."""
DEFAULT_CACHE = TrainConfig.data_cache
"""--data-cache left out: megapar-train's default, so both share one cache."""


def is_text(data: str) -> bool:
    """Whether --data names raw text to tokenize (as megapar-train tells it from a prefix)."""
    return is_raw_text(os.path.expanduser(data))


def check_text_options(args) -> None:
    """UsageError for a raw-text option that --data would not read (given with a prepared
    dataset; --jsonl-key where no input is .jsonl / .json / .parquet), and ValueError for a
    --data-cache that cannot be made; before anything is read or tokenized (an existing
    read-only one may hold the text's copy: a write it needs is refused when made,
    `data._resolve_one`)."""
    given = [name for name in TEXT_OPTIONS if getattr(args, name) not in (None, False)]
    if not is_text(args.data):
        if args.sft_keys is not None:
            raise UsageError(_sft_keys_on_prepared(args, [n for n in given if n != "sft_keys"]))
        if given:
            named = ", ".join(
                flag_of(name) + ("" if getattr(args, name) is True else f" {getattr(args, name)}")
                for name in given
            )
            raise UsageError(
                f"{named} would be ignored: --data {args.data} is a tokenized dataset, and "
                f"{'it is' if len(given) == 1 else 'they are'} for the raw text megapar-eval "
                f"tokenizes (.txt / .jsonl / .json / .parquet); drop "
                f"{'it' if len(given) == 1 else 'them'}"
            )
        return
    if args.sft_keys is not None:  # before --jsonl-key's check: it names --sft-keys's fields
        cfg = TrainConfig(data=args.data, sft_keys=args.sft_keys, jsonl_key=args.jsonl_key)
        check_sft_keys(cfg, {"jsonl_key"} if args.jsonl_key is not None else set())
    if args.jsonl_key is not None:
        try:
            files = expand_inputs([os.path.expanduser(args.data)])
        except (FileNotFoundError, ValueError):  # named by the data's own check
            files = None
        if files is not None and not reads_key(files):
            raise UsageError(
                f"--jsonl-key {args.jsonl_key} would be ignored: no --data input is .jsonl / "
                f".json / .parquet (a .txt file's text is all of it); drop --jsonl-key"
            )
    cache = args.data_cache or DEFAULT_CACHE
    if not os.path.isdir(os.path.expanduser(cache)):  # an existing one may be read-only and
        check_writable(cache, "--data-cache")  # hold the copy: a write it needs is refused then


def _sft_keys_on_prepared(args, others: list[str]) -> str:
    """The refusal of --sft-keys beside a prepared (tokenized) --data: the flag reads raw JSON
    Lines records, and a dataset megapar-data made of records holds its prompt lengths already
    (megapar-eval scores its responses without the flag), while one of plain text has none.
    `others`: the other raw-text options given, which go with it."""
    keys = prepared_sft_keys(os.path.expanduser(args.data))
    drop = and_list(["--sft-keys", *(flag_of(n) for n in others)])
    head = f"--sft-keys {args.sft_keys} applies to raw JSON Lines records"
    if keys is not None:
        return (
            f"{head}, and --data {args.data} is a prepared dataset of records (made with "
            f"--sft-keys {','.join(keys)}) that already holds their prompt lengths: megapar-eval "
            f"scores its responses without it; drop {drop}"
        )
    return (
        f"{head}, and --data {args.data} is a prepared dataset of plain text, with no prompt "
        f"lengths: give the records' .jsonl as --data (or prepare them with megapar-data "
        f"--sft-keys {args.sft_keys}), or drop {drop} to score every token"
    )


def prepared_sft_keys(prefix: str) -> list[str] | None:
    """The record keys a prepared dataset of prompt / response records was made with (its
    .json's ``sft``), or None: plain text, or metadata that cannot be read here (the dataset's
    own checks name it)."""
    try:
        with open(prefix + ".json", encoding="utf-8") as f:
            sft = json.load(f).get("sft")
        return [str(k) for k in sft["keys"]] if sft else None
    except (OSError, ValueError, AttributeError, TypeError, KeyError):
        return None


def _prepared_records(data) -> str | None:
    """The record keys ("prompt,response") of the prepared dataset(s) a run trained on (its
    recorded --data), where every part still names the same ones; None otherwise."""
    try:
        paths = data_paths(data)
    except ValueError:
        return None
    keys = {tuple(prepared_sft_keys(os.path.expanduser(p)) or ()) for p in paths if p}
    return ",".join(keys.pop()) if len(keys) == 1 and () not in keys else None


def trained_sft_keys(args, manifest: dict) -> str | None:
    """--sft-keys left out where the checkpoint trained with it (its ``train_config``), or on
    a dataset megapar-data prepared from such records (it asked for --sft-keys; a new user's),
    and raw --data is JSON Lines whose files each start with such a record, --jsonl-key not
    given: sets ``args.sft_keys`` to the checkpoint's, as --tokenizer and --seq-len default to
    what it trained with, and returns the line saying so (None where nothing was set)."""
    trained = (manifest.get("meta") or {}).get("train_config") or {}
    recorded = trained.get("sft_keys") or _prepared_records(trained.get("data"))
    if args.sft_keys is not None or args.jsonl_key is not None or not recorded:
        return None
    if not is_text(args.data):
        return None
    try:
        keys = parse_sft_keys(str(recorded))
        files = expand_inputs([os.path.expanduser(args.data)])
        if not files or not all(f.endswith(SFT_SUFFIXES) for f in files):
            return None
        if any(next(iter_records([f], keys), None) is None for f in files):
            return None
    except (OSError, ValueError):  # not records of those fields: read as text, as asked
        return None
    args.sft_keys = ",".join(keys)
    return (
        f"megapar-eval: --data {args.data} is read as prompt / response records (--sft-keys "
        f"{args.sft_keys}, as --load {args.load} trained): the loss is the responses'; pass "
        f"--jsonl-key FIELD to score a field's whole text instead"
    )


def text_tokenizer(args, manifest: dict) -> tuple[str, str]:
    """(spec, name in messages) of the tokenizer for raw --data: --tokenizer when given, else
    the one the checkpoint records (meta ``tokenizer``) while it loads from its recorded place
    with its recorded files. UsageError when the checkpoint records none (imported without one,
    or older), or its tokenizer no longer loads as recorded: --tokenizer names it then."""
    if args.tokenizer:
        return args.tokenizer, f"--tokenizer {args.tokenizer}"
    recorded = (manifest.get("meta") or {}).get("tokenizer")
    if not isinstance(recorded, dict) or not recorded.get("path"):
        raise UsageError(
            f"--data {args.data} is raw text, and --load {args.load} records no tokenizer to "
            f"tokenize it with (imported without one, or older); pass --tokenizer with the "
            f"one the model trained with"
        )
    path = str(recorded["path"])
    if recorded.get("sha256") and recorded_as_trained(recorded) is None:
        raise UsageError(
            f"--load {args.load} trained with the tokenizer {path}, which no longer loads from "
            f"there with the files it trained with (moved, deleted or changed); pass "
            f"--tokenizer with where that tokenizer is now"
        )
    return path, f"the tokenizer --load {args.load} trained with ({path})"


def data_tokenizer(args, indexed):
    """The tokenizer of megapar-eval's --data (`indexed`): for raw text the one that tokenized it
    (`tokenize_text`; the cached dataset's .json names where the first run on that text found
    the same files, which may have moved since: `data_tokenizer_spec`), else the dataset's own."""
    given = getattr(args, "text_tokenizer", None)
    spec = indexed.tokenizer_spec
    if given is not None:
        spec = data_tokenizer_spec(getattr(args, "data_shown", args.data), given, spec)
        return load_tokenizer(spec)
    # a prepared dataset whose tokenizer moved: how to give its copy, as megapar-train says
    return load_dataset_tokenizer(args.data, spec, getattr(args, "tokenizer", None))


def tokenize_text(args, manifest: dict, vocab_size: int, tokenized: list[str] | None = None) -> str:
    """The cached dataset prefix of raw --data (tokenized now unless the cache holds it; then
    its prefix is appended to `tokenized`), after the tokenizer is checked against the
    checkpoint's (`check_checkpoint_tokenizer`, as megapar-train --load checks raw text).
    UsageError when its token ids reach outside the model's `vocab_size` (at tp > 1 they would
    embed to zero vectors)."""
    spec, name = text_tokenizer(args, manifest)
    tokenizer = load_tokenizer(spec)
    check_checkpoint_tokenizer(args.load, manifest, tokenizer, args.data, name)
    args.text_tokenizer = spec  # `data_tokenizer`: the cache's .json may name moved files
    cfg = TrainConfig(
        data=args.data,
        tokenizer=spec,
        data_cache=args.data_cache or DEFAULT_CACHE,
        jsonl_key=args.jsonl_key or "text",
        sft_keys=args.sft_keys,
        allow_invalid_utf8=args.allow_invalid_utf8,
        progress=sys.stderr.isatty(),
    )
    notes: list[str] = []  # invalid UTF-8 replaced, files skipped for their type
    prefix = resolve_data_prefix(cfg, notes, tokenized)
    for note in notes:
        print(f"megapar-eval: {note}", file=sys.stderr)
    dataset = IndexedDataset(prefix)
    top = dataset.max_id()
    if top >= vocab_size:
        raise UsageError(
            f"--data {args.data} tokenized with {name} holds token id {top}, outside the "
            f"model's vocabulary of {vocab_size} ids (0-{vocab_size - 1}); pass --tokenizer "
            f"with the tokenizer the model trained with"
        )
    args.paragraphs_note = _paragraphs_note(args, len(dataset))
    return prefix


def _paragraphs_note(args, documents: int) -> str | None:
    """The note where raw plain text became more documents than it has non-empty files: each
    blank-line paragraph is one, as megapar-train reads it, where megapar-data keeps a file
    whole (without --split-lines), so that dataset's windows, and loss, differ
    (evaluation.md); beside records (.jsonl / .json / .parquet, a document each) it says so
    without a count. Printed once megapar-eval's checks pass."""
    if args.sft_keys is not None:
        return None
    try:
        files = expand_inputs([os.path.expanduser(args.data)])
    except (FileNotFoundError, ValueError):
        return None
    plain = [f for f in files if not f.endswith((".jsonl", ".json", ".parquet"))]
    how = (
        "as megapar-train reads text (megapar-data keeps each file one document unless "
        "--split-lines: a dataset made so scores other windows)"
    )
    if plain and len(plain) < len(files):
        return (
            f"megapar-eval: --data {args.data}: its .txt files are read as a document per "
            f"blank-line paragraph, {how}"
        )
    if not plain or documents <= sum(_holds_text(f) for f in plain):
        return None
    return (
        f"megapar-eval: --data {args.data}: read as {documents:,} documents, one per "
        f"blank-line paragraph, {how}"
    )


def _holds_text(path: str) -> bool:
    """Whether file `path` holds anything but white space (an empty or blank file is no
    document), read a block at a time until it does."""
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            if block.strip():
                return True
    return False
