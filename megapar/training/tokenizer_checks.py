"""The tokenizer checks: a --tokenizer given with a prepared dataset names the dataset's own,
and the data's tokenizer is the one a --load checkpoint trained with (megapar-train and
megapar-eval both run them)."""

from __future__ import annotations

from megapar.data import load_tokenizer
from megapar.data.preprocess import file_sha256
from megapar.data.tokenizers import Tokenizer, encodes_alike, same_tokenizer, tokenizer_files
from megapar.training.validate import UsageError


def check_given_tokenizer(given: str, data: str, tokenizer) -> None:
    """A --tokenizer given with a prepared dataset `data` (whose own is `tokenizer`) names the
    same files (wherever they lie): ValueError naming both otherwise, since the dataset keeps
    its own. megapar-train and megapar-eval both call this."""
    if not same_tokenizer(load_tokenizer(given), tokenizer):
        raise ValueError(
            f"--tokenizer {given} is not the tokenizer --data {data} was made with "
            f"({tokenizer.path}): a prepared dataset keeps its own; leave "
            f"--tokenizer out (it is for raw text and a Megatron-LM dataset without "
            f"megapar's .json), or prepare the data again with megapar-data "
            f"--tokenizer {given}"
        )


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
    digests = [file_sha256(p) for p in tokenizer_files(tokenizer)]
    same_kind = tokenizer.kind == recorded.get("kind")
    if same_kind and digests == recorded["sha256"]:
        return
    trained: Tokenizer | None
    try:  # the recorded tokenizer as it trained: loadable, its files unchanged
        trained = load_tokenizer(recorded)
        if [file_sha256(p) for p in tokenizer_files(trained)] != recorded["sha256"]:
            trained = None
    except (OSError, ValueError):
        trained = None
    if trained is not None and encodes_alike(trained, tokenizer):
        return
    sizes = (recorded.get("vocab_size"), recorded.get("eod_id"))
    if trained is None and not same_kind and sizes == (tokenizer.vocab_size, tokenizer.eod_id):
        return  # another format of the same sizes, the recorded files gone: cannot tell apart
    theirs = recorded.get("path")
    if text_tokenizer:
        ours, fix = (
            f"--data {data} is tokenized with {text_tokenizer}",
            f"pass --tokenizer {theirs}",
        )
    else:
        ours, fix = (
            f"--data {data} was made with {tokenizer.path}",
            f"use data made with megapar-data --tokenizer {theirs}",
        )
    same_path = str(tokenizer.path) == str(theirs)
    changed = " (sha256 " + ",".join(d[:12] for d in digests) + ", changed since)"
    raise UsageError(
        f"--load {load} trained with the tokenizer {theirs} (sha256 "
        f"{','.join(d[:12] for d in recorded['sha256'])}) but {ours}"
        f"{changed if same_path else ''}"
        f": its token ids would be other tokens to the model; {fix}"
    )
