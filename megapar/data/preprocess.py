"""Turn raw text into an indexed dataset (the engine behind ``megapar-data``).

Inputs, in the order given (directories expanded recursively, files sorted by path):

* ``.txt`` (or any other non-``.jsonl`` file): by default the whole file is one document;
  with ``split_paragraphs=True`` (CLI ``--split-lines``) every blank-line-separated
  paragraph is a document.
* ``.jsonl``: one document per line, the text under ``jsonl_key`` (default ``"text"``);
  ``.json``: the same when it holds JSON lines, or a JSON array of such objects;
* ``.parquet``: one document per row of the ``jsonl_key`` column, read a record batch at a
  time (pyarrow).
* With ``sft_keys=(PROMPT, RESPONSE)`` (CLI ``--sft-keys``): JSON Lines records only, one
  document per record: the tokenizer's BOS (when it has one), the prompt's tokens, the
  response's tokens (the two texts tokenized apart, so the prompt's tokens end where it
  ends), the eod; each document's prompt length (BOS included) goes into the metadata
  (``IndexedDataset.prompt_lengths``), for `megapar.data.sft_dataset`.

Everything is streamed: documents are read, tokenized and written a batch at a time, so
memory does not grow with the corpus (a ``.txt`` file that is one document, and a ``.json``
array, are read whole).

Line endings.  Every document's text, whatever its source (``.txt``, a ``.jsonl`` / ``.json``
record, a ``.parquet`` row), has its Windows (CRLF) and old Mac (lone CR) line endings turned
into ``\n`` before anything else (`normalize_newlines`): the same text gives the same tokens,
and blank-line document splitting works, whatever the editor or OS that saved it.  A CRLF copy
of a file and the LF file give byte-identical datasets.

Whitespace-only documents are skipped; an input that yields no document at all is an error.
A document that tokenizes to no ids at all (only its end-of-document token would be written)
is counted into ``stats["empty_docs"]`` (megapar-data warns); when every document does, the
tokenizer cannot encode the text and nothing is written (an error).
Bytes that are not valid UTF-8 become U+FFFD and are counted: more than
``MAX_INVALID_UTF8`` of a file's bytes (binary data, another encoding) is an error unless
``allow_invalid_utf8`` (CLI ``--allow-invalid-utf8``); fewer are reported as a warning.
Tokenization runs in a process pool (spawned workers) when ``workers > 1``; documents are processed
in order, so the output is byte-identical whatever the number of workers.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import multiprocessing as mp
import os
import re
import signal
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TypeVar

import sentencepiece as spm
from tqdm import tqdm

from megapar.data.indexed import IndexedDatasetBuilder
from megapar.data.inputs import (  # noqa: F401 - re-exported
    BOM,
    INPUT_SUFFIXES,
    MAX_INVALID_UTF8,
    check_not_wide,
    expand_inputs,
    iter_documents,
    iter_records,
    normalize_newlines,
    read_text,
)
from megapar.data.tokenizers import (  # noqa: F401 - file_sha256 re-exported
    APPENDED_ORDER,
    Tokenizer,
    file_sha256,
    load_tokenizer,
    tokenizer_files,
)
from megapar.device import cpu_cores
from megapar.faults.processes import remove_stale_tmps, start_pool_worker, tmp_name
from megapar.wording import counted

_Item = TypeVar("_Item")
#: Documents handed to a worker at a time.
BATCH_DOCS = 16
#: Above this many input bytes, ``workers=None`` uses a pool of several workers.
POOL_THRESHOLD_BYTES = 8 << 20


def _batched(docs: Iterator[tuple[_Item, int]], n: int) -> Iterator[tuple[list[_Item], int]]:
    batch, nbytes = [], 0
    for text, size in docs:
        batch.append(text)
        nbytes += size
        if len(batch) == n:
            yield batch, nbytes
            batch, nbytes = [], 0
    if batch:
        yield batch, nbytes


def _worker_init(spec: str) -> None:
    """A pool worker's start, after `start_pool_worker` (it dies with its parent: the task
    queue it waits on never closes when the parent is killed with -9; Ctrl-C is its
    parent's): its tokenizer."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    global _WORKER_TOKENIZER  # per-worker-process cache, not shared state of the package
    _WORKER_TOKENIZER = load_tokenizer(spec)


def _sft_batched(
    records: Iterator[tuple[str, str, int]], n: int
) -> Iterator[tuple[list[str], int]]:
    """Batches of `n` records as (their prompts, then their responses; bytes), the texts a
    worker encodes (`_consume` pairs them again)."""
    for batch, nbytes in _batched((((p, r), size) for p, r, size in records), n):
        yield [p for p, _ in batch] + [r for _, r in batch], nbytes


_BREAKS = re.compile(r"[^\S ]")
"""White space other than a space (a line break, a tab, ...): an unknown token of a
SentencePiece model that spells none of them (megapar's `sentencepiece`, botchan's unigram
model), which also merges one into a run of unknown characters beside it."""


def count_unknown(
    stats: dict,
    encoded: list[list[int]],
    unk: int | None,
    sft: bool,
    suffix: str = "",
    chars: list[tuple[int, int]] | None = None,
) -> None:
    """Count into `stats` the ids of a batch's texts `encoded` (with `sft`, its records'
    prompts then their responses) and those of them `unk`: ``tokens`` / ``unk``, and the
    responses' alone, ``tokens_response`` / ``unk_response`` (each key ending with `suffix`);
    with `chars` (`Tokenizer.encode_counting_unknown`'s), also the characters the unknown
    tokens stand for and the texts' (``unk_chars`` / ``chars``: a model that merges a run of
    unknown characters into one token loses more text than its tokens show).
    `unknown_tokens_note` reads them."""
    parts = [("", 0)] + ([("_response", len(encoded) // 2)] if sft else [])
    for part, first in parts:
        counts = {"tokens": sum(len(e) for e in encoded[first:])}
        if unk is not None:
            counts["unk"] = sum(e.count(unk) for e in encoded[first:])
            if chars is not None:
                counts["unk_chars"] = sum(lost for lost, _ in chars[first:])
                counts["chars"] = sum(length for _, length in chars[first:])
        for what, n in counts.items():
            key = f"{what}{part}{suffix}"
            stats[key] = stats.get(key, 0) + n


def _encode(
    tok: Tokenizer, item: tuple[list[str], int], sft: bool = False, spaced: bool = False
) -> tuple[list[list[int]], int, dict]:
    """A batch (texts, their bytes) encoded: (ids, bytes, `count_unknown`'s counts of them,
    with the characters unknown tokens stand for where the tokenizer has one); `spaced`, for a
    tokenizer that makes a line break its unknown token, counts also the texts with `_BREAKS`
    made spaces (keys ending "_spaced"), and their characters only so: what its vocabulary
    cannot spell (the text encoded again, in the process that encodes it)."""
    texts, nbytes = item
    counts: dict = {}
    if tok.unk_id is None:
        encoded = tok.encode_batch(texts)
        count_unknown(counts, encoded, None, sft)
    elif spaced:
        encoded = tok.encode_batch(texts)
        count_unknown(counts, encoded, tok.unk_id, sft)
        again, chars = tok.encode_counting_unknown([_BREAKS.sub(" ", t) for t in texts])
        count_unknown(counts, again, tok.unk_id, sft, "_spaced", chars)
    else:
        encoded, chars = tok.encode_counting_unknown(texts)
        count_unknown(counts, encoded, tok.unk_id, sft, chars=chars)
    return encoded, nbytes, counts


def _worker_encode(
    item: tuple[list[str], int], sft: bool = False, spaced: bool = False
) -> tuple[list[list[int]], int, dict]:
    return _encode(_WORKER_TOKENIZER, item, sft, spaced)


_WORKER_TOKENIZER: Tokenizer


class NoTextError(ValueError):
    """Inputs that hold no document (each empty or whitespace); `written`: said by a command
    that writes what it reads (megapar-data: "nothing written"), not by one that only reads."""

    def __init__(self, files: Sequence[str], written: bool = True):
        self.files = list(files)
        super().__init__(
            f"no text in {', '.join(files)}: every input is empty or whitespace"
            + ("; nothing written" if written else "")
        )


def check_has_text(
    files: Sequence[str],
    split_paragraphs: bool = False,
    jsonl_key: str = "text",
    allow_invalid_utf8: bool = False,
    sft_keys: Sequence[str] | None = None,
) -> None:
    """ValueError, the line `preprocess_files` gives, where `files` hold no document: for a
    tokenizer's training, which would train on nothing, to refuse as the tokenizing does."""
    documents = (
        iter_records(files, sft_keys)
        if sft_keys is not None
        else iter_documents(files, split_paragraphs, jsonl_key, allow_invalid_utf8, {})
    )
    if next(iter(documents), None) is None:
        raise NoTextError(files)


def preprocess_files(
    inputs: Sequence[str],
    output_prefix: str,
    tokenizer: str,
    workers: int | None = None,
    split_paragraphs: bool = False,
    jsonl_key: str = "text",
    progress: bool = True,
    format: str = "megapar",
    allow_invalid_utf8: bool = False,
    report: dict | None = None,
    stats: dict | None = None,
    sft_keys: tuple[str, str] | None = None,
    overwrite: bool = True,
) -> str:
    """Tokenize ``inputs`` into ``output_prefix.{bin,idx,json}``; return the prefix.

    ``overwrite=False``: a dataset that another writer finished at the prefix meanwhile is
    refused (ValueError) rather than replaced.

    ``sft_keys``: read each JSON Lines record's prompt and response under these keys, one
    document per record with its prompt length (see the module docstring).

    ``format="megatron"`` writes Megatron-LM's ``MMIDIDX`` index instead of megapar's.
    ``stats`` (a dict, when given) receives ``docs`` and ``empty_docs``: the documents written
    and those of them that tokenized to no ids (raises ValueError when that is all of them);
    ``eod_inside``: those holding the end-of-document id before their end; and ``tokens`` /
    ``unk``: the text's ids and those of them the tokenizer's unknown token (with
    ``tokens_spaced`` / ``unk_spaced`` where a line break is one too: `_encode`),
    which `unknown_tokens_note` reads and the dataset's metadata records.

    ``tokenizer`` is a :func:`load_tokenizer` spec.  ``workers=None`` picks one worker for
    small inputs and up to 8 processes (bounded by the CPU count) above 8 MB; more workers than
    CPU cores are capped at the core count. Workers are spawned, and each imports a calling
    script's main module: a script that calls this with more than one worker does so under
    ``if __name__ == "__main__":``.
    """
    if workers is not None and (
        isinstance(workers, bool) or int(workers) != workers or workers < 1
    ):
        raise ValueError(f"--workers {workers} is invalid: it must be >= 1")

    files = expand_inputs(inputs)
    tok = load_tokenizer(tokenizer)
    total = sum(os.path.getsize(p) for p in files)
    if workers is None:
        workers = min(8, cpu_cores()) if total > POOL_THRESHOLD_BYTES else 1
    stats = {} if stats is None else stats
    if tok.eod_guessed:
        stats["eod_guessed"] = (tok.eod_guessed, tok.eod_id)
    workers = min(workers, cpu_cores())  # more only thrash (and the output is the same)
    report = {} if report is None else report  # path -> invalid UTF-8 bytes replaced
    batches = (
        _sft_batched(iter_records(files, sft_keys), BATCH_DOCS)
        if sft_keys is not None
        else _batched(
            iter_documents(files, split_paragraphs, jsonl_key, allow_invalid_utf8, report),
            BATCH_DOCS,
        )
    )
    first = next(batches, None)  # a bad or empty first input fails before a bar is drawn
    if first is None:
        raise NoTextError(files)
    batches = itertools.chain([first], batches)
    sft = sft_keys is not None
    # a line break that is an unknown token: its normalizer's, not the vocabulary's gaps
    spaced = tok.unk_id is not None and tok.unk_id in tok.encode("\n")
    stats["empty_docs"] = 0
    with (
        IndexedDatasetBuilder(
            output_prefix,
            tok.vocab_size,
            tok.eod_id,
            # the files' sha256: a run refuses the dataset once they change at that path
            {**tok.spec(), "sha256": [file_sha256(p) for p in tokenizer_files(tok)]},
            format,
            sft_keys,
            replace=overwrite,
        ) as builder,
        tqdm(
            total=total, unit="B", unit_scale=True, desc="tokenizing", disable=not progress
        ) as bar,
    ):  # closed (its line ended) before any error
        if workers == 1:
            results = (_encode(tok, item, sft, spaced) for item in batches)
            _consume(results, builder, bar, tok, stats, sft)
        else:
            # Workers start as fresh interpreters (spawned): a fork of this process inherits
            # the locks its other threads (tqdm's monitor, pyarrow's pool) held then, and such
            # a worker could hang at start and outlive the pool. (Not a forkserver: its server
            # and preloads are one per process, shared with every other user of it.)
            ctx = mp.get_context("spawn")
            # A process pool, not multiprocessing.Pool: a worker that dies (the OOM killer, a
            # SIGTERM sent to the whole process group) marks the pool broken and its batches
            # fail, where Pool resubmitted nothing (a hang) and its terminate() could wait
            # forever on a queue lock the dead worker held.
            pool = ProcessPoolExecutor(
                workers,
                mp_context=ctx,
                initializer=start_pool_worker,
                initargs=(os.getpid(), f"{__name__}:_worker_init", tok.path),
            )
            # Workers start ignoring SIGINT, which they keep: a Ctrl-C is this process's to
            # handle (it ends them), not a traceback from each worker. The pool starts a worker
            # per submit until it has them all; these submits start them now, in the window.
            main_thread = threading.current_thread() is threading.main_thread()
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main_thread else None
            try:
                for _ in range(workers):
                    pool.submit(os.getpid)
            finally:
                if previous is not None:
                    signal.signal(signal.SIGINT, previous)
            try:
                _consume(
                    _ordered_bounded(pool, batches, 4 * workers, sft, spaced),
                    builder,
                    bar,
                    tok,
                    stats,
                    sft,
                )
            except BrokenProcessPool:
                raise ValueError(
                    f"a tokenizer worker process ended abruptly (killed, or out of memory?); "
                    f"nothing written; run again, with fewer --workers than {workers} if memory "
                    f"is short"
                ) from None
            except BaseException:  # an error, Ctrl-C, SIGTERM: the batches under way are
                _end_workers(pool)  # not waited for (seconds each on a large input)
                raise
            finally:
                pool.shutdown(cancel_futures=True)
        bar.n = total
        bar.close()
        stats["docs"] = builder.num_docs
        if stats["empty_docs"] == builder.num_docs:
            other = " (e.g. --tokenizer gpt2)" if str(tok.path) != "gpt2" else ""
            fix = f"use a tokenizer whose vocabulary covers this text{other}"
            if sft_keys is not None:  # records: most likely their fields are empty
                fix = f"fill the records' {' and '.join(sft_keys)} fields, or {fix}"
            raise ValueError(
                f"tokenizer {tok.path} encodes the text of {', '.join(files)} to nothing: all "
                f"{counted(builder.num_docs, 'record' if sft_keys else 'document')} gave no "
                f"token ids (only end-of-document tokens would be written); {fix}; nothing "
                f"written"
            )
        if tok.unk_id is not None:  # megapar-train says it again when it reads the dataset
            builder.unknown_tokens = {k: stats[k] for k in UNKNOWN_COUNTS if k in stats}
        builder.invalid_utf8 = dict(report) or None  # and this (`ensure_dataset`'s cache)
        return builder.finalize()


UNKNOWN_COUNTS = tuple(
    f"{what}{part}{suffix}"
    for what in ("unk", "tokens", "unk_chars", "chars")
    for part in ("", "_response")
    for suffix in ("", "_spaced")
)
"""The counts of ``stats`` `unknown_tokens_note` reads, which a dataset's metadata records
(``unknown_tokens``) where its tokenizer has an unknown token."""

UNKNOWN_SHARE_NOTED = 0.01
"""The share of a text's tokens, or of its characters, that the tokenizer's unknown token
stands for from which megapar-data, megapar-train and megapar-eval say so."""


def unknown_tokens_note(stats: dict, tokenizer) -> str | None:
    """One line naming how many of the text's tokens (`count_unknown`'s counts) are the
    tokenizer's unknown token, and how many of its characters they stand for, where either is
    at least `UNKNOWN_SHARE_NOTED`: its vocabulary does not spell those characters, and the
    text they stood for is not in the dataset. Records' responses (what fine-tuning trains on)
    are counted apart first: a few unknown tokens can be all of them. For a model that makes a
    line break its unknown token too, and merges it into the unknown characters beside it, the
    counts of the text with them as spaces (``*_spaced``): data.md says SentencePiece's
    documents lose their line breaks. Counts recorded before characters were counted name the
    tokens alone."""
    suffix = "_spaced" if "tokens_spaced" in stats else ""
    for part, whose, its in (("_response", "the responses'", "their"), ("", "the text's", "its")):
        unk, tokens = stats.get(f"unk{part}{suffix}"), stats.get(f"tokens{part}{suffix}")
        lost, chars = stats.get(f"unk_chars{part}{suffix}"), stats.get(f"chars{part}{suffix}")
        if unk is None or not tokens:
            continue
        by_chars = lost is not None and chars and lost >= UNKNOWN_SHARE_NOTED * chars
        if unk < UNKNOWN_SHARE_NOTED * tokens and not by_chars:
            continue
        standing = (
            f", standing for {lost:,} of {its} {counted(chars, 'character')} "
            f"({100 * lost / chars:.1f} %)"
            if lost is not None and chars
            else ""
        )
        spaced = (
            ", counted with its line breaks and tabs as spaces (its model spells those so too)"
            if suffix
            else ""
        )
        return (
            f"{unk:,} of {whose} {counted(tokens, 'token')} ({100 * unk / tokens:.1f} %) are "
            f"tokenizer {tokenizer}'s unknown token{standing}{spaced}: its vocabulary does not "
            f"spell those characters, so what they were is lost; tokenize with one that covers "
            f"this text (a byte-level BPE spells any text: --tokenizer gpt2, or megapar-data "
            f"--train-tokenizer bpe)"
        )
    return None


def recorded_unknown_note(meta: dict, tokenizer: str | None = None) -> str | None:
    """`unknown_tokens_note` of a dataset's metadata (`IndexedDataset.meta`: the counts it
    records), naming `tokenizer` (default: the one it records)."""
    counts = meta.get("unknown_tokens") or {}
    return unknown_tokens_note(counts, tokenizer or (meta.get("tokenizer") or {}).get("path"))


def _end_workers(pool: ProcessPoolExecutor) -> None:
    """End `pool`'s workers now (SIGTERM), the batches they run dropped: Python 3.14's
    ``terminate_workers``, else the same on the pool's processes (its shutdown then finds
    them gone)."""
    terminate = getattr(pool, "terminate_workers", None)
    if terminate is not None:
        terminate()
        return
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.terminate()


def _ordered_bounded(
    pool: ProcessPoolExecutor, batches, window: int, sft: bool = False, spaced: bool = False
):
    """``pool.map(_worker_encode, batches)`` with at most `window` batches in flight (map
    would read the whole input ahead into its queue)."""

    pending: deque = deque()
    for item in batches:
        pending.append(pool.submit(_worker_encode, item, sft, spaced))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _consume(
    results,
    builder: IndexedDatasetBuilder,
    bar,
    tok: Tokenizer,
    stats: dict | None = None,
    sft: bool = False,
) -> None:
    """Add each document of `results` (`_encode`'s: ids, bytes, counts) after `tok`'s own
    BOS, when it has one (its eod follows, unless the text ends with it already: then that one
    ends it, as transformers encodes it); count into ``stats["empty_docs"]`` those that
    tokenized to no ids, into ``stats["eod_inside"]`` those holding the eod before their end (a
    tokenizer.json encodes the text of its special token as the token, as transformers does),
    and add up the batches' unknown-token counts (`count_unknown`). `sft`: each batch is its
    records' prompts then their responses (`_sft_batched`), added as one document per record
    with its prompt length."""
    bos_id, eod_id = tok.bos_id, tok.eod_id
    bos = [] if bos_id is None else [bos_id]
    for encoded, nbytes, counts in results:
        if stats is not None:
            for key, n in counts.items():
                stats[key] = stats.get(key, 0) + n
        if stats is not None and eod_id is not None:  # a special token's text, as its id
            stats["eod_inside"] = stats.get("eod_inside", 0) + sum(
                1 for e in encoded if eod_id in e and e.index(eod_id) < len(e) - 1
            )
        if eod_id is not None:
            # a text (a record's response: the second half) ending in the EOS written out ends
            # with that one: the builder adds it back
            first = len(encoded) // 2 if sft else 0
            encoded = encoded[:first] + [
                e[:-1] if e and e[-1] == eod_id else e for e in encoded[first:]
            ]
        if sft:
            half = len(encoded) // 2
            for prompt, response in zip(encoded[:half], encoded[half:]):
                if stats is not None and not prompt and not response:
                    stats["empty_docs"] = stats.get("empty_docs", 0) + 1
                builder.add_document(bos + prompt + response, len(bos) + len(prompt))
            bar.update(nbytes)
            continue
        if stats is not None:
            stats["empty_docs"] = stats.get("empty_docs", 0) + sum(1 for e in encoded if not e)
        builder.add_documents(encoded if bos_id is None else ([bos_id] + e for e in encoded))
        bar.update(nbytes)


SENTENCE_BYTES = 4192
"""The longest sentence SentencePiece's trainer reads, in UTF-8 bytes (its
``max_sentence_length``, given explicitly): it skips longer ones without a word."""


def within_sentence_limit(line: str, limit: int = SENTENCE_BYTES) -> Iterator[str]:
    """`line` in pieces of at most `limit` UTF-8 bytes, each cut after its last space where
    the second half of the piece has one (a line of no spaces, e.g. Chinese, between
    characters), for SentencePiece's trainer, which would skip the whole line."""
    start = 0
    while (len(line) - start) * 4 > limit:  # may be longer than the limit in bytes
        head = line[start : start + limit].encode("utf-8", "surrogatepass")[:limit]
        fits = len(head.decode("utf-8", "ignore"))  # the characters whole in `limit` bytes
        if start + fits >= len(line):
            break
        space = line.rfind(" ", start + fits // 2, start + fits)
        cut = space + 1 if space >= 0 else start + max(fits, 1)
        yield line[start:cut]
        start = cut
    if start < len(line):
        yield line[start:]


def train_sentencepiece(
    inputs: Sequence[str],
    model_prefix: str,
    vocab_size: int,
    model_type: str = "unigram",
    split_paragraphs: bool = False,
    jsonl_key: str = "text",
    num_threads: int = 1,
    allow_invalid_utf8: bool = False,
) -> str:
    """Train a SentencePiece model on ``inputs`` in-process; write ``model_prefix.model``.

    ``[PAD] [CLS] [SEP] [MASK]`` are reserved as user-defined symbols (ids 3-6 after
    ``<unk> <s> </s>``), so the trained model needs no appended special tokens. Invalid
    UTF-8 in the inputs is read as `iter_documents` reads it (``allow_invalid_utf8``).
    Returns the model path.
    """
    if vocab_size < 1:
        raise ValueError(f"--vocab-size {vocab_size} is invalid: it must be >= 1")
    files = expand_inputs(inputs)

    failed: list[BaseException] = []  # the inputs' own error, which sentencepiece would wrap

    def sentences() -> Iterator[str]:
        try:
            for text, _ in iter_documents(files, split_paragraphs, jsonl_key, allow_invalid_utf8):
                for line in text.splitlines():
                    if line.strip():
                        yield from within_sentence_limit(line)
        except ValueError as e:  # a bad input, named in one line (not a trainer's failure)
            failed.append(e)
            raise

    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences(),
            model_writer=buf,
            vocab_size=vocab_size,
            model_type=model_type,
            user_defined_symbols=[t for t in APPENDED_ORDER if t != "[EOD]"],
            character_coverage=1.0,
            max_sentence_length=SENTENCE_BYTES,
            num_threads=num_threads,
            minloglevel=2,
            hard_vocab_limit=True,
        )
    except RuntimeError as e:
        if failed:
            raise failed[0] from None
        raise ValueError(_sentencepiece_error(str(e), vocab_size)) from None
    path = os.fspath(model_prefix) + ".model"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    remove_stale_tmps(path)
    tmp = tmp_name(path)
    with open(tmp, "wb") as f:
        f.write(buf.getvalue())
    os.replace(tmp, path)
    return path


def _sentencepiece_error(message: str, vocab_size: int) -> str:
    """One line for a SentencePiece training failure, naming --vocab-size and the fix."""
    message = " ".join(message.split())
    low = re.search(r"smaller than required_chars\. \d+ vs (\d+)", message)
    if low:
        need = int(low.group(1))
        return (
            f"--vocab-size {vocab_size} is too small for this corpus: SentencePiece needs at "
            f"least {need:,} tokens (one per distinct character, plus its control tokens); "
            f"pass --vocab-size {need} or more"
        )
    high = re.search(r"value <= (\d+)", message)
    if high:
        most = int(high.group(1))
        return (
            f"--vocab-size {vocab_size} is too large for this corpus: SentencePiece can make "
            f"at most {most:,} tokens from it; pass --vocab-size {most} or less, or train on "
            f"more text"
        )
    return (
        f"SentencePiece training failed ({message}); a smaller --vocab-size or more input "
        f"text usually fixes it"
    )


def _digest_and_cr(path: str) -> tuple[str, bool]:
    """(hex SHA-256 of a file's bytes, whether it may hold a carriage return: a CR byte, or a
    JSON-escaped one in a ``.jsonl`` / ``.json`` record)."""
    h, cr = hashlib.sha256(), False
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            cr = cr or b"\r" in block or b"\\r" in block
    return h.hexdigest(), cr


def _starts_with_bom(path: str) -> bool:
    """Whether a file starts with UTF-8's byte-order mark (dropped when read)."""
    with open(path, "rb") as f:
        return f.read(len(BOM)) == BOM


def ensure_dataset(
    text_path: str,
    tokenizer_spec: str,
    cache_dir: str,
    split_paragraphs: bool = True,
    progress: bool = False,
    allow_invalid_utf8: bool = False,
    report: dict | None = None,
    stats: dict | None = None,
    jsonl_key: str = "text",
    sft_keys: tuple[str, str] | None = None,
) -> str:
    """Preprocess a raw text file into ``cache_dir`` once; return the dataset prefix.

    The cache key is the SHA-256 of the file's content, the tokenizer (kind, vocab size
    and the hash of its model files), ``split_paragraphs`` and (when not their defaults)
    ``jsonl_key``, ``allow_invalid_utf8`` and ``sft_keys``; a later call with the same
    inputs returns the cached prefix without work.  By default every blank-line-separated
    paragraph is a document, so a single file can still be split into train/val by
    documents.  Writes are atomic: concurrent callers (e.g. several ranks) are safe.
    ``report`` and ``stats``: as for `preprocess_files` (`stats` filled only when the text is
    tokenized; `report` also from a cached copy's record).
    """
    if not os.path.exists(text_path):
        raise FileNotFoundError(
            f"training text {text_path} does not exist; pass an existing .txt file"
        )
    files = expand_inputs([text_path])  # a directory: its .txt / .jsonl files
    for path in files:  # refused before the cache is looked at: a copy may predate the refusal
        if not path.endswith(".parquet"):
            check_not_wide(path)
    tok = load_tokenizer(tokenizer_spec)
    digests = [_digest_and_cr(p) for p in (files if os.path.isdir(text_path) else [text_path])]
    tok_files = tokenizer_files(tok)
    key = json.dumps(
        {
            "text": [d for d, _ in digests] if os.path.isdir(text_path) else digests[0][0],
            "tokenizer": [tok.kind, tok.vocab_size] + [file_sha256(p) for p in tok_files],
            "split_paragraphs": split_paragraphs,
            "format": 1,
            # text with CR line endings: cached before they were normalised to LF, so a new key
            **({"newlines": "lf"} if any(cr for _, cr in digests) else {}),
            # a byte-order mark: cached as three tokens before it was dropped, so a new key
            **({"bom": "dropped"} if any(_starts_with_bom(p) for p in files) else {}),
            # a transformers tokenizer without a BOS: its documents were cached beginning
            # with a "<s>" of its vocabulary before an explicit "bos_token": null was obeyed
            **({"bos": None} if tok.kind == "hf" and tok.bos_id is None else {}),
            # a BOS other than the one its configs name, which documents began with before the
            # tokenizer.json's post-processor decided (as it does in transformers)
            **(
                {"bos_id": tok.bos_id}
                if tok.kind == "hf" and tok.bos_id not in (None, tok.named_bos_id)
                else {}
            ),
            # only when set, so the datasets cached with the defaults keep their key
            **({"jsonl_key": jsonl_key} if jsonl_key != "text" else {}),
            **({"allow_invalid_utf8": True} if allow_invalid_utf8 else {}),
            **({"sft_keys": list(sft_keys)} if sft_keys is not None else {}),
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(os.path.abspath(text_path)))[0]  # DIR/, . too
    prefix = os.path.join(os.fspath(cache_dir), f"{stem}-{digest}")
    if all(os.path.isfile(prefix + ext) for ext in (".bin", ".idx", ".json")):
        if report is not None:  # the bytes replaced when it was tokenized, said again
            with open(prefix + ".json") as f:
                replaced = json.load(f).get("invalid_utf8") or {}
            if replaced and os.path.isfile(text_path):  # named as this run names it
                replaced = {text_path: sum(replaced.values())}
            report.update(replaced)
        return prefix
    try:
        return preprocess_files(
            [text_path],
            prefix,
            tokenizer_spec,
            workers=1,
            split_paragraphs=split_paragraphs,
            jsonl_key=jsonl_key,
            progress=progress,
            allow_invalid_utf8=allow_invalid_utf8,
            report=report,
            stats=stats,
            sft_keys=sft_keys,
        )
    except NoTextError as exc:  # a cache the user did not ask for: "nothing written" unsaid
        raise NoTextError(exc.files, written=False) from None
