"""From `--data` / `--tokenizer` / `--model` to datasets, the model config and batches.

In the launching process, before any worker starts: `resolve_model` resolves the model config
against the data's tokenizer from metadata alone (so model and layout mistakes are reported
before anything is read or written), `max_samples` bounds what the data can hold from file
sizes, and `prepare_data` tokenizes raw text into the cache. Workers then call
`build_datasets` and `batches`.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from megapar.checkpoint.format import MANIFEST
from megapar.checkpoint.hf import HFReader, causal_rows
from megapar.checkpoint.publish import has_checkpoint
from megapar.data import (
    GlobalBatchSampler,
    GPTDataset,
    IndexedDataset,
    MLMDataset,
    SFTDataset,
    asset_path,
    collate,
    ensure_dataset,
    load_tokenizer,
)
from megapar.data.blended import BlendedDataset, data_paths, parse_blend, unweighted_parts
from megapar.data.gpt_dataset import DocRange
from megapar.data.indexed import check_index_magic
from megapar.data.inputs import (
    INPUT_SUFFIXES,
    dataset_of,
    expand_inputs,
    is_raw_text,
    model_directory,
    parse_sft_keys,
    rename_hint,
    tokenized_datasets,
    unread_inputs,
)
from megapar.data.megatron import is_megatron_index
from megapar.data.preprocess import recorded_unknown_note
from megapar.data.sampler import older_epoch_order
from megapar.data.tokenizers import file_sha256, hf_dir_tokenizer
from megapar.models.config import CAUSAL_LM_TYPES, load_config_file
from megapar.models.recipes import resolve_model as recipe
from megapar.one_line_parser import shell_word, show_progress
from megapar.training.config import TrainConfig
from megapar.training.model_config import DEFAULT_MODEL, resolve_model_config
from megapar.training.tokenizer_checks import (
    check_blend_tokenizers,
    check_checkpoint_tokenizer,
    check_dataset_tokenizer,
    check_given_tokenizer,
    check_hf_tokenizer,
    take_moved_copy,
    unlike_vocab_note,
)
from megapar.training.usage import UsageError
from megapar.training.validate import explicit, given_now, named, unwritable_in
from megapar.training.validate_resume import checkpoint_manifest
from megapar.training.validate_sft import holds_records
from megapar.wording import counted

DEFAULT_TEXT = "shakespeare_sample.txt"


@dataclass
class DataPlan:
    """What the launcher resolved before starting workers."""

    prefix: str | None
    """Tokenized dataset prefix (PREFIX.bin / .idx / .json); None for a dry run without data."""
    model_config: dict
    """The model config (a dict with model_type), vocab size matched to the tokenizer."""
    tokenized: list[str] = field(default_factory=list)
    """Prefixes this run tokenized into --data-cache (`discard_tokenized` removes them when the
    run is refused for too little text)."""
    data_fingerprint: list[str] | None = None
    """Each --data part's `IndexedDataset.fingerprint`, recorded in checkpoints: a resume on
    other content is refused (`check_same_data`). None for a dry run without data."""
    sampler_state: dict | None = None
    """The data order --load's checkpoint saved (`GlobalBatchSampler.state_dict`), which the
    resumed run continues (`continue_order`); None on a fresh start."""
    start_step: int = 0
    """The step --load's checkpoint saved, after which the resumed run trains (0 on a fresh
    start)."""
    checked_load: str | None = None
    """The step directory of --load whose files the start-up checked (`checkpoint_manifest`),
    before the workers started: the ranks load that directory, checking the files they read as
    `load_verify` says. None on a fresh start."""
    load_verify: str = "size"
    """How the ranks check the files of `checked_load` they read (`worker_verify`): "size"
    (sizes and header shapes) where the launching process hashed every file, "sha256" under
    torchrun / Slurm, whose processes' start-ups check only the sizes."""


def resolve_data_prefix(
    cfg: TrainConfig,
    notes: list[str] | None = None,
    tokenized: list[str] | None = None,
    fingerprints: list[str] | None = None,
) -> str:
    """The dataset prefix for --data: tokenizing raw text (or the shipped sample) if needed
    (the prefixes tokenized now are appended to `tokenized`, every part's fingerprint to
    `fingerprints`).

    For a blend, every part is resolved and checked to share one tokenizer; the first
    part's prefix is returned (it stands for the vocabulary)."""

    paths = data_paths(cfg.data)
    prefixes = [_resolve_one(cfg, p, notes, tokenized) for p in paths]
    for prefix in prefixes:
        check_megatron_tokenizer_named(cfg, prefix)
    parts = [IndexedDataset(prefix, cfg.tokenizer) for prefix in prefixes]
    for path, part in zip(paths, parts):
        raw = is_raw_text(_text_or_prefix(cfg, path))
        if not raw:  # text: its cache key is --tokenizer's
            if os.path.isfile(part.prefix + ".json"):  # a copy of its tokenizer given
                take_moved_copy(part.tokenizer_spec, _named_tokenizer(cfg))
            _check_recorded_tokenizer(path or part.prefix, part)
        # every run that reads it, as when it was tokenized (megapar-data, this cache)
        unknown = recorded_unknown_note(part.meta, cfg.tokenizer if raw else None)
        if unknown and notes is not None:
            notes.append(f"warning: --data {path or part.prefix}: {unknown}")
    if fingerprints is not None:
        fingerprints.extend(part.fingerprint() for part in parts)
    check_blend_tokenizers([p or prefix for p, prefix in zip(paths, prefixes)], parts)
    return prefixes[0]


def blend_parts(cfg: TrainConfig) -> list[tuple[str, str]]:
    """A blended --data's drawn parts as (path given, prepared prefix), in order (their text
    tokenized already: `resolve_data_prefix`); [] for one dataset."""
    blend = parse_blend(cfg.data) if cfg.data is not None else None
    return [(path, _resolve_one(cfg, path)) for _, path in blend or []]


def _check_recorded_tokenizer(data: str, part: IndexedDataset) -> None:
    """The tokenizer prepared dataset `part` records still has the files it was made with
    (`check_dataset_tokenizer`); one that no longer loads is left to `data_tokenizer` (the
    first part) and `check_blend_tokenizers` (the others)."""
    if not os.path.isfile(part.prefix + ".json"):  # a Megatron-LM dataset records none
        return
    try:
        tokenizer = load_tokenizer(part.tokenizer_spec)
    except (OSError, ValueError):
        return
    check_dataset_tokenizer(data, part.tokenizer_spec, tokenizer)


def _resolve_one(
    cfg: TrainConfig,
    data: str | None,
    notes: list[str] | None = None,
    tokenized: list[str] | None = None,
) -> str:
    data = _text_or_prefix(cfg, data)
    if is_raw_text(data):
        report: dict = {}  # invalid UTF-8 bytes replaced, per file (above 0.1 %: an error)
        stats: dict = {}  # filled only when the text is tokenized now
        cache = os.path.expanduser(cfg.data_cache)
        try:
            prefix = ensure_dataset(
                data,
                cfg.tokenizer,
                cache,
                split_paragraphs=True,
                progress=show_progress(cfg.progress),
                report=report,
                jsonl_key=cfg.jsonl_key,
                allow_invalid_utf8=cfg.allow_invalid_utf8,
                stats=stats,
                sft_keys=parse_sft_keys(cfg.sft_keys) if cfg.sft_keys is not None else None,
            )
        except OSError as exc:  # a read-only cache is read where it holds the copy, not here
            if not unwritable_in(exc, cache):
                raise
            raise UsageError(
                f"--data-cache {cfg.data_cache} is not writable ({exc.strerror}) and holds no "
                f"tokenized copy of --data {data} for this tokenizer; choose a location you can "
                f"write to"
            ) from None
        if stats and tokenized is not None:
            tokenized.append(prefix)
        if notes is not None:
            notes.extend(
                f"warning: {path}: {counted(n, 'byte')} of invalid UTF-8 replaced with U+FFFD"
                for path, n in report.items()
            )
            skipped, tokenizer = unread_inputs([data])
            if skipped:
                notes.append(
                    f"--data {data}: {counted(len(skipped), 'file')} not read for "
                    f"{'its' if len(skipped) == 1 else 'their'} type "
                    f"(not {' / '.join(INPUT_SUFFIXES)}; e.g. {skipped[0]}){rename_hint(skipped)}"
                )
            if tokenizer:
                notes.append(
                    f"--data {data}: {counted(len(tokenizer), 'file')} of a tokenizer not read "
                    f"as text (e.g. {tokenizer[0]}; --tokenizer "
                    f"{shell_word(os.path.dirname(tokenizer[0]))} tokenizes with it)"
                )
        return prefix
    return data


def _text_or_prefix(cfg: TrainConfig, data: str | None) -> str:
    """A --data path (the shipped sample when None), checked to exist: text to tokenize, or a
    prepared prefix with its files."""
    data = os.path.expanduser(data if data is not None else asset_path(DEFAULT_TEXT))
    if is_raw_text(data):
        if not os.path.exists(data):
            raise FileNotFoundError(f"--data {data}: no such text file{_close_sibling(data)}")
        _refuse_what_is_not_text(data)
        if cfg.dry_run:  # the run reads it: a binary file, a directory of no text fail here
            try:
                expand_inputs([data])
            except FileNotFoundError as exc:  # it is there: not a corpus left on the cluster
                raise ValueError(str(exc)) from exc
        return data
    slash = data.endswith(("/", os.sep))  # a directory meant
    if slash and os.path.isfile(bare := data.rstrip("/" + os.sep)):
        raise FileNotFoundError(
            f"--data {data}: {bare} is a file, not a directory; drop the trailing /"
        )
    if slash and not os.path.exists(data):
        dirs = [d + os.sep for d in _close_dirs(data)[:2]]
        raise FileNotFoundError(
            f"--data {data}: no such directory"
            + (
                f"; did you mean {' or '.join(dirs)}?"
                if dirs
                else "; pass a directory of text, a text file or a prepared prefix"
            )
        )
    missing = missing_files(data)
    if missing:
        names = ", ".join(os.path.basename(m) for m in missing)
        if "data" in getattr(cfg, "from_checkpoint", ()):  # moved since: the user gave no --data
            raise FileNotFoundError(
                f"{named(cfg, 'data', data)}: {names} not found; pass "
                f"--data with where that data is now"
            )
        close = _close_sibling(data)
        raise FileNotFoundError(
            f"--data {data}: {names} not found{close}"
            + (
                ""
                if close
                else "; pass the prefix written by `megapar-data --output-prefix`, or raw text "
                "(a .txt, .jsonl, .json or .parquet file, or a directory of them)"
            )
        )
    return data


def _named_tokenizer(cfg: TrainConfig) -> str | None:
    """The tokenizer the run names (--tokenizer, or the --load checkpoint's, which trained with
    it), which may be a copy of a prepared dataset's moved tokenizer (`take_moved_copy`)."""
    return cfg.tokenizer if "tokenizer" in explicit(cfg) else None


def _nowhere(path: str) -> bool:
    """Whether a --data `path` names nothing: no file or directory, and no prefix's .bin."""
    path = os.path.expanduser(path)
    return not os.path.exists(path) and not os.path.exists(path + ".bin")


def _close_sibling(path: str) -> str:
    """The hint "; did you mean X?" for the names beside a --data `path` that does not exist,
    which are close to its own (`data/corpu` for `data/corpus`); "" for none."""
    parent, name = os.path.split(os.path.normpath(path))
    try:
        entries = [e for e in os.listdir(parent or ".") if not e.startswith(".")]
    except OSError:  # a directory misspelt (`dta/corpus.txt`): close ones that hold `name`
        close = [
            os.path.join(d, name)
            for d in _close_dirs(parent)
            if any(os.path.exists(os.path.join(d, name + e)) for e in ("", ".idx"))
        ]  # the file, or a dataset's prefix
        close = close or [d + os.sep for d in _close_dirs(path)]  # a directory of text meant
        return f"; did you mean {' or '.join(close[:2])}?" if close else ""
    stems = sorted(
        {e.rsplit(".", 1)[0] if e.endswith((".bin", ".idx", ".json")) else e for e in entries}
    )
    close = difflib.get_close_matches(name, stems, n=2, cutoff=0.8) or (
        difflib.get_close_matches(name.rsplit(".", 1)[0], stems, n=2, cutoff=0.8)
    )  # `data/corpus.jsn`: the prefix data/corpus
    said = " or ".join(os.path.join(parent, c) for c in close)
    if not close:  # a directory of text meant (`dtaa` for `data`)
        said = " or ".join(d + os.sep for d in _close_dirs(path)[:2])
    return f"; did you mean {said}?" if said else ""


def _close_dirs(path: str) -> list[str]:
    """The existing directories `path` may have meant: its missing parts (below the deepest
    that exists) each replaced by a close name beside it (`corpsu/sbu` for `corpus/sub`)."""
    found = [os.sep if os.path.isabs(path) else "."]
    for part in (p for p in os.path.normpath(path).split(os.sep) if p):
        nxt = []
        for d in found[:4]:
            here = os.path.join(d, part)
            if os.path.isdir(here):
                nxt.append(here)
                continue
            try:
                dirs = [e for e in os.listdir(d) if os.path.isdir(os.path.join(d, e))]
            except OSError:
                continue
            nxt += [os.path.join(d, c) for c in difflib.get_close_matches(part, dirs, 3, 0.6)]
        found = nxt
    return [os.path.normpath(d) for d in found]


def _refuse_what_is_not_text(path: str) -> None:
    """A ValueError naming the fix for a --data path that looks like text to tokenize but is a
    prepared dataset's file, a directory of datasets, a checkpoint or a Hugging Face model."""
    stem = dataset_of(path)
    if stem is not None:  # its .bin, .idx or .json
        raise ValueError(
            f"--data {path} is a file of the dataset {stem}; pass the prefix "
            f"without {os.path.splitext(path)[1]}: --data {shell_word(stem)}"
        )
    if not os.path.isdir(path):
        return
    names = os.listdir(path)
    if MANIFEST in names or "latest" in names or any(n.startswith("step_") for n in names):
        raise ValueError(
            f"--data {path} is a megapar checkpoint, not data; pass it to --load, "
            f"and the text or dataset it trained on to --data"
        )
    if model_directory(path) == "a Hugging Face model":
        raise ValueError(
            f"--data {path} is a Hugging Face model, not data; train from it with "
            f"megapar-train --from-hf {shell_word(path)} (or import it: megapar-convert "
            f"--from-hf {shell_word(path)} CKPT_DIR), and pass the text or dataset to --data"
        )
    found = tokenized_datasets(path)
    if found:
        shown = ", ".join(shell_word(p) for p in found[:3])
        try:
            text = bool(expand_inputs([path]))  # a dataset's own .json is not text
        except FileNotFoundError:
            text = False
        raise ValueError(
            f"--data {path} is a directory of tokenized datasets; pass a dataset's "
            f"prefix (e.g. --data {shown}), or a blend of them"
            if not text
            else f"--data {path} holds tokenized datasets beside its text; pass a dataset's "
            f"prefix (e.g. --data {shown}), or move the datasets out to train on the text"
        )


def missing_files(prefix: str) -> list[str]:
    """The files of dataset `prefix` that are not there (a Megatron-LM index needs no .json).
    Raises ValueError for an .idx without .json that is neither index (empty, cut short); a
    leading ``~`` is the home directory, as `IndexedDataset` reads it."""
    prefix = os.path.expanduser(prefix)
    if os.path.isfile(prefix + ".idx") and not os.path.exists(prefix + ".json"):
        check_index_magic(prefix + ".idx")
    needed = (".bin", ".idx") if is_megatron(prefix) else (".bin", ".idx", ".json")
    return [prefix + ext for ext in needed if not os.path.exists(prefix + ext)]


def is_megatron(prefix: str) -> bool:
    """A Megatron-LM dataset (MMIDIDX index): its .json (megapar's metadata) is optional."""

    return os.path.isfile(prefix + ".idx") and is_megatron_index(prefix + ".idx")


def check_megatron_tokenizer_named(cfg: TrainConfig, prefix: str) -> None:
    """A Megatron-LM dataset without megapar's .json does not record its tokenizer, so the run
    must name it: --tokenizer given (or taken from a --load checkpoint), or the --from-hf
    directory's own. ValueError naming the fix otherwise: the default gpt2 would give the
    model another vocabulary and end-of-document id, and the checkpoint another tokenizer."""
    if os.path.isfile(prefix + ".json") or not is_megatron(prefix):
        return
    if "tokenizer" in explicit(cfg) or (cfg.from_hf and hf_dir_tokenizer(cfg.from_hf)):
        return
    raise ValueError(
        f"--data {prefix} is a Megatron-LM dataset without megapar's {prefix}.json, so "
        f"nothing says which tokenizer made it; name it with --tokenizer (gpt2, a "
        f"tokenizer.json directory, a .model file, ...) rather than the default gpt2"
    )


def data_tokenizer(cfg: TrainConfig):
    """(vocabulary size, tokenizer) of --data without tokenizing anything: a prepared dataset's
    own (from its metadata; the first part of a blend), or --tokenizer for text."""

    data = _text_or_prefix(cfg, data_paths(cfg.data)[0])
    if is_raw_text(data):
        tokenizer = load_tokenizer(cfg.tokenizer)
        return tokenizer.vocab_size, tokenizer
    check_megatron_tokenizer_named(cfg, data)
    indexed = IndexedDataset(data, cfg.tokenizer)
    if not os.path.isfile(data + ".json"):  # a Megatron-LM dataset: --tokenizer is its own
        return indexed.vocab_size, load_tokenizer(indexed.tokenizer_spec)
    given = given_now(cfg)
    take_moved_copy(indexed.tokenizer_spec, _named_tokenizer(cfg))  # its files copied elsewhere
    named = cfg.tokenizer if "tokenizer" in given else None
    tokenizer = load_dataset_tokenizer(data, indexed.tokenizer_spec, named)
    check_dataset_tokenizer(data, indexed.tokenizer_spec, tokenizer)
    # a --tokenizer the checkpoint recorded is not compared: `check_checkpoint_tokenizer`
    # compares the data's with the tokenizer the checkpoint trained with (its files' sha256)
    if "tokenizer" in given:  # a resumed run's model keeps its checkpoint's tokenizer
        check_given_tokenizer(cfg.tokenizer, data, tokenizer, checkpoint=bool(cfg.load))
    return indexed.vocab_size, tokenizer


def load_dataset_tokenizer(data: str, spec: dict, given: str | None):
    """The tokenizer prepared dataset `data` records (`spec`), or ValueError in one line where
    it does not load: its files not there now (moved or deleted), with how to give a copy, or
    naming the directory `given` as --tokenizer that holds the SentencePiece model's copy; a
    --tokenizer `given` that is no copy of it is said as such (megapar-train's and
    megapar-eval's)."""
    try:
        return load_tokenizer(spec)
    except (OSError, ValueError) as exc:
        path = spec.get("path")
        copy = (  # a --tokenizer given as its copy whose files are not the recorded ones
            f"--tokenizer {given} is no copy of it (its files' sha256 are not the "
            f"ones the dataset records); "
            if given
            else ""
        )
        held = _model_copy_in(given, spec) if given else None
        form = (  # a SentencePiece model is one file
            "its file as --tokenizer FILE.model"
            if spec.get("kind") == "sentencepiece"
            else "its files as --tokenizer DIR"
        )
        if held is not None:  # a directory holding the SentencePiece model's copy
            raise ValueError(
                f"--data {data} was made with the tokenizer at {path}, which is not there now "
                f"(moved or deleted?); --tokenizer {given} is a directory holding its "
                f"copy: give the file, --tokenizer {shell_word(held)}"
            ) from None
        why = (
            f"which is not there now (moved or deleted?); {copy}give a copy of {form} (the "
            "same files: their sha256 is the dataset's), put them back "
            "there, or tokenize the text again with megapar-data --tokenizer where they are now"
            if isinstance(path, str) and not os.path.exists(os.path.expanduser(path))
            else f"which does not load now: {exc}"
        )
        raise ValueError(
            f"--data {data} was made with the tokenizer at {path}, {why} (a prepared "
            f"dataset keeps the tokenizer it was made with; another --tokenizer does not "
            f"replace it)"
        ) from None


EXACTLY_COUNTED = 1_000_000
"""Data bounded by fewer tokens than this, with a global batch of no more samples, is counted
exactly in moments (a global batch of 10^9 took minutes to refuse there): `max_samples` leaves
it to the run's exact line (an empty text's, one shorter than a window, a global batch too
large)."""


def max_samples(cfg: TrainConfig, model_type: str) -> int | None:
    """An upper bound on the samples --data can give, from file sizes alone (nothing is read):
    a token takes at least one byte of text (plus a begin and an end token per document, and a
    document at least one byte) or of a prepared .bin. Prompt / response records (--sft-keys,
    or a dataset of them) give a sample per record, so at most one per token. None where the
    run counts them exactly at once (`EXACTLY_COUNTED`: a bound of 1 sample for an empty file,
    2 for a 12-byte one, said more than they hold)."""

    tokens, sft = 0, cfg.sft_keys is not None
    for path in data_paths(cfg.data):
        data = _text_or_prefix(cfg, path)
        if is_raw_text(data):
            tokens += sum(3 * os.path.getsize(f) + 2 for f in expand_inputs([data]))
        else:
            tokens += os.path.getsize(data + ".bin")
            sft = sft or holds_records(data)
    if tokens < EXACTLY_COUNTED and cfg.global_batch_size <= EXACTLY_COUNTED:
        return None
    if model_type in CAUSAL_LM_TYPES and not sft:  # GPTDataset's count of those tokens
        return max(0, (tokens - 1) // cfg.seq_len)
    return tokens


def resolve_model(cfg: TrainConfig, notes: list[str] | None = None, manifest: dict | None = None):
    """The run's model config from --load / --model / --from-hf and the data's tokenizer (its
    metadata only: nothing is tokenized), checked against --seq-len. A dry run without its data
    here keeps the model's own vocabulary; on raw text it loads --tokenizer (nothing is
    tokenized) and takes its vocabulary, as the run does."""

    if cfg.load and manifest is None and (cfg.load_strict or has_checkpoint(cfg.load)):
        manifest = checkpoint_manifest(cfg.load)  # every file checked
    skipped, known = _dry_run_without_data(cfg)
    if skipped is not None and notes is not None:
        vocab = (
            "its tokenizer's vocabulary is the run's"
            if known
            else "the model keeps its own vocabulary"
        )
        notes.append(f"dry run: data skipped ({skipped}); {vocab} and no batch indices are shown")
        notes.extend(_sample_vocab_note(cfg, manifest))
    if skipped is not None and not known:
        return resolve_model_config(
            cfg, _own_vocab(cfg, manifest), cfg.tokenizer, manifest=manifest, notes=notes
        )
    vocab_size, tokenizer = data_tokenizer(cfg)
    data = _text_or_prefix(cfg, data_paths(cfg.data)[0])
    if manifest is not None:
        text = _text_tokenizer(cfg) if is_raw_text(data) else None
        check_checkpoint_tokenizer(cfg.load, manifest, tokenizer, data, text)
        unlike = unlike_vocab_note(
            cfg.load,
            manifest,
            tokenizer,
            manifest["model"]["vocab_size"],
            text or f"the tokenizer --data {data} was made with ({tokenizer.path})",
        )
        if unlike and notes is not None:
            notes.append(unlike)
    elif cfg.from_hf:
        check_hf_tokenizer(cfg, tokenizer, data, is_raw_text(data))
    gpt_vocab = causal_rows(tokenizer)
    return resolve_model_config(
        cfg,
        vocab_size,
        str(tokenizer.path),
        gpt_vocab,
        manifest,
        notes,
        {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eod_id},
        (list(tokenizer.appended), tokenizer.base_vocab_size),
    )


def _text_tokenizer(cfg: TrainConfig) -> str:
    """The --tokenizer that tokenizes raw text as a message names it: given, the value a --load
    checkpoint recorded (`named`), or the default."""
    if "tokenizer" in explicit(cfg):
        return named(cfg, "tokenizer")
    return f"the default --tokenizer {cfg.tokenizer} (not given)"


def prepare_data(
    cfg: TrainConfig, notes: list[str] | None = None, manifest: dict | None = None, config=None
) -> DataPlan:
    """Tokenize --data (when it is text) and pair it with the model config (`config`, or
    `resolve_model`'s). A dry run without its data here has no prefix."""
    if config is None:
        config = resolve_model(cfg, notes, manifest)
    tokenized: list[str] = []
    fingerprints: list[str] = []
    prefix = (
        None
        if _dry_run_without_data(cfg)[0]
        else resolve_data_prefix(cfg, notes, tokenized, fingerprints)
    )
    return DataPlan(
        prefix=prefix,
        model_config=config.to_dict(),
        tokenized=tokenized,
        data_fingerprint=fingerprints if prefix is not None else None,
    )


def discard_tokenized(tokenized: list[str]) -> None:
    """Remove the datasets this run tokenized into --data-cache (their prefixes, as
    `resolve_data_prefix` lists them), emptying the list: a text refused (too small to train
    or evaluate on, ids outside the model's vocabulary) leaves no cache behind; one an earlier
    run tokenized is not in the list, so it is kept."""
    for prefix in tokenized:
        for ext in (".bin", ".idx", ".json"):
            if os.path.exists(prefix + ext):
                os.remove(prefix + ext)
    tokenized.clear()


def _model_copy_in(directory: str, spec: dict) -> str | None:
    """The file of `directory` whose sha256 is the one a SentencePiece tokenizer `spec` (a
    prepared dataset's) records, or None (no such file, no directory, another kind)."""
    recorded = spec.get("sha256") or []
    directory = os.path.expanduser(directory)
    if spec.get("kind") != "sentencepiece" or len(recorded) != 1 or not os.path.isdir(directory):
        return None
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.endswith(".model") and os.path.isfile(path) and file_sha256(path) == recorded[0]:
            return path
    return None


def _dry_run_without_data(cfg: TrainConfig) -> tuple[str | None, bool]:
    """Why a dry run goes on without data (None when it has some, or is no dry run): the
    cluster's corpus is often not on the rehearsing machine, and the shipped sample never
    stands in for the job's data; and whether it still knows the run's tokenizer: every --data
    path is there (raw text is tokenized by --tokenizer, loaded but not run; a prepared dataset
    names its own), or no --data is given beside a --tokenizer, so the model takes the run's
    vocabulary and the tokenizer checks run as in the run."""
    if not cfg.dry_run:
        return None, True
    if cfg.data is None:  # a --tokenizer given is the job's (its raw text's, or its dataset's)
        return "no --data given", "tokenizer" in explicit(cfg)
    raw: list[str] = []
    paths = data_paths(cfg.data)
    try:
        for path in paths:
            if is_raw_text(_text_or_prefix(cfg, path)):
                raw.append(str(path))
    except FileNotFoundError as exc:  # the rehearsal goes on; the run would stop here
        absent = f"{exc}; the run itself stops at once without it: put it at that path on the"
        return _raw_text_reason(raw, len(paths)) or f"{absent} job's machines", False
    return _raw_text_reason(raw, len(paths)), True


def _raw_text_reason(raw: list[str], parts: int) -> str | None:
    """Why a dry run skips the --data parts `raw` (raw text, each named; `parts`: how many
    --data has), or None for none."""
    if not raw:
        return None
    if parts == 1:
        parts_are = f"--data {raw[0]} is"
    else:
        parts_are = ("" if len(raw) == parts else f"{len(raw)} of ") + f"--data's {parts} parts"
        parts_are += " is" if len(raw) == 1 else " are"
    named = "" if parts == 1 else f" ({', '.join(raw)})"
    return (
        f"{parts_are} raw text{named}, which a rehearsal does not tokenize: it writes nothing, and "
        f"a corpus can take hours; tokenize {'it' if len(raw) == 1 else 'each'} once with "
        f"megapar-data and rehearse with its --output-prefix to see batch indices"
    )


def _sample_vocab_note(cfg: TrainConfig, manifest: dict | None) -> list[str]:
    """A dry run of a recipe without --data keeps the recipe's vocabulary, but the same command
    run for real trains on the shipped sample with --tokenizer's: the note saying so where the
    two differ (the real run's model is then of another size); none for a checkpoint's or
    --from-hf's model, whose vocabulary both keep, nor where --tokenizer is given (the dry run
    takes its vocabulary too: `_dry_run_without_data`)."""
    if cfg.data is not None or manifest is not None or cfg.from_hf or "tokenizer" in explicit(cfg):
        return []
    config = recipe(cfg.model or DEFAULT_MODEL)  # the model the dry run keeps
    own, tokenizer = config.vocab_size, load_tokenizer(cfg.tokenizer)
    if _fixed_vocab(cfg):  # kept by the real run too, unless the sample's tokenizer needs more
        needed = (
            causal_rows(tokenizer) if config.model_type in CAUSAL_LM_TYPES else tokenizer.vocab_size
        )
        if needed <= own:
            return []
        return [
            f"dry run: the same command without --dry-run trains on megapar's shipped sample, "
            f"tokenized with --tokenizer {cfg.tokenizer}, which needs {needed:,} token ids, "
            f"and is refused: the model config {cfg.model} has vocab_size {own:,}; give --data "
            f"tokenized with the model's tokenizer (and --tokenizer)"
        ]
    theirs = tokenizer.vocab_size
    if theirs == own:
        return []
    whose = "its config's default" if _model_file(cfg) else "its recipe's"
    return [
        f"dry run: the same command without --dry-run trains on megapar's shipped sample, "
        f"tokenized with --tokenizer {cfg.tokenizer}, whose vocabulary of {theirs:,} the model "
        f"takes in place of {whose} {own:,} rehearsed here; give --data to rehearse the "
        f"job's"
    ]


def _model_file(cfg: TrainConfig) -> str | None:
    """--model's config file (a directory's config.json), or None for a recipe's name."""
    path = os.path.expanduser(cfg.model) if cfg.model else None
    if path is None or not os.path.exists(path):
        return None
    return os.path.join(path, "config.json") if os.path.isdir(path) else path


def _fixed_vocab(cfg: TrainConfig) -> bool:
    """Whether --model is a config file (or directory) that names its vocab_size, which the
    real run keeps whatever the tokenizer (a recipe takes the tokenizer's)."""
    path = _model_file(cfg)
    return path is not None and "vocab_size" in load_config_file(path)


def _own_vocab(cfg: TrainConfig, manifest: dict | None) -> int:
    """The vocabulary the model itself declares (a checkpoint's, --from-hf's or the recipe's),
    which a dry run without data keeps (training takes the data's tokenizer's)."""

    if manifest is not None:
        return int(manifest["model"]["vocab_size"])
    if cfg.from_hf:
        return HFReader(cfg.from_hf).config.vocab_size
    return recipe(cfg.model or DEFAULT_MODEL).vocab_size


def _samples(lengths, seq_len: int, model_type: str, records: bool = False):
    """Running count of samples the first k documents (token counts `lengths`) hold: GPT
    windows of a concatenated stream, MLM chunks of up to seq_len - 3 tokens per document, or
    (`records`: prompt / response records) one per document."""

    if records:
        return np.arange(1, len(lengths) + 1)
    if model_type in CAUSAL_LM_TYPES:
        return np.maximum(np.cumsum(lengths) - 1, 0) // seq_len
    body, most = np.maximum(lengths - 1, 0), max(1, seq_len - 3)
    return np.cumsum(body // most + (body % most >= 2))


def split_for_training(cfg: TrainConfig, indexed, model_type: str):
    """(train_docs, val_docs, note) for a run; val_docs None means no validation.

    The validation split is `--val-fraction` of the documents, in the order of a seeded
    permutation, extended with further documents until it holds one global batch (so it can be
    evaluated). If that would take more than half the data, or leave the training split short
    of one global batch, the run trains without validation, and `note` says so. A validation
    split never stops a run."""

    if cfg.val_fraction <= 0:
        return None, None, None
    n = indexed.num_docs
    if n < 2:
        return (
            None,
            None,
            (
                "no validation split: the data is one document; train on several "
                "(paragraphs separated by blank lines, or megapar-data --split-lines)"
                " or pass --val-fraction 0"
            ),
        )
    perm = np.random.default_rng(cfg.seed).permutation(n)
    lengths = np.diff(indexed.doc_offsets)[perm].astype(np.int64)
    records = indexed.prompt_lengths is not None
    counts = _samples(lengths, cfg.seq_len, model_type, records)
    rest = _samples(lengths[::-1], cfg.seq_len, model_type, records)[::-1]  # in perm[k:]
    want = max(1, int(round(n * cfg.val_fraction)))
    k = max(want, int(np.searchsorted(counts, cfg.global_batch_size)) + 1)
    if k >= n or k > max(want, n // 2) or rest[k] < cfg.global_batch_size:
        batch = f"a validation batch of {cfg.global_batch_size} x {cfg.seq_len} tokens"
        if counts[-1] >= 2 * cfg.global_batch_size:  # enough tokens, in too few documents
            why, fix = (
                f"its {counted(n, 'document')} are too few or too uneven to hold out whole "
                f"ones for {batch} besides training",
                "split the text into more documents: paragraphs separated by blank lines, or "
                "megapar-data --split-lines",
            )
        else:
            why, fix = (
                f"the data is too small for {batch} besides training",
                "use more data, a shorter --seq-len or a smaller --global-batch-size",
            )
        return None, None, f"no validation split: {why}; training without validation ({fix})"
    note = None
    if k > want:
        note = (
            f"validation split: {counted(k, 'document')} "
            f"({counted(int(lengths[:k].sum()), 'token')}) "
            f"instead of "
            f"{want}, so it holds one global batch"
        )
    return np.sort(perm[k:]).astype(np.int64), np.sort(perm[:k]).astype(np.int64), note


def build_datasets(cfg: TrainConfig, prefix: str, model_type: str, notes: list[str] | None = None):
    """(train, val) datasets: GPT windows or BERT MLM samples, split by documents; for a
    blended --data, each part is split and the parts are blended by weight. A blend validates
    only when every part has a validation split; when one has none, no part holds documents
    out (they would be held out for nothing), and the notes name the part."""

    blend = parse_blend(cfg.data) if cfg.data is not None else None
    if blend is None:
        return _build_one(cfg, prefix, model_type, notes)
    prefixes = [_resolve_one(cfg, p) for _, p in blend]
    records = [holds_records(p) for p in prefixes]
    if any(records) and not all(records):
        raise ValueError(
            f"--data blends prompt / response records ({blend[records.index(True)][1]}) with "
            f"text ({blend[records.index(False)][1]}); blend datasets of one kind (tokenize "
            f"the records with megapar-data --sft-keys, the text without)"
        )
    weights, names = [w for w, _ in blend], [p for _, p in blend]
    part_notes: list[str] = []
    parts = []
    for name, part in zip(names, prefixes):
        said: list[str] = []
        parts.append(_build_one(cfg, part, model_type, said))
        part_notes += [f"{name}: {note}" for note in said]
    val = None
    if all(v is not None and len(v) > 0 for _, v in parts):
        val = BlendedDataset([v for _, v in parts], weights, names, cfg.seed)
    elif any(v is not None for _, v in parts):
        whole = replace(cfg, val_fraction=0.0)
        parts = [_build_one(whole, part, model_type) for part in prefixes]
        part_notes = [n for n in part_notes if "no validation split" in n]
    if val is None and cfg.val_fraction > 0:
        part_notes.append(
            "the blend validates only when every part has a validation split: training "
            "without validation, on all of every part"
        )
    if notes is not None:
        notes.extend(
            f"{name}: weight 0 in --data, so it is left out of the blend (not drawn, not read"
            + ("; no such file or prefix there either" if _nowhere(name) else "")
            + ")"
            for name in unweighted_parts(cfg.data)
        )
        notes.extend(part_notes)
        twice = [n for i, n in enumerate(names) if n in names[:i] or prefixes[i] in prefixes[:i]]
        notes.extend(  # allowed, as Megatron allows it: two independent draws of one dataset
            f"{name}: given more than once in --data, so its samples are drawn by as many "
            f"independent orders (some twice before others once); give it once with the "
            f"weights summed to draw each sample once per pass"
            for name in dict.fromkeys(twice)
        )
    train = BlendedDataset([t for t, _ in parts], weights, names, cfg.seed)
    return train, val


def training_documents(
    cfg: TrainConfig, prefix: str, model_type: str, val_fraction: float, global_batch_size: int
) -> list:
    """The documents each part of --data trains on (a sorted array, or None for all of it),
    as `build_datasets` splits them under `cfg` with this `val_fraction` and
    `global_batch_size` (the split grows to hold one global batch): two settings that give
    equal lists hold out the same documents, so a resume may change one for the other."""

    cfg = replace(cfg, val_fraction=val_fraction, global_batch_size=global_batch_size)
    blend = parse_blend(cfg.data) if cfg.data is not None else None
    prefixes = [prefix] if blend is None else [_resolve_one(cfg, p) for _, p in blend]
    splits = [
        split_for_training(cfg, IndexedDataset(p, cfg.tokenizer), model_type) for p in prefixes
    ]
    if blend is not None and not all(val is not None for _, val, _ in splits):
        return [None] * len(splits)  # a blend validates on every part or on none
    return [train for train, _, _ in splits]


def _build_one(cfg: TrainConfig, prefix: str, model_type: str, notes: list[str] | None = None):
    indexed = IndexedDataset(prefix, cfg.tokenizer)
    train_docs, val_docs, note = split_for_training(cfg, indexed, model_type)
    if note and notes is not None:
        notes.append(note)
    if indexed.prompt_lengths is not None:
        if model_type not in CAUSAL_LM_TYPES:
            raise ValueError(
                f"--data {prefix} holds prompt / response records, which train a causal "
                f"language model, and the model is {model_type}; use a GPT / Llama-style model"
            )

        def make(docs: DocRange) -> GPTDataset | MLMDataset | SFTDataset:
            return SFTDataset(indexed, cfg.seq_len, doc_range=docs)

    elif model_type in CAUSAL_LM_TYPES:

        def make(docs: DocRange) -> GPTDataset | MLMDataset | SFTDataset:
            return GPTDataset(indexed, cfg.seq_len, doc_range=docs)

    else:
        special = load_tokenizer(indexed.tokenizer_spec)

        def make(docs: DocRange) -> GPTDataset | MLMDataset | SFTDataset:
            return MLMDataset(indexed, cfg.seq_len, special, cfg.seed, doc_range=docs)

    train = make(train_docs)
    val = make(val_docs) if val_docs is not None else None
    if isinstance(train, SFTDataset) and notes is not None:
        notes.append(_records_note(cfg, indexed, [train, val]))
    return train, val


def _records_note(cfg: TrainConfig, indexed, parts) -> str:
    """The log's one line on a dataset of prompt / response records: how many, how they become
    samples, and how many were truncated (`SFTDataset.truncated`, `unlabelled`)."""
    parts = [p for p in parts if p is not None]
    truncated = sum(p.truncated for p in parts)
    unlabelled = sum(p.unlabelled for p in parts)
    keys = ",".join(indexed.sft_keys)
    left = (  # an empty response still learns its end of text: not counted
        f"; {unlabelled:,} with no response token to learn (a prompt that fills the sample, "
        f"or a record of no text)"
        if unlabelled
        else ""
    )
    every = f"of all {indexed.num_docs:,}, " if len(parts) > 1 else ""  # both splits counted
    cut = (
        f"{every}{truncated:,} longer than --seq-len + 1 = {cfg.seq_len + 1} tokens truncated "
        f"at the end{left}"
        if truncated
        else f"none longer than --seq-len + 1 = {cfg.seq_len + 1} tokens{left}"
    )
    mean = (
        "; the loss the mean over the global batch's response tokens (--loss-mean token, TRL's "
        "and torchtune's)"
        if cfg.loss_mean == "token"
        else "; --loss-mean microbatch: each micro-batch's mean, averaged (one with no response "
        "token counts as 0)"
    )
    held = (
        f", {len(parts[0]):,} to train on and {len(parts[1]):,} held out for validation"
        if len(parts) > 1
        else ""
    )
    return (
        f"supervised fine-tuning: {counted(indexed.num_docs, 'record')} ({keys}){held}, one "
        f"right-padded sample each, the loss on the responses only; {cut}{mean}"
    )


def planned_samples(sampler: GlobalBatchSampler, steps: int):
    """Indices of the samples `steps` global batches from the sampler's position draw."""

    g, out = sampler.global_batch_size, []
    epoch, start = sampler.position
    while steps > 0:
        take = min(steps, (sampler.dataset_len - start) // g)  # >= 1: a position has a batch
        out.append(sampler.epoch_order(epoch)[start : start + take * g])
        steps -= take
        epoch, start = epoch + 1, 0
    return np.concatenate(out)


def make_sampler(cfg: TrainConfig, dataset, dp: int, dp_rank: int, shuffle=True):
    """The run's `GlobalBatchSampler` of `dataset` for dp rank `dp_rank` of `dp`, at the start
    of the data order (a resumed run then calls `continue_order`)."""
    blend = getattr(dataset, "shuffled", False)  # comes shuffled, another order each epoch
    return GlobalBatchSampler(
        len(dataset),
        cfg.global_batch_size,
        cfg.micro_batch_size,
        dp,
        dp_rank,
        cfg.seed,
        shuffle=shuffle and not blend,
        epoch_offset=shuffle and blend,
    )


def continue_order(
    cfg: TrainConfig, sampler: GlobalBatchSampler, saved: dict | None, step: int = 0
) -> list[str]:
    """Put `sampler` where a run resumed from a checkpoint of `step` whose data order is `saved`
    (its sampler's `state_dict`; None: none recorded) takes its next global batch: the saved
    position, or the start of the order when --allow-data-change resumes on data of another
    size, or when the checkpoint of a trained step records none (`engine.save`, whose caller fed
    the batches, or an import). Returns the notes that say so (another global batch, the order
    started anew)."""
    if not saved:
        return (
            [
                f"the checkpoint of step {step} records no data order (it was saved by "
                f"engine.save, whose caller fed the batches, or imported): the data order "
                f"starts at its first sample, as a fresh run's"
            ]
            if step
            else []
        )
    if cfg.allow_data_change and saved.get("dataset_len") != sampler.dataset_len:
        return [
            f"--allow-data-change: the data order starts anew on --data's "
            f"{sampler.dataset_len} samples (the checkpoint's data had "
            f"{saved.get('dataset_len')})"
        ]
    sampler.load_state_dict(saved)
    epoch, sample = sampler.position
    notes = []
    if older_epoch_order(sampler, saved):
        notes.append(
            f"the checkpoint resumes a blend in epoch {epoch} and does not record its epoch "
            f"order (an older megapar's): a megapar before dae73c03 (2026-12-01) drew every "
            f"epoch of a blend as the first, this one continues each part's draws, so the "
            f"samples from here may differ from those the older run would have drawn (not for a "
            f"checkpoint of dae73c03 to 2b3d7ca2, the same day, whose megapar drew them so)"
        )
    saved_batch = saved.get("global_batch_size", sampler.global_batch_size)
    if saved_batch != sampler.global_batch_size:
        notes.append(
            f"global batch {sampler.global_batch_size} (the checkpoint's: {saved_batch}): the "
            f"data order continues at sample {sample} of epoch {epoch}"
        )
    return notes


def _same(batch: dict) -> dict:
    return batch


def batches(dataset, sampler, device: torch.device, transform=None):
    """Endless: per global batch, this rank's micro-batches as dicts of tensors on `device`.

    Collation is a few index lookups per sample (profiled: not in the top 20 of the default
    job's CPU time), so it stays in the training process; on CUDA the batch goes through pinned
    memory and an asynchronous copy, so the next step's upload overlaps the compute queue.
    `transform`: a function of each collated micro-batch (on the host) before its copy
    (--eod-mask-loss's labels)."""
    cuda = device.type == "cuda"
    while True:
        for micro_batches in sampler:
            yield [
                {
                    k: (v.pin_memory().to(device, non_blocking=True) if cuda else v.to(device))
                    for k, v in (transform or _same)(collate([dataset[i] for i in mb])).items()
                }
                for mb in micro_batches
            ]
