"""``megapar-data``: tokenize text into an indexed dataset (``PREFIX.bin/.idx/.json``).

Examples:

    megapar-data --input corpus/ --output-prefix data/shakespeare --tokenizer gpt2
    megapar-data --input docs.jsonl --jsonl-key body --output-prefix data/docs --tokenizer gpt2
    megapar-data --input sft.jsonl --sft-keys prompt,response --output-prefix data/sft
    megapar-data --train-sentencepiece --vocab-size 8000 --input corpus/ --output-prefix data/sp
    megapar-data --input corpus/ --output-prefix data/mt --tokenizer gpt2 --format megatron
    megapar-data --train-tokenizer bpe --vocab-size 8000 --input corpus/ --output-prefix data/bpe
    megapar-data --input corpus/ --output-prefix data/llama --tokenizer ./my-hf-tokenizer/

A ``.txt`` file is one document unless ``--split-lines`` is given, in which case every
blank-line-separated paragraph is a document; each line of a ``.jsonl`` file is one, each
object of a ``.json`` file (JSON lines, an array, or one object) and each row of a
``.parquet`` file. In a directory, a tokenized dataset's ``.json`` (beside its ``.bin`` and
``.idx``) is not read as input. With ``--sft-keys PROMPT,RESPONSE`` each JSON Lines record is
one document, its prompt then its response, and the dataset keeps each one's prompt length:
megapar-train trains on it with the loss on the responses only.
Windows (CRLF) and old Mac (CR) line endings are read as LF, in every input kind, so the
same text gives the same dataset whichever line endings it was saved with.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
from collections.abc import Sequence

from megapar.cli.closed_stdout import quiet_when_stdout_closes
from megapar.faults.processes import exit_uncollected
from megapar.one_line_parser import TOKENIZER_NAMES, OneLineParser, shell_word, show_progress
from megapar.training.empty_values import check_blank_flags
from megapar.wording import counted

OTHER_FLAGS = {
    "--nproc": "--workers",
    "--num-proc": "--workers",
    "--lowercase": "megapar-data keeps the text as it is (its tokenizer's normalizer, if any, "
    "applies); lower-case the input first",
    **TOKENIZER_NAMES,
    "--json-keys": "--jsonl-key",
    "--append-eod": "megapar-data always ends each document with the end-of-document token; "
    "drop it",
    "--dataset-impl": "--format megatron",
    "--output": "--output-prefix",
    "--data": "--input",
    "--save": "--output-prefix",
    "--seq-len": "megapar-data keeps whole documents (megapar-train cuts them into --seq-len "
    "windows); drop it",
    "--model": "megapar-data needs only the --tokenizer (a model's vocabulary follows it); drop it",
    "--split-sentences": "megapar-data splits no sentences: a document's text stays whole "
    "(--split-lines makes each blank-line paragraph of a .txt a document); drop it",
    "--keep-newlines": "megapar-data keeps every newline as it is; drop it",
    "--partitions": "--workers",
    **dict.fromkeys(
        ("--tp", "--pp", "--cp", "--dp", "--ep", "--virtual-stages"),
        "megapar-data's output serves every layout (megapar-train reads it at any parallel "
        "sizes); drop it",
    ),
    "--log-interval": "megapar-data shows a progress bar when stderr is a terminal; drop it",
}
"""Megatron-LM's preprocess_data.py flags, answered with megapar-data's (difflib named
`--vocab-size` for `--vocab-file`, which is the size of a tokenizer to train, and `--split-lines`
for `--split-sentences`, `--keep-newlines` and `--partitions`)."""


def build_parser() -> argparse.ArgumentParser:
    """The ``megapar-data`` argument parser."""
    p = OneLineParser(
        prog="megapar-data",
        stray=(("--input", "the input"), ("--output-prefix", "the output prefix")),
        known_as=OTHER_FLAGS,
        description=__doc__.replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_io_arguments(p)
    add_document_arguments(p)
    add_tokenizer_training_arguments(p)
    add_output_arguments(p)
    return p


def add_io_arguments(p: argparse.ArgumentParser) -> None:
    """What is read, written and tokenized with: --input, --output-prefix, --tokenizer,
    --workers."""
    p.add_argument(
        "--input",
        nargs="+",
        action="extend",  # --input A --input B reads both (argparse's default kept only B)
        type=os.path.expanduser,  # a leading ~ (quoted) is the home directory, as a shell's
        required=True,
        metavar="PATH",
        help=".txt / .jsonl / .json / .parquet files or directories of them (recursive, sorted)",
    )
    p.add_argument(
        "--output-prefix",
        required=True,
        type=os.path.expanduser,
        metavar="PREFIX",
        help="writes PREFIX.bin, PREFIX.idx, PREFIX.json (and PREFIX.model when training)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="SPEC",
        help="'gpt2', 'sentencepiece', a transformers dir with tokenizer.json, a dir "
        "with vocab.json+merges.txt, or a .model file (default: gpt2, or the "
        "trained one with --train-tokenizer / --train-sentencepiece)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="tokenizer processes; the output is identical for any value (default: 1 for "
        "inputs under 8 MB, else up to 8)",
    )


def add_document_arguments(p: argparse.ArgumentParser) -> None:
    """Where an input's documents are: --jsonl-key, --split-lines, --sft-keys."""
    p.add_argument(
        "--jsonl-key",
        default=None,
        help="field (or parquet column) holding the text in .jsonl / .json / .parquet inputs "
        "(default: text)",
    )
    p.add_argument(
        "--split-lines",
        action="store_true",
        help="treat each blank-line-separated paragraph of a .txt file as a document "
        "(default: one document per file)",
    )
    p.add_argument(
        "--sft-keys",
        default=None,
        metavar="PROMPT,RESPONSE",
        help="supervised fine-tuning records: each JSON Lines record's two fields (e.g. "
        "prompt,response; TRL's prompt,completion) become one document, the prompt's tokens "
        "then the response's, with its prompt length kept, so megapar-train puts the loss on "
        "the response only",
    )


def add_tokenizer_training_arguments(p: argparse.ArgumentParser) -> None:
    """Training a tokenizer first: --train-sentencepiece, --train-tokenizer, --vocab-size,
    --sp-model-type."""
    p.add_argument(
        "--train-sentencepiece",
        action="store_true",
        help="first train a SentencePiece model on the inputs (saved as PREFIX.model)",
    )
    p.add_argument(
        "--train-tokenizer",
        choices=["bpe", "wordpiece", "sentencepiece"],
        default=None,
        help="first train a tokenizer on the inputs: bpe = a byte-level BPE, wordpiece = an "
        "uncased BERT WordPiece with [PAD] [UNK] [CLS] [SEP] [MASK], both with the "
        "tokenizers library (saved as the transformers directory PREFIX-tokenizer/), "
        "sentencepiece = --train-sentencepiece",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="vocabulary size of the trained tokenizer (needed with --train-tokenizer / "
        "--train-sentencepiece)",
    )
    p.add_argument(
        "--sp-model-type",
        default=None,
        choices=["unigram", "bpe"],
        help="SentencePiece model type when training (default: unigram)",
    )


def add_output_arguments(p: argparse.ArgumentParser) -> None:
    """How the dataset is written: --format, --allow-invalid-utf8, --overwrite, --no-progress."""
    p.add_argument(
        "--format",
        default="megapar",
        choices=["megapar", "megatron"],
        help="index format: megapar's, or Megatron-LM's MMIDIDX (readable by "
        "Megatron-LM / NeMo; megapar reads both) (default: megapar)",
    )
    p.add_argument(
        "--allow-invalid-utf8",
        action="store_true",
        help="replace bytes that are not valid UTF-8 with U+FFFD even when they are "
        "more than 0.1%% of a file (default: such a file is refused as not text)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing PREFIX.bin/.idx/.json (and the tokenizer a "
        "--train-tokenizer run writes); without it they are refused",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="hide the progress bar (shown only when stderr is a terminal)",
    )


def check_flags(args: argparse.Namespace) -> None:
    """Raise ValueError naming the flag for a numeric flag out of range (before any work);
    --workers above the CPU cores is capped there (with a note)."""
    check_blank_flags(  # an unset $OUT wrote " .bin"; an unset $TEXT: "input  does not exist"
        args,
        {
            "input": "give a text file, a .jsonl / .json / .parquet file or a directory of them",
            "output_prefix": "give a prefix such as data/corpus (writes data/corpus.bin, "
            ".idx, .json)",
            "tokenizer": "give one (e.g. --tokenizer sentencepiece), or leave the flag out (gpt2)",
            "jsonl_key": "give the field holding each record's text (e.g. --jsonl-key body), "
            "or leave the flag out (text)",
        },
    )
    if args.workers is not None and args.workers < 1:
        raise ValueError(
            f"--workers {args.workers} is invalid: it must be >= 1 (or leave it "
            f"out: 1 for inputs under 8 MB, else up to 8)"
        )
    from megapar.device import cpu_cores

    name = os.path.basename(args.output_prefix)
    if not name or name in (".", ".."):
        raise ValueError(
            f"--output-prefix {args.output_prefix!r} names no file (it would write "
            f"hidden {os.path.join(args.output_prefix, '.bin')} and friends); give "
            f"a prefix such as data/corpus (writes data/corpus.bin, .idx, .json)"
        )
    stem, ext = os.path.splitext(args.output_prefix)
    if ext.lower() in (".bin", ".idx", ".json") and os.path.basename(stem):  # a file it writes
        raise ValueError(
            f"--output-prefix {args.output_prefix} names a file megapar-data writes: it would "
            f"write {args.output_prefix}.bin, {args.output_prefix}.idx and .json; give the "
            f"prefix, --output-prefix {stem}"
        )

    if args.workers is not None and args.workers > cpu_cores():
        print(
            f"megapar-data: note: --workers {args.workers}: using {cpu_cores()}, the CPU cores "
            f"this process may use (more only thrash; the output is the same)",
            file=sys.stderr,
        )
        args.workers = cpu_cores()
    if args.sft_keys is not None:
        from megapar.data.inputs import parse_sft_keys

        args.sft_keys = parse_sft_keys(args.sft_keys)
    if args.vocab_size is not None and args.vocab_size < 1:
        raise ValueError(
            f"--vocab-size {args.vocab_size} is invalid: it must be >= 1 (e.g. --vocab-size 8000)"
        )
    training = args.train_tokenizer is not None or args.train_sentencepiece
    if training and args.vocab_size is not None and args.vocab_size > MAX_VOCAB_SIZE:
        raise ValueError(
            f"--vocab-size {args.vocab_size} is more than megapar-data trains: pass "
            f"{MAX_VOCAB_SIZE} or less (the largest vocabularies in use have about 256,000 "
            f"tokens)"
        )
    if args.train_tokenizer in TRAINS and args.train_sentencepiece:
        raise ValueError(
            f"--train-tokenizer {args.train_tokenizer} and --train-sentencepiece each train a "
            f"tokenizer; keep one (--train-tokenizer sentencepiece is --train-sentencepiece)"
        )


MAX_VOCAB_SIZE = 1 << 21
"""The largest --vocab-size trained: the tokenizers library's BPE trainer reserves memory by the
size asked (70 GB for 10**9, an abort in its Rust code), whatever the corpus supports."""


def _check_unread(args: argparse.Namespace, files: list[str]) -> None:
    """ValueError for a flag given that this run would not read; then the defaults of
    --jsonl-key and --sp-model-type filled in."""
    from megapar.data.inputs import KEYED_SUFFIXES, reads_key

    sentencepiece = args.train_sentencepiece or args.train_tokenizer == "sentencepiece"
    if args.sp_model_type is not None and not sentencepiece:
        raise ValueError(
            f"--sp-model-type {args.sp_model_type} would be ignored: it is the type of the "
            f"SentencePiece model --train-tokenizer sentencepiece trains, and this run trains "
            f"{TRAINS.get(args.train_tokenizer or '', 'none')}; add "
            f"--train-tokenizer sentencepiece, or drop --sp-model-type"
        )
    if args.sft_keys is not None:
        from megapar.data.inputs import check_sft_inputs

        keys = ",".join(args.sft_keys)
        clash = next(
            (
                flag
                for flag, given in (
                    ("--jsonl-key", args.jsonl_key is not None),
                    ("--split-lines", args.split_lines),
                    ("--train-tokenizer", args.train_tokenizer is not None),
                    ("--train-sentencepiece", args.train_sentencepiece),
                )
                if given
            ),
            None,
        )
        if clash is not None:
            raise ValueError(
                f"{clash} cannot be combined with --sft-keys {keys}: the records' fields are "
                f"read as prompt and response (train a tokenizer on the text in a run of its "
                f"own, then pass it with --tokenizer); drop {clash}"
            )
        check_sft_inputs(files, args.sft_keys)
    if args.jsonl_key is not None and not reads_key(files):
        raise ValueError(
            f"--jsonl-key {args.jsonl_key} would be ignored: no input is .jsonl / .json / "
            f".parquet (a .txt file's text is all of it); drop --jsonl-key"
        )
    if args.split_lines and files and all(f.endswith(KEYED_SUFFIXES) for f in files):
        raise ValueError(
            "--split-lines would be ignored: it cuts a .txt input into paragraphs, and no "
            "input is .txt (each .jsonl / .json record or .parquet row is a document "
            "already); drop --split-lines"
        )
    args.jsonl_key = args.jsonl_key or "text"
    args.sp_model_type = args.sp_model_type or "unigram"


TRAINS = {"bpe": "a byte-level BPE", "wordpiece": "a BERT WordPiece"}
"""The tokenizers --train-tokenizer trains with the tokenizers library (as PREFIX-tokenizer/)."""


def outputs(args: argparse.Namespace) -> list[str]:
    """The paths a run writes: PREFIX.bin/.idx/.json, and the tokenizer it trains (PREFIX.model,
    or the directory PREFIX-tokenizer)."""
    prefix = args.output_prefix
    paths = [prefix + ext for ext in (".bin", ".idx", ".json")]
    if args.train_tokenizer in TRAINS:
        paths.append(prefix + "-tokenizer")
    elif args.train_sentencepiece or args.train_tokenizer == "sentencepiece":
        paths.append(prefix + ".model")
    return paths


def check_overwrite(args: argparse.Namespace) -> None:
    """Raise ValueError when the run would replace files that exist and --overwrite is not
    given (as megapar-convert refuses an existing destination)."""
    existing = [p for p in outputs(args) if os.path.lexists(p)]
    if existing and not args.overwrite:
        raise ValueError(
            f"--output-prefix {args.output_prefix}: {', '.join(existing)} already "
            f"exist{'s' if len(existing) == 1 else ''}; pass --overwrite to replace "
            f"{'it' if len(existing) == 1 else 'them'}, or choose another prefix"
        )


def _remove_trained(trained: list[str], replaced: bool, prefix: str) -> str:
    """Remove the tokenizer this failed run trained; when it replaced one (--overwrite), also
    the dataset PREFIX.bin/.idx/.json made with the replaced one. Returns a note on that."""
    for path in trained:
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    if not (trained and replaced):
        return ""
    gone = [prefix + ext for ext in (".bin", ".idx", ".json") if os.path.exists(prefix + ext)]
    for path in gone:
        os.remove(path)
    return (
        (
            f" (the earlier {', '.join(gone)}, made with the tokenizer this run replaced, were "
            f"removed too)"
        )
        if gone
        else ""
    )


def _own_tokenizer_left_out(args: argparse.Namespace, files: list[str]) -> list[str]:
    """`files` less those in the directory PREFIX-tokenizer/ this run's --train-tokenizer bpe
    (or wordpiece) writes: with --output-prefix inside an input directory its tokenizer.json (and a
    --overwrite run's earlier one) would be read back as a .json input."""
    if args.train_tokenizer not in TRAINS:
        return files
    own = os.path.realpath(args.output_prefix + "-tokenizer") + os.sep
    return [f for f in files if not os.path.realpath(f).startswith(own)]


def train_tokenizer(args: argparse.Namespace, trained: list[str], files: list[str]) -> str:
    """The tokenizer to encode with: --tokenizer (default gpt2), or the one --train-tokenizer /
    --train-sentencepiece trains now from the input `files` (its path appended to `trained`).
    ValueError for --vocab-size / --tokenizer where they do not apply."""
    from megapar.data.preprocess import train_sentencepiece

    tokenizer = args.tokenizer or "gpt2"
    if args.train_tokenizer == "sentencepiece":
        args.train_sentencepiece = True
    if args.train_tokenizer in TRAINS:
        if args.vocab_size is None:
            raise ValueError(
                f"--train-tokenizer {args.train_tokenizer} needs --vocab-size N (e.g. "
                f"--vocab-size 8000)"
            )
        if args.tokenizer is not None or args.train_sentencepiece:
            raise ValueError("--train-tokenizer trains its own tokenizer; drop --tokenizer")
        from megapar.data.hf_tokenizer import train_bpe, train_wordpiece
        from megapar.data.preprocess import iter_documents

        docs = iter_documents(files, args.split_lines, args.jsonl_key, args.allow_invalid_utf8)
        info: dict = {}
        train = train_bpe if args.train_tokenizer == "bpe" else train_wordpiece
        tokenizer = train(
            (text for text, _ in docs),
            args.output_prefix + "-tokenizer",
            args.vocab_size,
            info=info,
        )
        trained.append(tokenizer)
        from megapar.data.tokenizers import load_tokenizer

        appended = load_tokenizer(tokenizer).appended  # what the dataset's vocabulary adds
        adds = (
            f" ({info.get('vocab_size', args.vocab_size):,} ids; the dataset's vocabulary adds "
            f"{' '.join(appended)}, which megapar appends where a tokenizer lacks them)"
            if appended
            else ""
        )
        print(
            f"trained {TRAINS[args.train_tokenizer]} {tokenizer}/tokenizer.json{adds}",
            file=sys.stderr,
        )
        if args.train_tokenizer == "wordpiece":
            print(
                f"megapar-data: note: the tokenizers library's WordPiece training is not "
                f"deterministic (its issue 1794: ties broken in hash order), so this command run "
                f"again can give another vocabulary; {tokenizer}/ is the one this dataset is "
                f"tokenized with",
                file=sys.stderr,
            )
        got = info.get("vocab_size", args.vocab_size)
        if got < args.vocab_size:
            print(
                f"megapar-data: note: --vocab-size {args.vocab_size}: the corpus supported "
                f"only {got:,} tokens (every pair of tokens in it is merged), so the "
                f"tokenizer has {got:,}; train on more text for a larger vocabulary",
                file=sys.stderr,
            )
    elif args.train_sentencepiece:
        if args.vocab_size is None:
            raise ValueError("--train-sentencepiece needs --vocab-size N (e.g. --vocab-size 8000)")
        if args.tokenizer is not None:
            raise ValueError("--train-sentencepiece trains its own tokenizer; drop --tokenizer")
        tokenizer = train_sentencepiece(
            files,
            args.output_prefix,
            args.vocab_size,
            model_type=args.sp_model_type,
            split_paragraphs=args.split_lines,
            jsonl_key=args.jsonl_key,
            allow_invalid_utf8=args.allow_invalid_utf8,
        )
        trained.append(tokenizer)
        print(f"trained SentencePiece model {tokenizer}", file=sys.stderr)
    elif args.vocab_size is not None:
        raise ValueError(
            f"--vocab-size only applies with --train-tokenizer / --train-sentencepiece (the size "
            f"of the tokenizer they train); add --train-tokenizer bpe (or --train-sentencepiece) "
            f"to train one of {args.vocab_size} tokens, or drop --vocab-size (the vocabulary "
            f"is then --tokenizer's)"
        )
    return tokenizer


def _note_skipped(inputs: Sequence[str]) -> None:
    """A note naming the files the input directories hold that are not read (their type)."""
    from megapar.data.inputs import INPUT_SUFFIXES, rename_hint, unread_inputs

    skipped, tokenizer = unread_inputs(inputs)
    if skipped:
        kinds = sorted({os.path.splitext(f)[1] or os.path.basename(f) for f in skipped})
        print(
            f"megapar-data: note: {counted(len(skipped), 'file')} in the input directories "
            f"{'is' if len(skipped) == 1 else 'are'} not {' / '.join(INPUT_SUFFIXES)} and "
            f"{'is' if len(skipped) == 1 else 'are'} not read ({', '.join(kinds[:8])}"
            f"{', ...' if len(kinds) > 8 else ''}; e.g. {skipped[0]}){rename_hint(skipped)}",
            file=sys.stderr,
        )
    if tokenizer:
        print(
            f"megapar-data: note: {counted(len(tokenizer), 'file')} of a tokenizer in the "
            f"input directories not read as text (e.g. {tokenizer[0]}; --tokenizer "
            f"{shell_word(os.path.dirname(tokenizer[0]))} tokenizes with it)",
            file=sys.stderr,
        )


@quiet_when_stdout_closes
def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code. A run that fails after training a tokenizer
    removes it (and nothing else of the destination is touched: the dataset is renamed into
    place at the end)."""
    exit_uncollected()  # torch's heap (where a command imports it) left to the OS at exit
    args = build_parser().parse_args(argv)
    from megapar.data.indexed import IndexedDataset
    from megapar.data.inputs import check_read_once
    from megapar.data.preprocess import (
        check_has_text,
        expand_inputs,
        preprocess_files,
        unknown_tokens_note,
    )

    trained: list[str] = []  # the tokenizer this run trains, removed again if the run fails
    replaced = False
    from megapar.faults.stop import sigterm_as_exit

    previous = sigterm_as_exit()
    try:
        from megapar.training.validate import check_writable

        check_flags(args)
        files = _own_tokenizer_left_out(args, expand_inputs(args.input))
        check_read_once(args.input)  # a file given twice is not tokenized twice
        _check_unread(args, files)  # before any training
        _note_skipped(args.input)
        check_writable(args.output_prefix, "--output-prefix", kind="file")
        check_overwrite(args)
        replaced = any(os.path.lexists(p) for p in outputs(args)[3:])
        if args.train_tokenizer is not None or args.train_sentencepiece:  # nothing to train on
            check_has_text(
                files, args.split_lines, args.jsonl_key, args.allow_invalid_utf8, args.sft_keys
            )
        tokenizer = train_tokenizer(args, trained, files)
        report: dict = {}
        stats: dict = {}
        prefix = preprocess_files(
            files,
            args.output_prefix,
            tokenizer,
            workers=args.workers,
            split_paragraphs=args.split_lines,
            jsonl_key=args.jsonl_key,
            progress=show_progress(False if args.no_progress else None),
            format=args.format,
            allow_invalid_utf8=args.allow_invalid_utf8,
            report=report,
            stats=stats,
            sft_keys=args.sft_keys,
            overwrite=args.overwrite,
        )
        for path, count in report.items():
            print(
                f"megapar-data: warning: {path}: {counted(count, 'byte')} of invalid UTF-8 "
                "replaced "
                f"with U+FFFD",
                file=sys.stderr,
            )
        if stats.get("empty_docs") and args.sft_keys is not None:
            print(
                f"megapar-data: warning: {stats['empty_docs']:,} of "
                f"{counted(stats['docs'], 'record')} "
                f"tokenized to no ids in either field (only their end-of-document token was "
                f"written): fill or drop the records whose {' and '.join(args.sft_keys)} are "
                f"empty",
                file=sys.stderr,
            )
        elif stats.get("empty_docs"):
            print(
                f"megapar-data: warning: {stats['empty_docs']:,} of "
                f"{counted(stats['docs'], 'document')} "
                f"tokenized to no ids (only their end-of-document token was written); "
                f"tokenizer {tokenizer} may not cover their text",
                file=sys.stderr,
            )
        unknown = unknown_tokens_note(stats, tokenizer)
        if unknown:
            print(f"megapar-data: warning: {unknown}", file=sys.stderr)
        if stats.get("eod_guessed"):
            name, tid = stats["eod_guessed"]
            print(
                f"megapar-data: note: tokenizer {tokenizer} names no eos_token in its "
                f"tokenizer_config.json; its {name!r} (id {tid}) ends each document, as the "
                f"usual name of one (transformers' eos_token_id is None for it: set eos_token "
                f"there to say so)",
                file=sys.stderr,
            )
        if stats.get("eod_inside"):
            print(
                f"megapar-data: note: {stats['eod_inside']:,} of "
                f"{counted(stats['docs'], 'document')} "
                f"{'holds' if stats['eod_inside'] == 1 else 'hold'} the end-of-document token "
                f"before their end: tokenizer {tokenizer} encodes the text of a special "
                f"token (e.g. '<|endoftext|>' written out) as the token, as transformers does, and "
                f"--attention-mask-type block_causal, --reset-position-ids and --eod-mask-loss "
                f"take a document boundary there",
                file=sys.stderr,
            )
    except (ValueError, FileNotFoundError) as e:
        note = _remove_trained(trained, replaced, args.output_prefix)
        print(f"megapar-data: error: {e}{note}", file=sys.stderr)
        return 2
    except OSError as e:  # the disk full, the directory made read-only: one line, not a stack
        note = _remove_trained(trained, replaced, args.output_prefix)
        where = f" ({e.filename})" if e.filename and e.filename != args.output_prefix else ""
        print(
            f"megapar-data: error: {e.strerror or e}{where} while writing "
            f"{args.output_prefix}; nothing was written (the dataset is renamed into place "
            f"only when complete); free space or choose another --output-prefix{note}",
            file=sys.stderr,
        )
        return 1
    except (KeyboardInterrupt, SystemExit) as exc:
        note = _remove_trained(trained, replaced, args.output_prefix)
        sigterm = isinstance(exc, SystemExit)
        if isinstance(exc, SystemExit) and exc.code != 128 + signal.SIGTERM:
            raise
        print(
            f"megapar-data: {'terminated (SIGTERM)' if sigterm else 'interrupted'}; nothing was "
            f"written (the dataset is renamed into place only when complete, so "
            f"{args.output_prefix} is as it was){note}",
            file=sys.stderr,
        )
        return 128 + signal.SIGTERM if sigterm else 130
    except BaseException:
        _remove_trained(trained, replaced, args.output_prefix)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    ds = IndexedDataset(prefix)
    docs = counted(ds.num_docs, "document")
    if ds.sft_keys is not None:
        docs += f" (prompt / response records: {','.join(ds.sft_keys)})"
    print(
        f"wrote {prefix}.bin/.idx/.json ({args.format} index): {docs}, "
        f"{counted(ds.num_tokens, 'token')} "
        f"({ds.dtype.name}), vocab size {ds.vocab_size}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
