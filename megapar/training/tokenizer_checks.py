"""The tokenizer checks: a --tokenizer given with a prepared dataset names the dataset's own,
the data's tokenizer is the one a --load checkpoint trained with (megapar-train and
megapar-eval both run them), and the one a --from-hf directory holds (megapar-train, which
takes that directory's as its default --tokenizer)."""

from __future__ import annotations

import json
import os

from megapar.data import load_tokenizer
from megapar.data.hf_tokenizer import transformers_difference
from megapar.data.inputs import is_raw_text
from megapar.data.preprocess import file_sha256
from megapar.data.tokenizers import (
    Tokenizer,
    encodes_alike,
    hf_dir_tokenizer,
    moved_to,
    same_tokenizer,
    sentencepiece_dir_bos,
    tokenizer_files,
)
from megapar.one_line_parser import shell_word
from megapar.training.validate import UsageError, explicit

HF_TOKENIZER_FILES = "tokenizer.json, vocab.json + merges.txt, or tokenizer.model"
"""The tokenizer files a transformers directory can hold (`hf_dir_tokenizer`), as named in
messages."""


def data_tokenizer_spec(data, given: str, spec: dict) -> dict:
    """The tokenizer of a run's data (`spec`: its dataset's .json) as a checkpoint records it;
    for raw text `data`, the run's own --tokenizer `given` (the same files): a text tokenized
    into the cache serves every run that gives the same text and tokenizer files (the key is
    their content), and its .json names the files where the first of them found them: moved
    or deleted since, they are still `given`'s files."""
    if isinstance(data, str) and is_raw_text(data):
        own = load_tokenizer(given)
        try:
            first = load_tokenizer(spec)
        except (OSError, ValueError):  # the first run's files are gone from where it found them
            return own.spec()
        if same_tokenizer(own, first):
            return own.spec()
    return spec


def check_given_tokenizer(given: str, data: str, tokenizer, checkpoint: bool = False) -> None:
    """A --tokenizer given with a prepared dataset `data` (whose own is `tokenizer`) names the
    same files (wherever they lie): ValueError naming both otherwise, since the dataset keeps
    its own. megapar-train and megapar-eval both call this; `checkpoint`: the model is a
    checkpoint's (megapar-eval), whose tokenizer the data must keep, so re-preparing it with
    `given` is no fix."""
    if not same_tokenizer(load_tokenizer(given), tokenizer):
        again = (
            ""
            if checkpoint
            else f", or prepare the data again with megapar-data --tokenizer {shell_word(given)}"
        )
        raise ValueError(
            f"--tokenizer {given} is not the tokenizer --data {data} was made with "
            f"({tokenizer.path}): a prepared dataset keeps its own; leave "
            f"--tokenizer out (it is for raw text and a Megatron-LM dataset without "
            f"megapar's .json){again}"
        )


def take_moved_copy(spec: dict, given: str | None) -> bool:
    """Where the tokenizer a prepared dataset records (`spec`: its .json's ``tokenizer``) no
    longer loads with the files it was made with (moved, deleted or changed since) and the
    run's --tokenizer `given` has those very files (their sha256, as the dataset recorded
    them), read it from `given` for the rest of this process (`moved_to`): a dataset copied to
    another machine with its tokenizer beside it. Returns whether it did."""
    recorded = spec.get("sha256")
    if not given or not recorded or not isinstance(spec.get("path"), str):
        return False
    try:
        tok = load_tokenizer(spec)
        if tok.kind == spec.get("kind") and _digests(tok) == list(recorded):
            return False  # where it was, as it was
    except (OSError, ValueError):
        pass
    try:
        copy = load_tokenizer(given)
    except (OSError, ValueError):
        return False
    if copy.kind != spec.get("kind") or _digests(copy) != list(recorded):
        return False
    moved_to(spec["path"], copy.spec()["path"])
    return True


def _digests(tok: Tokenizer) -> list[str]:
    """The sha256 of `tok`'s files, as datasets and checkpoints record them."""
    return [file_sha256(p) for p in tokenizer_files(tok)]


def check_dataset_tokenizer(data: str, spec: dict, tokenizer: Tokenizer) -> None:
    """The tokenizer a prepared dataset `data` loads from its recorded path (`spec`: its .json's
    ``tokenizer``, `tokenizer`: loaded from it) still has the files the dataset was made with:
    their sha256 as megapar-data recorded them. UsageError naming the dataset, the path and the
    fix otherwise (its token ids would be other tokens). A dataset that records no sha256
    (made before they were recorded, or a Megatron-LM dataset) is not checked."""
    recorded = spec.get("sha256")
    if not recorded:
        return
    digests = _digests(tokenizer)
    if tokenizer.kind == spec.get("kind") and digests == list(recorded):
        return
    path = str(spec.get("path"))
    raise UsageError(
        f"--data {data} was made with the tokenizer at {path}, whose files changed since the "
        f"dataset was made (sha256 {','.join(d[:12] for d in recorded)} then, "
        f"{','.join(d[:12] for d in digests)} now): its token ids would be other tokens; "
        f"restore the tokenizer the dataset was made with at {path} (or give a copy of its "
        f"files as --tokenizer DIR), or tokenize the text again with megapar-data --tokenizer "
        f"{shell_word(path)}"
    )


def recorded_as_trained(recorded: dict) -> Tokenizer | None:
    """The tokenizer a checkpoint records (meta ``tokenizer``: its spec and files' sha256) as it
    trained: loaded from its recorded place with its files unchanged; None where it does not
    load or its files changed since."""
    try:
        tok = load_tokenizer(recorded)
        unchanged = _digests(tok) == recorded["sha256"]
    except (OSError, ValueError):
        return None
    return tok if unchanged else None


def unlike_vocab_note(
    load: str | None, manifest: dict, tokenizer, vocab_size: int, name: str
) -> str | None:
    """The start-up note for a tokenizer (`name` in messages) of a --load checkpoint that records
    none, when its vocabulary is far smaller than the model's `vocab_size`: a model's vocabulary
    is its tokenizer's, padded at most by a few hundred ids, so this is likely another
    tokenizer, whose ids stay in range and mean other tokens. None otherwise: a checkpoint that
    records its tokenizer is checked against it (`check_checkpoint_tokenizer`)."""
    recorded = (manifest.get("meta") or {}).get("tokenizer")
    if isinstance(recorded, dict) and recorded.get("path"):
        return None
    if tokenizer.vocab_size + max(1024, vocab_size // 64) >= vocab_size:
        return None
    return (
        f"{name} has {tokenizer.vocab_size:,} ids and --load {load}'s model "
        f"{vocab_size:,}, which records no tokenizer: a model's vocabulary is its tokenizer's "
        f"(padded by at most a few hundred), so this is likely not the one it trained with "
        f"and its ids would be other tokens; pass --tokenizer with the model's own"
    )


def matches_recorded(recorded: dict, tokenizer) -> bool:
    """Whether `tokenizer` is the one a checkpoint records (meta ``tokenizer`` with its files'
    sha256): the same kind and files (wherever they lie now), or, the recorded one at hand
    (`recorded_as_trained`, loaded only then), one that encodes alike (`encodes_alike`: the
    same tokenizer in another format). Where the recorded files are gone,
    another format is taken on its vocabulary size, end-of-document id and, where the record
    has it, the id that starts each document (a SentencePiece model and the tokenizer.json of
    it that adds a BOS have the same sizes)."""
    digests = _digests(tokenizer)
    same_kind = tokenizer.kind == recorded.get("kind")
    if same_kind and digests == recorded["sha256"]:
        return True
    trained = recorded_as_trained(recorded)
    if trained is not None:
        return encodes_alike(trained, tokenizer)
    sizes = (recorded.get("vocab_size"), recorded.get("eod_id"))
    same_bos = "bos_id" not in recorded or recorded["bos_id"] == tokenizer.bos_id
    # another format of the same sizes, the recorded files gone: cannot tell them apart further
    return not same_kind and same_bos and sizes == (tokenizer.vocab_size, tokenizer.eod_id)


def check_checkpoint_tokenizer(
    load: str | None, manifest: dict, tokenizer, data: str, text_tokenizer: str | None = None
) -> None:
    """The tokenizer of `data` is the one the --load checkpoint trained with: the same kind and
    files (their sha256, wherever they lie now) as the checkpoint records in meta
    ``tokenizer``, or the recorded tokenizer, still as recorded, encodes alike
    (`encodes_alike`: the same tokenizer in another format, e.g. the tokenizer.json of an
    export re-imported with --from-hf). A recorded tokenizer that no longer loads as recorded
    is compared by kind, vocabulary size and end-of-document id only. UsageError naming both
    and the fix otherwise (the same ids would be other tokens to the model). `text_tokenizer`
    names the --tokenizer that tokenizes `data` when it is raw text. A checkpoint that records
    no tokenizer (imported without one, or older) is not checked. megapar-train --load and
    megapar-eval both call this."""

    recorded = (manifest.get("meta") or {}).get("tokenizer")
    if not isinstance(recorded, dict) or not recorded.get("sha256"):
        return
    if matches_recorded(recorded, tokenizer):
        return
    trained = recorded_as_trained(recorded)
    digests = _digests(tokenizer)
    theirs = recorded.get("path")
    if text_tokenizer:
        ours, fix = (
            f"--data {data} is tokenized with {text_tokenizer}",
            f"pass --tokenizer {shell_word(str(theirs))}"
            + ("" if trained is not None else " (or where its recorded files are now)"),
        )
    else:
        ours, fix = (
            f"--data {data} was made with {tokenizer.path}",
            f"use data made with megapar-data --tokenizer {shell_word(str(theirs))}",
        )
    same_path = str(tokenizer.path) == str(theirs)
    changed = " (sha256 " + ",".join(d[:12] for d in digests) + ", changed since)"
    raise UsageError(
        f"--load {load} trained with the tokenizer {theirs} (sha256 "
        f"{','.join(d[:12] for d in recorded['sha256'])}) but {ours}"
        f"{changed if same_path else ''}"
        f": its token ids would be other tokens to the model; {fix}"
    )


def default_to_hf_tokenizer(cfg) -> list[str]:
    """With --from-hf DIR and no --tokenizer (given or taken from a --load checkpoint), DIR's own
    tokenizer (`hf_dir_tokenizer`) becomes --tokenizer, so raw text is tokenized as the model
    learned. Returns the start-up note saying so, or saying that DIR holds no tokenizer and the
    default is used."""
    if not cfg.from_hf or "tokenizer" in explicit(cfg):
        return []
    own = hf_dir_tokenizer(cfg.from_hf)
    if own is None:
        return [
            f"--from-hf {cfg.from_hf} holds no tokenizer ({HF_TOKENIZER_FILES}): raw text is "
            f"tokenized with the default --tokenizer {cfg.tokenizer} (a prepared --data keeps "
            f"its own); pass --tokenizer with the model's own if it is another"
        ]
    cfg.explicit = frozenset(explicit(cfg))  # a config built in code: --tokenizer stays not given
    cfg.tokenizer = own
    bos = sentencepiece_dir_bos(cfg.from_hf)
    return [
        f"--tokenizer not given: using --from-hf {cfg.from_hf}'s own tokenizer ({own})"
        + (f"; {bos}" if bos else "")
    ]


def check_hf_tokenizer(cfg, tokenizer, data: str, raw_text: bool) -> None:
    """The tokenizer of `data` (`tokenizer`: --tokenizer's for raw text, else the prepared
    dataset's own) is the one the --from-hf directory holds: the same files, or the same ids
    (`encodes_alike`: e.g. GPT-2's BPE and the tokenizer.json an export made of it). UsageError
    naming both (their sha256) and the fix otherwise: the model learned that tokenizer's ids. A
    directory whose tokenizer.json (or vocab.json + merges.txt) transformers' AutoTokenizer
    reads otherwise than megapar (`transformers_difference`: e.g. GPT-2's files in a Qwen2
    directory, which transformers splits as Qwen2's) is refused too, naming the difference. A
    directory without a tokenizer is not checked."""
    spec = hf_dir_tokenizer(cfg.from_hf)
    if spec is None:
        return
    try:
        own = load_tokenizer(spec)
    except (OSError, ValueError) as exc:
        raise UsageError(
            f"--from-hf {cfg.from_hf}: its tokenizer does not load ({exc}), so the data "
            f"cannot be checked against it; repair or remove its tokenizer files"
        ) from None
    differs = transformers_difference(cfg.from_hf, own)
    if differs:
        raise UsageError(
            f"--from-hf {cfg.from_hf}: transformers reads its tokenizer files otherwise than "
            f"megapar does for this {_model_type(cfg.from_hf)} model ({differs}), so the "
            f"model's token ids and megapar's would differ; put the model's own tokenizer "
            f"there (AutoTokenizer.from_pretrained(<the model's name>).save_pretrained("
            f"{shell_word(cfg.from_hf)})), or train another tokenizer from --model with "
            f"--tokenizer"
        )
    if same_tokenizer(own, tokenizer) or encodes_alike(own, tokenizer):
        return

    def sha(tok: Tokenizer) -> str:
        return "sha256 " + ",".join(file_sha256(p)[:12] for p in tokenizer_files(tok))

    if raw_text:
        ours = f"--tokenizer {cfg.tokenizer} is another ({sha(tokenizer)})"
        fix = f"drop --tokenizer (with --from-hf its own, {spec}, is the default)"
    else:
        ours = f"--data {data} was made with another, {tokenizer.path} ({sha(tokenizer)})"
        fix = f"tokenize the data with it: megapar-data --tokenizer {shell_word(spec)}"
    raise UsageError(
        f"--from-hf {cfg.from_hf} holds its tokenizer {own.path} ({sha(own)}) but {ours}: "
        f"its token ids would be other tokens to the model; {fix}"
    )


def _model_type(directory: str) -> str:
    """The model type a transformers directory's config.json names ("model" where none)."""
    try:
        with open(
            os.path.join(os.path.expanduser(directory), "config.json"), encoding="utf-8"
        ) as f:
            kind = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        kind = None
    return str(kind) if kind else "model"


def check_blend_tokenizers(paths: list[str], parts: list) -> None:
    """The parts of a --data blend (`paths` as given, `parts` their IndexedDatasets) were made
    with one tokenizer: the same files (`same_tokenizer`) or alike encodings
    (`encodes_alike`); where a part's recorded tokenizer no longer loads, by the sha256 of
    the files both recorded (else by vocabulary size and end-of-document id only). ValueError
    naming the two parts otherwise (the same ids would be other tokens in each)."""
    first, tok = parts[0], _loaded(parts[0])
    for path, part in zip(paths[1:], parts[1:]):
        other = _loaded(part)
        same = (part.vocab_size, part.eod_id) == (first.vocab_size, first.eod_id)
        if same and tok is not None and other is not None:
            same = same_tokenizer(tok, other) or encodes_alike(tok, other)
        elif same:  # one no longer loads: the files each was made with, where both say
            digests = [p.tokenizer_spec.get("sha256") for p in (first, part)]
            same = not all(digests) or digests[0] == digests[1]
        if not same:
            raise ValueError(
                f"--data blend: {path} ({_named(part, other)}) and {paths[0]} "
                f"({_named(first, tok)}) were made with different tokenizers: the same ids are "
                f"other tokens in each; tokenize every part with the same one (raw text is "
                f"tokenized with --tokenizer)"
            )


def _loaded(part) -> Tokenizer | None:
    """The tokenizer dataset `part` records, or None where it no longer loads."""
    try:
        return load_tokenizer(part.tokenizer_spec)
    except (OSError, ValueError):
        return None


def _named(part, tokenizer: Tokenizer | None) -> str:
    """How a blend's refusal names a part's tokenizer: its path, else its vocabulary."""
    if tokenizer is not None:
        return str(tokenizer.path)
    return f"vocab {part.vocab_size}, eod {part.eod_id}"
