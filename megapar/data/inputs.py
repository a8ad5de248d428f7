"""Reading the inputs of ``megapar-data`` / ``megapar-train --data`` as documents.

``.txt`` (one document, or one per blank-line paragraph), ``.jsonl`` / ``.json`` (JSON lines, an
array of objects, or in a ``.json`` one object, the text under a key), ``.parquet`` (a column, a
record batch at a time), and directories of them. Every document's CRLF / lone CR line endings
become LF (`normalize_newlines`); text that is not UTF-8 is counted and refused above a
threshold, and a UTF-16 / UTF-32 text is refused (`read_text`), as is a binary file given as
text, compressed or with NUL bytes (`check_not_binary`). See `megapar.data.preprocess`
for what is done with the documents.
"""

from __future__ import annotations

import codecs
import json
import os
import re
from collections.abc import Iterator, Sequence

from megapar.one_line_parser import shell_word
from megapar.wording import counted, first_few

_PARAGRAPH_SPLIT = re.compile(r"\n[ \t\r\f\v]*\n")
#: File types taken from input directories.
INPUT_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
#: The types whose documents' text is under a key (--jsonl-key); a .txt file's is all of it.
KEYED_SUFFIXES = (".jsonl", ".json", ".parquet")
#: Largest share of a text file's bytes that may be invalid UTF-8 without --allow-invalid-utf8.
MAX_INVALID_UTF8 = 0.001
_ESCAPED = re.compile("[\udc80-\udcff]")
#: UTF-8's byte-order mark, as Windows tools start a text: not text, dropped where read.
BOM = b"\xef\xbb\xbf"
_SURROGATE = re.compile("[\ud800-\udfff]")
"""A UTF-16 surrogate: JSON's ``\\ud83d`` escape parses to one, alone, which is no character
(the tokenizers library refuses the string)."""
_CR = re.compile("\r\n?")
#: Byte-order marks of the wide encodings (UTF-32's first: its little-endian one starts like
#: UTF-16's), which Windows tools write: such a text is not UTF-8 but mostly decodes as UTF-8,
#: NUL bytes and all.
_WIDE_BOMS = (
    (b"\xff\xfe\x00\x00", "UTF-32"),
    (b"\x00\x00\xfe\xff", "UTF-32"),
    (b"\xff\xfe", "UTF-16"),
    (b"\xfe\xff", "UTF-16"),
)


def is_raw_text(path: str) -> bool:
    """Whether a --data path is text to tokenize (a file or directory) rather than the prefix of
    a prepared dataset (its .bin / .idx). A missing path named as text (``.jsonl``, ``.parquet``,
    ...) is text, so that it is reported missing as a file, not as a prefix's .bin / .idx."""
    return (
        path.endswith((".txt", ".text", ".md"))
        or os.path.isdir(path)
        or (os.path.isfile(path) and not os.path.exists(path + ".bin"))
        or (
            path.endswith(INPUT_SUFFIXES)
            and not any(os.path.exists(path + ext) for ext in ("", ".bin", ".idx"))
        )
    )


def normalize_newlines(text: str) -> str:
    """``text`` with CRLF and lone CR line endings turned into LF."""
    return _CR.sub("\n", text) if "\r" in text else text


def read_text(path: str, allow_invalid_utf8: bool = False, report: dict | None = None) -> str:
    """A file's text with LF line endings (`normalize_newlines`); invalid UTF-8 bytes become
    U+FFFD and are counted into ``report[path]``. Raises ValueError above ``MAX_INVALID_UTF8``
    unless allowed, and for a text that starts with a UTF-16 / UTF-32 byte-order mark."""
    with open(path, "rb") as f:
        raw = f.read()
    check_is_text(path, raw[:BINARY_PROBE])  # a directory's .txt, found by its name
    raw = raw.removeprefix(BOM)  # not text: no tokens for it
    return normalize_newlines(_decode_utf8(path, raw, len(raw), allow_invalid_utf8, report))


def _decode_utf8(
    path: str, raw: bytes, size: int, allow_invalid_utf8: bool, report: dict | None
) -> str:
    """`raw` (bytes of `path`, a file of `size` bytes) as text, its invalid UTF-8 bytes U+FFFD
    and counted into ``report[path]`` (added to what earlier parts of the file counted there).
    ValueError once the file's count exceeds ``MAX_INVALID_UTF8`` of `size`, unless allowed."""
    text = raw.decode("utf-8", errors="surrogateescape")
    bad = len(_ESCAPED.findall(text))
    if not bad:
        return text
    if report is not None:
        bad += report.get(path, 0)
    if bad > MAX_INVALID_UTF8 * size and not allow_invalid_utf8:
        raise ValueError(
            f"{path}: {bad:,} of {counted(size, 'byte')} ({100 * bad / size:.1f} %) "
            f"{'is' if bad == 1 else 'are'} not valid "
            f"UTF-8 (binary data or another encoding?); convert it to UTF-8 (e.g. iconv -f "
            f"latin1 -t utf-8) or pass --allow-invalid-utf8 to replace "
            f"{'it' if bad == 1 else 'them'} with U+FFFD"
        )
    if report is not None:
        report[path] = bad
    return _ESCAPED.sub("\ufffd", text)


def check_not_wide(path: str, head: bytes | None = None) -> None:
    """ValueError (one line naming the conversion) when text file `path` (a .txt, .jsonl or
    .json; `head`: its first 4 bytes, if already read) starts with a UTF-16 / UTF-32
    byte-order mark."""
    if head is None:
        with open(path, "rb") as f:
            head = f.read(4)
    for mark, wide in _WIDE_BOMS:
        if head.startswith(mark):
            stem, ext = os.path.splitext(path)
            converted = stem + "-utf8" + (ext if ext in (".jsonl", ".json") else ".txt")
            raise ValueError(
                f"{path} is {wide} (it starts with {wide}'s byte-order mark), not UTF-8; "
                f"convert it to UTF-8 (e.g. iconv -f {wide} -t UTF-8 {shell_word(path)} > "
                f"{shell_word(converted)}) and pass that"
            )


#: The first bytes of binary formats an input given as text may be in, what each is and how to
#: get text out of it (``{path}``: the file, ``{text}``: a name for its text, both quoted for
#: the shell; to standard output, as `gunzip -k` refuses a name without its suffix).
_BINARY_MAGIC = (
    (b"\x1f\x8b", "gzip-compressed", "decompress it (gunzip -c {path} > {text})"),
    (b"BZh", "bzip2-compressed", "decompress it (bunzip2 -c {path} > {text})"),
    (b"\xfd7zXZ\x00", "xz-compressed", "decompress it (unxz -c {path} > {text})"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed", "decompress it (unzstd -c {path} > {text})"),
    (b"PK\x03\x04", "a zip archive", "extract it (unzip {path})"),
    (b"\x93NUMPY", "a NumPy array (.npy)", "save the text it holds as a .txt file"),
)
#: A parquet file's first bytes (binary, with NUL bytes, under another name than .parquet).
_PARQUET = b"PAR1"
#: What an input may be, for the refusal of one that is none of them.
READ_AS = "UTF-8 text (.txt or any other name), .jsonl / .json and .parquet"
#: Bytes of a file's start that `check_not_binary` reads: NUL among them is binary, as git and
#: grep tell binary from text.
BINARY_PROBE = 1024


def check_not_binary(path: str, head: bytes | None = None) -> None:
    """ValueError (one line: what the file is, what inputs are read, the fix) when file `path`,
    read as text (any suffix but ``.parquet``; `head`: its first `BINARY_PROBE` bytes, if
    already read), is binary: a compressed, archive, NumPy or parquet file by its first bytes,
    or NUL bytes among its first KiB (after `check_not_wide`, which names a UTF-16 / UTF-32
    text by its byte-order mark)."""
    if head is None:
        with open(path, "rb") as f:
            head = f.read(BINARY_PROBE)
    head = head[:BINARY_PROBE]
    known = [  # none of them starts a UTF-8 text (but "BZh")
        (kind, fix)
        for magic, kind, fix in _BINARY_MAGIC
        if head.startswith(magic) and (magic != b"BZh" or _bzip2(head))
    ]
    if known:
        kind, fix = known[0]
    else:
        if b"\x00" not in head:
            return
        if head.startswith(_PARQUET):
            kind, fix = "a parquet file", "name it .parquet (its text column is read)"
        else:
            kind = "binary (NUL bytes in its first KiB)"
            fix = "convert it to one of them (UTF-16 / UTF-32 text: to UTF-8, e.g. with iconv)"
    raise ValueError(
        f"input {path} is {kind}, not text; the inputs read are {READ_AS}: "
        + fix.format(path=shell_word(path), text=shell_word(_text_name(path)))
        + ", and pass that"
    )


_COMPRESSED = (".gz", ".bz2", ".xz", ".zst")


def _text_name(path: str) -> str:
    """A name for compressed file `path`'s text, of no file there (a decompression to it would
    empty one): without its compression suffix (a.jsonl.gz: a.jsonl; a.gz: a.txt), else beside
    it (plays.txt: plays-text.txt, then plays-text-2.txt, ...)."""
    stem, ext = os.path.splitext(path)
    if ext in _COMPRESSED:
        text = stem if os.path.splitext(stem)[1] else stem + ".txt"
        if not os.path.lexists(text):
            return text
        stem, ext = os.path.splitext(text)
    inner = ext if ext in (".jsonl", ".json") else ".txt"
    n = 1
    while os.path.lexists(name := stem + "-text" + (f"-{n}" if n > 1 else "") + inner):
        n += 1
    return name


def check_is_text(path: str, head: bytes | None = None) -> None:
    """`check_not_wide` and `check_not_binary` of file `path` from one read of its first
    `BINARY_PROBE` bytes (`head`, if already read)."""
    if head is None:
        with open(path, "rb") as f:
            head = f.read(BINARY_PROBE)
    check_not_wide(path, head[:4])
    check_not_binary(path, head)


def _bzip2(head: bytes) -> bool:
    """Whether `head` (starting "BZh") is a bzip2 stream's: a block size digit, then the
    block magic (a text may start with "BZh")."""
    return head[3:4].isdigit() and head[4:10] == b"1AY&SY"


HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
"""The weights file a transformers model directory holds beside its config.json."""


def model_directory(path: str) -> str | None:
    """What a directory given as text is when it is a model, not text: "a megapar checkpoint"
    (its ``latest``, or a ``step_*`` directory with a ``manifest.json``, or a step directory
    itself: ``manifest.json`` beside ``.safetensors`` shards) or "a Hugging Face model" (a
    ``config.json`` beside its weights); None otherwise. Both hold JSON files that would be
    read as documents, and fail on their first record."""
    try:
        names = os.listdir(path)
    except OSError:
        return None
    steps = (n for n in names if n.startswith("step_"))
    if (
        os.path.isfile(os.path.join(path, "latest"))
        or any(os.path.isfile(os.path.join(path, n, "manifest.json")) for n in steps)
        or ("manifest.json" in names and any(n.endswith(".safetensors") for n in names))
    ):
        return "a megapar checkpoint"
    if "config.json" in names and any(n in names for n in HF_WEIGHTS):
        return "a Hugging Face model"
    return None


def saved_hf_dataset(path: str) -> str | None:
    """The one line for directory `path` when Hugging Face ``datasets`` wrote it
    (``save_to_disk``: Arrow files beside ``state.json``, or a ``dataset_dict.json`` over
    split directories), else None: its JSON files would be read as documents, and fail on
    their first record, its Arrow data not read. The line names the export to parquet that
    megapar reads (a DatasetDict's ``train`` split, or its first)."""
    try:
        names = os.listdir(path)
    except OSError:
        return None
    split = ""
    if "dataset_dict.json" in names:
        splits = sorted(n for n in names if os.path.isfile(os.path.join(path, n, "state.json")))
        split = f"[{json.dumps('train' if 'train' in splits or not splits else splits[0])}]"
    elif not ("state.json" in names and any(n.endswith(".arrow") for n in names)):
        return None
    out = os.path.basename(os.path.normpath(path)) + ".parquet"
    code = (
        f"import datasets; datasets.load_from_disk({json.dumps(path)}){split}"
        f".to_parquet({json.dumps(out)})"
    )
    return (
        f"input {path} is a Hugging Face datasets directory (save_to_disk: Arrow files, not "
        f"text); export it to parquet, python3 -c {shell_word(code)}, and pass {out} "
        f"(with --jsonl-key COLUMN when the text is not in a column 'text')"
    )


def expand_inputs(inputs: Sequence[str]) -> list[str]:
    """Input paths with directories replaced by their ``.txt``/``.jsonl`` files (recursive,
    sorted; hidden files and directories left out), less the ``.json`` that describes a tokenized
    dataset beside its ``.bin`` and ``.idx`` (megapar-data's output written into the input
    directory is not text). A file given by name is read as text whatever its suffix (but
    ``.parquet``): ValueError when it is UTF-16 / UTF-32 or binary."""
    files: list[str] = []
    for path in inputs:
        path = os.fspath(path)
        if os.path.isdir(path):
            model = model_directory(path)
            if model is not None:
                raise ValueError(
                    f"input {path} is {model}, not text; pass the text (or the directory of "
                    f"text) to tokenize"
                )
            saved = saved_hf_dataset(path)
            if saved is not None:
                raise ValueError(saved)
            found, others, tokenizer = _directory_files(path)
            if not found:
                raise FileNotFoundError(_nothing_to_read(path, others, tokenizer))
            files += found
        elif os.path.isfile(path):
            stem = dataset_of(path)
            if stem is not None:
                raise ValueError(
                    f"input {path} is a file of the tokenized dataset {stem}, not text; pass "
                    f"the text it was made from (megapar-train --data {shell_word(stem)} trains "
                    f"on it)"
                )
            ext = os.path.splitext(path)[1]
            if ext != ext.lower() and ext.lower() in KEYED_SUFFIXES:  # read as plain text
                raise ValueError(
                    f"input {path}: megapar knows a file's kind by its lower-case suffix, and "
                    f"{ext} would be read as plain text; rename "
                    f"it {os.path.basename(_lower_suffix(path))}"
                )
            if not path.endswith(".parquet"):  # its name is no promise of text
                if _sentencepiece_model(path):
                    raise ValueError(_a_tokenizer_not_text(path, [path]))
                check_is_text(path)
            files.append(path)
        else:
            raise FileNotFoundError(
                f"input {path} does not exist; pass text files, .jsonl files or directories"
            )
    return files


def _nothing_to_read(path: str, others: list[str], tokenizer: Sequence[str] = ()) -> str:
    """The line for input directory `path` that holds no file of `INPUT_SUFFIXES`, `others`
    (other files) perhaps: what they are and the fix, from the first of them (compressed,
    binary: `check_is_text`'s line; text under another name: give it by its own path); or only
    a tokenizer's files (`tokenizer`)."""
    line = f"input directory {path} holds no {' / '.join(INPUT_SUFFIXES)} files"
    found = [] if others else tokenized_datasets(path)  # megapar-data's output as its input
    if found:
        return (
            f"input directory {path} holds tokenized datasets ({named_datasets(found)}: "
            f"megapar-data's output), no text: train on one with megapar-train --data "
            f"{shell_word(found[0])}, or give the text they were made from"
        )
    if tokenizer and not others:
        names = ", ".join(os.path.basename(f) for f in tokenizer[:3])
        return (
            f"input directory {path} holds only a tokenizer's files ({names}), no text: give "
            f"it as --tokenizer {shell_word(os.path.dirname(tokenizer[0]))} and the text to "
            f"tokenize as the input"
        )
    if not others:
        return line
    if all(map(_sentencepiece_model, others)):
        return _a_tokenizer_not_text(path, others)
    kinds = sorted({os.path.splitext(f)[1] or "no suffix" for f in others})
    line += (
        f", only {len(others)} other file{'s' if len(others) > 1 else ''} "
        f"({', '.join(kinds[:5])}{', ...' if len(kinds) > 5 else ''}), not read"
    )
    cased = _read_in_another_case(others)
    if cased:  # x.JSONL: not "rename them .txt", which would read its JSON syntax as text
        renamed = [_lower_suffix(f) for f in cased]
        return (
            f"{line}: megapar knows a file's kind by its lower-case suffix; rename "
            + ", ".join(
                f"{shell_word(f)} to {os.path.basename(r)}" for f, r in zip(cased[:3], renamed)
            )
            + (f" (and {len(cased) - 3} more)" if len(cased) > 3 else "")
        )
    texts, problem = [], ""  # a text file beside one that is not (a .md and a .jsonl.gz)
    for other in others[:20]:
        try:
            check_is_text(other)
            texts.append(other)
        except ValueError as e:
            problem = problem or str(e)
    if not texts:
        return f"{line}: {problem}"
    return (
        f"{line}: give such a file by its own path ({shell_word(texts[0])}: a file named as "
        f"input is read as text whatever its name), or rename "
        f"{'the text ones' if problem else 'them'} .txt" + (f"; and {problem}" if problem else "")
    )


def rename_hint(skipped: Sequence[str]) -> str:
    """ "; rename x.JSONL to x.jsonl to read it" for the first of the unread files `skipped`
    whose suffix is a read one in another case; "" where none is."""
    cased = _read_in_another_case(skipped)
    if not cased:
        return ""
    more = f" (and {len(cased) - 1} more)" if len(cased) > 1 else ""
    return (
        f"; rename {shell_word(cased[0])} to {os.path.basename(_lower_suffix(cased[0]))}{more} "
        f"to read it: a file's kind is known by its lower-case suffix"
    )


def _read_in_another_case(files: Sequence[str]) -> list[str]:
    """The `files` whose suffix is one of `INPUT_SUFFIXES` in another case (x.JSONL, y.TXT)."""
    return [f for f in files if os.path.splitext(f)[1].lower() in INPUT_SUFFIXES]


def _lower_suffix(path: str) -> str:
    """`path` with its suffix in lower case (x.JSONL: x.jsonl)."""
    stem, ext = os.path.splitext(path)
    return stem + ext.lower()


def _sentencepiece_model(path: str) -> bool:
    """Whether file `path` is a SentencePiece model: named ``.model``, its first KiB binary (a
    NUL byte, or bytes that are not UTF-8: the protobuf's scores), as no text is."""
    if not path.endswith(".model"):
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(1024)
    except OSError:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return True
    return b"\0" in head


def _a_tokenizer_not_text(path: str, models: list[str]) -> str:
    """The line for input `path` that is a SentencePiece model, or a directory holding only
    `models` (``.model`` files): a tokenizer, not text; the fix names the --tokenizer."""
    names = ", ".join(os.path.basename(f) for f in models[:3]) + (
        ", ..." if len(models) > 3 else ""
    )
    what = (
        f"input {path} is a SentencePiece model: a tokenizer, not text; give it"
        if models == [path]
        else f"input directory {path} holds only SentencePiece models ({names}): tokenizers, "
        f"not text; give one"
    )
    return f"{what} as --tokenizer {shell_word(models[0])} and the text to tokenize as the input"


def check_read_once(inputs: Sequence[str]) -> None:
    """Each file `expand_inputs` finds in `inputs` comes from one input only: the same path given
    twice, or a file given beside a directory that holds it, would be tokenized twice (a blend
    weights datasets at training, not by repeating an input). Raises ValueError naming it."""
    seen: dict[str, tuple[int, str]] = {}
    for i, given in enumerate(map(os.fspath, inputs)):
        for f in expand_inputs([given]) if os.path.exists(given) else []:
            j, first = seen.setdefault(os.path.realpath(f), (i, given))
            if j == i:
                continue
            how = (
                f"--input {shell_word(given)} is given twice"
                if first == given
                else f"from --input {shell_word(first)} and from --input {shell_word(given)}"
            )
            raise ValueError(
                f"input {shell_word(f)} would be tokenized twice ({how}); pass each file once "
                f"(to weight a text more, tokenize it on its own and blend at training: "
                f"megapar-train --data 0.7 A 0.3 B)"
            )


def unread_inputs(inputs: Sequence[str]) -> tuple[list[str], list[str]]:
    """The files in the input directories that `expand_inputs` leaves out, each directory
    walked once: (those left out for their type (not ``INPUT_SUFFIXES``; hidden files, what
    hidden directories hold and a tokenized dataset's own files not counted), those left out as
    a tokenizer's (`TOKENIZER_FILES` beside a tokenizer: a corpus kept with the tokenizer it is
    for))."""
    walks = [_directory_files(p) for p in map(os.fspath, inputs) if os.path.isdir(p)]
    return sorted(f for w in walks for f in w[1]), sorted(f for w in walks for f in w[2])


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
)
"""The files of a transformers tokenizer directory (GPT-2's vocab.json and merges.txt, a fast
tokenizer's tokenizer.json, BERT's vocab.txt, their configs): in a directory given as text
beside a tokenizer (`tokenizer_names`) they are not read as documents (vocab.json would fail
as JSON records, merges.txt and vocab.txt would be trained on as text)."""


def tokenizer_names(names: Sequence[str]) -> set[str]:
    """Of the files `names` of one directory, those that are a tokenizer's (`TOKENIZER_FILES`)
    when the directory holds a tokenizer (tokenizer.json, tokenizer_config.json, or GPT-2's
    vocab.json with merges.txt); the empty set otherwise (a corpus's own vocab.txt is text)."""
    present = set(names)
    if not (
        {"tokenizer.json", "tokenizer_config.json"} & present
        or {"vocab.json", "merges.txt"} <= present
    ):
        return set()
    return present & set(TOKENIZER_FILES)


def _checkpoint_dir(path: str) -> bool:
    """Whether directory `path` is a megapar checkpoint's root (a ``latest`` file) or step
    directory (``manifest.json`` beside ``model_tp*_pp*.safetensors`` shards): a run's output,
    whose manifest would be read as JSON records and its log as text."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    if "latest" in names and any(n.startswith("step_") for n in names):
        return True
    return "manifest.json" in names and any(
        n.startswith("model_tp") and n.endswith(".safetensors") for n in names
    )


def _directory_files(path: str) -> tuple[list[str], list[str], list[str]]:
    """The files under directory `path` (recursive, sorted): those read as input, those left
    out for their type and those left out as a tokenizer's (`unread_inputs`,
    `tokenizer_names`). The tokenizer directory a tokenized dataset
    beside it records (``PREFIX-tokenizer/`` of ``megapar-data --train-tokenizer bpe``) is
    megapar-data's output, not text: it is not walked; nor is a hidden directory, nor read a
    hidden file (a name that starts with ``.``: a ``.git``, macOS's ``._`` copies of a file's
    attributes, an editor's lock or a tool's state), as ``ls`` leaves them out, nor a megapar
    checkpoint's directory (`_checkpoint_dir`: megapar-train's ``--save`` inside a corpus). A
    symbolic link to a directory is walked as the directory (a corpus of linked shards), once."""
    read, skipped, tokenizer = [], [], []
    walked = {os.path.realpath(path)}  # symbolic links are followed, each directory walked once
    for root, dirs, names in os.walk(path, followlinks=True):
        own = _dataset_tokenizer_dirs(root, names)
        tokenizers = tokenizer_names(names)
        kept = []
        for d in sorted(dirs):
            real = os.path.realpath(os.path.join(root, d))
            if d.startswith(".") or real in own or real in walked or _checkpoint_dir(real):
                continue
            kept.append(d)
            walked.add(real)
        dirs[:] = kept
        for n in names:
            full = os.path.join(root, n)
            if n.startswith("."):  # hidden: a macOS ._ copy, an editor's .#lock, a tool's state
                continue
            if n in tokenizers:
                tokenizer.append(full)
                continue
            if n.endswith(INPUT_SUFFIXES):
                if not _dataset_sidecar(full):
                    read.append(full)
                continue
            stem, ext = os.path.splitext(full)
            dataset = ext in (".bin", ".idx") and os.path.isfile(stem + ".json")
            if not dataset:
                skipped.append(full)
    return sorted(read), sorted(skipped), sorted(tokenizer)


def iter_documents(
    files: Sequence[str],
    split_paragraphs: bool = False,
    jsonl_key: str = "text",
    allow_invalid_utf8: bool = False,
    report: dict | None = None,
) -> Iterator[tuple[str, int]]:
    """Yield ``(document_text, source_bytes)`` for every non-blank document of ``files``, its
    line endings LF whatever its source (invalid UTF-8: see `read_text`)."""
    for text, size in _documents(files, split_paragraphs, jsonl_key, allow_invalid_utf8, report):
        yield normalize_newlines(text), size


def _record_lines(f) -> Iterator[bytes]:
    """The lines of binary file `f`, each ended by LF, CRLF or CR (old Mac): a JSON record
    holds no raw CR (JSON escapes it), so a CR ends one as LF does."""
    for raw in f:
        if b"\r" not in raw:
            yield raw
        else:
            yield from raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n").splitlines(True)


def _documents(files, split_paragraphs, jsonl_key, allow_invalid_utf8, report):
    report = {} if report is None else report  # invalid UTF-8 counted per file all the same
    for path in files:
        if path.endswith(".parquet"):
            yield from _parquet_documents(path, jsonl_key)
            continue
        check_not_wide(path)  # JSON too: its first line would parse, the next ones not
        kind = _json_kind(path)[0] if path.endswith(".json") else "lines"
        if kind in ("array", "object"):
            whole = _load_json(path, allow_invalid_utf8, report)
            if kind == "array":
                yield from _json_array_documents(path, whole, jsonl_key)
            else:
                yield from _json_object_document(path, whole, jsonl_key)
            continue
        if path.endswith((".jsonl", ".json")):
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                for lineno, raw in enumerate(_record_lines(f), 1):
                    if not raw.strip():
                        continue
                    line = _decode_utf8(
                        path,
                        raw.removeprefix(BOM) if lineno == 1 else raw,
                        size,
                        allow_invalid_utf8,
                        report,
                    )
                    text = _line_text(path, lineno, line, jsonl_key)
                    if not isinstance(text, str):  # never dropped silently
                        kind = type(text).__name__
                        kind = (
                            "null"
                            if text is None
                            else (("an " if kind[0] in "aeiou" else "a ") + kind)
                        )
                        fix = (  # the default field: the text may be under another name
                            "fix the line or pass --jsonl-key naming the text field"
                            if jsonl_key == "text"
                            else "fix the line (--jsonl-key's field holds the text)"
                        )
                        raise ValueError(
                            f"{path}:{lineno}: field {jsonl_key!r} is {kind}, not a string; {fix}"
                        )
                    check_characters(f"{path}:{lineno}", jsonl_key, text)
                    if text.strip():
                        yield text, len(line)
            continue
        content = read_text(path, allow_invalid_utf8, report)  # LF already: paragraphs split
        if not split_paragraphs:
            if content.strip():
                yield content, os.path.getsize(path)
            continue
        for para in _PARAGRAPH_SPLIT.split(content):
            if para.strip():
                yield para.strip("\n"), len(para) + 2


def _line_text(path: str, lineno: int, line: bytes | str, key: str):
    """Field `key` of JSON Lines line `lineno` of `path`; ValueError in one line naming what is
    wrong with it: not JSON (repair the line), not an object, or no field `key` (--jsonl-key)."""
    record = _line_object(path, lineno, line, key)
    if key not in record:
        fields = ", ".join(repr(k) for k in list(record)[:5]) or "none"
        pair = _pair_keys(record)
        sft = (
            f"; or, for prompt / response records, --sft-keys {pair} to read them as records "
            f"(the loss on the responses only)"
            if pair
            else ""
        )
        fix = (
            f"pass --jsonl-key naming the text field, or add {key!r} to the line"
            if key == "text"  # the default: the field may have another name
            else f"add {key!r} (--jsonl-key's) to the line, or give --jsonl-key the field every "
            f"line has"
        )
        raise ValueError(
            f"{path}:{lineno}: the object has no field {key!r} (its fields: {fields}); {fix}"
            f"{_records_inside(record, key) or sft}"
        )
    return record[key]


#: Field names of a prompt and of its response in common fine-tuning records (TRL's
#: prompt / completion, Alpaca's instruction / output, ...), for `_pair_keys`.
PROMPT_FIELDS = ("prompt", "instruction", "question", "input", "query")
RESPONSE_FIELDS = ("completion", "response", "output", "answer")


def _pair_keys(record: dict) -> str | None:
    """``PROMPT,RESPONSE`` where `record` has a prompt field and a response field of
    `PROMPT_FIELDS` / `RESPONSE_FIELDS` (the first of each), else None."""
    prompt = next((k for k in PROMPT_FIELDS if isinstance(record.get(k), str)), None)
    response = next((k for k in RESPONSE_FIELDS if isinstance(record.get(k), str)), None)
    return f"{prompt},{response}" if prompt and response else None


def _line_object(path: str, lineno: int, line: bytes | str, key: str) -> dict:
    """JSON Lines line `lineno` of `path` (its bytes, or its text decoded) parsed; ValueError in
    one line when it is not UTF-8 (bytes), not JSON (repair the line) or not an object (`key`:
    the field it should have, for the example)."""
    try:
        end = b"\r\n" if isinstance(line, bytes) else "\r\n"
        record = json.loads(line.rstrip(end))  # type: ignore[arg-type]  # a column on this line
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path}:{lineno}: the line is not UTF-8 text (byte {line[e.start]:#04x} at "
            f"column {e.start + 1}); save the file as UTF-8"
        ) from None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}:{lineno}: the line is not valid JSON ({_where(e)}); "
            f"repair or delete the line (each line of a JSON Lines file is one JSON object)"
        ) from None
    if not isinstance(record, dict):
        raise ValueError(
            f"{path}:{lineno}: the line is {_json_type(record)}, not a JSON object with a "
            f'string field {key!r}; make it an object such as {{{json.dumps(key)}: "..."}}'
        )
    return record


#: The inputs --sft-keys reads: JSON Lines (in a .json file too), one record per line.
SFT_SUFFIXES = (".jsonl", ".json")


def parse_sft_keys(value: str) -> tuple[str, str]:
    """The (prompt, response) field names of ``--sft-keys PROMPT,RESPONSE``; ValueError in one
    line when `value` is not two different non-empty names."""
    keys = [k.strip() for k in value.split(",")]
    if len(keys) != 2 or not all(keys) or keys[0] == keys[1]:
        raise ValueError(
            f"--sft-keys {value!r} is not two different field names PROMPT,RESPONSE; pass "
            f"e.g. --sft-keys prompt,response (TRL's prompt-completion records: "
            f"--sft-keys prompt,completion)"
        )
    return keys[0], keys[1]


def check_sft_inputs(files: Sequence[str], keys: Sequence[str]) -> None:
    """ValueError (one line) for an input --sft-keys cannot read: every file must be JSON Lines
    (`SFT_SUFFIXES`; a .json file of one array or object is not)."""
    flag = f"--sft-keys {','.join(keys)}"
    for path in files:
        if not path.endswith(SFT_SUFFIXES):
            raise ValueError(
                f"{flag} reads JSON Lines records, and {path} is not .jsonl / .json; convert "
                f"it to one {{{json.dumps(keys[0])}: ..., {json.dumps(keys[1])}: ...}} object "
                f"per line, or drop --sft-keys to train on its text"
            )
        kind = _json_kind(path)[0] if path.endswith(".json") else "lines"
        if kind != "lines":
            raise ValueError(
                f"{flag} reads JSON Lines records, and {path} is one JSON "
                f"{'array' if kind == 'array' else 'object'}; write one "
                f"object per line (e.g. jq -c '.[]' {shell_word(path)} > records.jsonl)"
            )


def iter_records(files: Sequence[str], keys: Sequence[str]) -> Iterator[tuple[str, str, int]]:
    """Yield ``(prompt, response, source_bytes)`` for every record (non-blank line) of the JSON
    Lines `files`, the fields `keys` of each, their line endings LF; ValueError in one line
    naming the file and line of a record without a string under either key (`check_sft_inputs`
    first, for the files)."""
    check_sft_inputs(files, keys)
    for path in files:
        check_not_wide(path)
        with open(path, "rb") as f:
            for lineno, line in enumerate(_record_lines(f), 1):
                if not line.strip():
                    continue
                record = _line_object(path, lineno, line, keys[0])
                for key in keys:
                    if key not in record:
                        fields = ", ".join(repr(k) for k in list(record)[:5]) or "none"
                        raise ValueError(
                            f"{path}:{lineno}: the record has no field {key!r} (its fields: "
                            f"{fields}); add it, or pass --sft-keys naming the prompt and "
                            f"response fields (now {','.join(keys)})"
                        )
                    if not isinstance(record[key], str):
                        raise ValueError(
                            f"{path}:{lineno}: field {key!r} is {_json_type(record[key])}, "
                            f"not a string; fix the line (--sft-keys reads text fields)"
                        )
                    check_characters(f"{path}:{lineno}", key, record[key])
                yield (
                    normalize_newlines(record[keys[0]]),
                    normalize_newlines(record[keys[1]]),
                    len(line),
                )


def check_characters(where: str, field: str, text: str) -> None:
    """ValueError in one line where the JSON string `text` (field `field` at `where`, e.g.
    ``FILE:LINE``) holds half of a UTF-16 surrogate pair (an escape such as ``\\ud83d``
    without its other half): no character, which no tokenizer encodes."""
    found = _SURROGATE.search(text)
    if found:
        raise ValueError(
            f"{where}: field {field!r} holds an unpaired surrogate escape "
            f"\\u{ord(found.group()):04x} (half of a UTF-16 pair, not a character) at "
            f"character {found.start() + 1}; repair the escape (e.g. \\ud83d\\ude00 is one "
            f"emoji) or delete it"
        )


def _where(e: json.JSONDecodeError) -> str:
    """What a JSON error found and its column: "Expecting ',' delimiter at column 16"."""
    return f"{e.msg}{'' if e.msg.endswith(' at') else ' at'} column {e.colno}"


def _json_type(value) -> str:
    """A JSON value's kind with its article: "an array", "a string", "null", ..."""
    if value is None:
        return "null"
    kind = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    name = kind.get(type(value), type(value).__name__)
    return ("an " if name[0] in "aeiou" else "a ") + name


def reads_key(files: Sequence[str]) -> bool:
    """Whether --jsonl-key applies to any of the input `files` (`KEYED_SUFFIXES`)."""
    return any(f.endswith(KEYED_SUFFIXES) for f in files)


def dataset_of(path: str) -> str | None:
    """The prefix of the tokenized dataset whose ``.bin``, ``.idx`` or ``.json`` `path` is (the
    other two, or for a Megatron-LM index the other one, beside it), else None."""
    stem, ext = os.path.splitext(path)
    if ext == ".json":
        return stem if _dataset_sidecar(path) else None
    if ext in (".bin", ".idx") and os.path.isfile(stem + (".idx" if ext == ".bin" else ".bin")):
        return stem
    return None


def tokenized_datasets(path: str | os.PathLike) -> list[str]:
    """The prefixes of the tokenized datasets in directory `path` (megapar-data's, or
    Megatron-LM's: NAME.bin beside NAME.idx), as paths, sorted; [] for none (or no directory)."""
    names = set(os.listdir(path)) if os.path.isdir(path) else set()
    found = (n[:-4] for n in names if n.endswith(".idx") and n[:-4] + ".bin" in names)
    return sorted(os.path.join(os.fspath(path), n) for n in found)


def named_datasets(found: list[str], most: int = 3) -> str:
    """`tokenized_datasets`' `found` for a message: the first `most`, shell-quoted, and how
    many more ("d/a, d/b, d/c and 3 more")."""
    return first_few([shell_word(p) for p in found], most)


def _dataset_tokenizer_dirs(root: str, names: Sequence[str]) -> set[str]:
    """The real paths of the tokenizer directories that the tokenized datasets in directory
    `root` (files `names`) record (their ``.json``'s ``tokenizer.path``)."""
    found = set()
    for n in names:
        full = os.path.join(root, n)
        if not _dataset_sidecar(full):
            continue
        try:
            with open(full, encoding="utf-8") as f:
                spec = json.load(f).get("tokenizer") or {}
        except (OSError, ValueError, AttributeError):
            continue
        recorded = spec.get("path") if isinstance(spec, dict) else None
        if isinstance(recorded, str) and os.path.isdir(recorded):
            found.add(os.path.realpath(recorded))
    return found


def _dataset_sidecar(path: str) -> bool:
    """Whether `path` is the ``.json`` of a tokenized dataset (its ``.bin`` and ``.idx`` beside)."""
    stem = path[: -len(".json")]
    return (
        path.endswith(".json") and os.path.isfile(stem + ".bin") and os.path.isfile(stem + ".idx")
    )


def _json_kind(path: str) -> tuple[str, dict | None]:
    """How a ``.json`` file holds its documents: "array" (of objects), "object" (one object over
    several lines: its first line alone is no JSON; returned parsed) or "lines" (JSON Lines)."""
    with open(path, "rb") as f:
        head = f.read(4096).removeprefix(BOM).lstrip()
        if head.startswith(b"["):
            return "array", None
        if not head.startswith(b"{"):
            return "lines", None
        f.seek(0)
        first = next((line for line in _record_lines(f) if line.strip()), b"")
    try:  # told apart by their structure: invalid UTF-8 is counted when read (`_load_json`)
        json.loads(first.removeprefix(BOM).decode("utf-8", errors="replace"))
        return "lines", None
    except ValueError:
        pass
    try:
        with open(path, "rb") as f:  # a byte-order mark is not JSON
            record = json.loads(f.read().removeprefix(BOM).decode("utf-8", errors="replace"))
    except ValueError:  # reported line by line, as JSON Lines
        return "lines", None
    return ("object", record) if isinstance(record, dict) else ("lines", None)


def _load_json(path: str, allow_invalid_utf8: bool, report: dict | None):
    """The parsed content of the JSON file `path` (an array, or one object), its invalid UTF-8
    handled as a text's (`_decode_utf8`); ValueError naming the line where it is not JSON."""
    with open(path, "rb") as f:
        raw = f.read()
    text = _decode_utf8(path, raw.removeprefix(BOM), len(raw), allow_invalid_utf8, report)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}:{e.lineno}: the file is not valid JSON ({_where(e)}); repair it there"
        ) from None


def _json_object_document(path: str, record, key: str) -> Iterator[tuple[str, int]]:
    if not isinstance(record.get(key), str):
        raise ValueError(
            f"{path}: the object has no string field {key!r}; fix it or pass --jsonl-key"
            f"{_records_inside(record, key)}"
        )
    check_characters(path, key, record[key])
    if record[key].strip():
        yield record[key], os.path.getsize(path)


def _records_inside(record: dict, key: str) -> str:
    """The hint for a JSON object whose field holds the records (``{"data": [{"text": ...},
    ...]}``): they must be the file's top-level array or lines; else ""."""
    for name, value in record.items():
        if isinstance(value, list) and value and isinstance(value[0], dict) and key in value[0]:
            return (
                f"; its field {name!r} holds the records, and megapar reads a top-level array or "
                f"JSON Lines: write them out, e.g. jq -c '.{name}[]' FILE > FILE.jsonl"
            )
    return ""


def _json_array_documents(path: str, records: list, key: str) -> Iterator[tuple[str, int]]:
    size = os.path.getsize(path) / max(1, len(records))
    for i, record in enumerate(records):
        if not isinstance(record, dict) or not isinstance(record.get(key), str):
            raise ValueError(
                f"{path}: item {i} (counting from 0) is not an object with a string field "
                f"{key!r}; fix it or pass --jsonl-key"
            )
        check_characters(f"{path}: item {i} (counting from 0)", key, record[key])
        if record[key].strip():
            yield record[key], int(size)


def _string_view(pa, kind) -> bool:
    """Whether arrow type `kind` is ``string_view`` (Polars' strings, kept in the parquet
    files it writes)."""
    is_view = getattr(pa.types, "is_string_view", None)
    return bool(is_view and is_view(kind))


def _parquet_documents(path: str, key: str) -> Iterator[tuple[str, int]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(
            f"{path} is not a readable parquet file ({' '.join(str(exc).split())}"
            f"); check the file (truncated or another format?), or leave it "
            f"out"
        ) from None
    if key not in file.schema_arrow.names:
        leaf = key.split(".")[-1]  # a struct's field, however it was named
        nested = [
            f.name
            for f in file.schema_arrow
            if pa.types.is_struct(f.type) and f.type.get_field_index(leaf) >= 0
        ]
        inside = (
            f"; {nested[0]!r} is a struct column holding {leaf!r}, and only "
            f"top-level columns are read: flatten the table (pyarrow's table.flatten() names "
            f"it '{nested[0]}.{leaf}') and pass that name"
            if nested
            else ""
        )
        raise ValueError(
            f"{path}: no column {key!r} (columns: {file.schema_arrow.names}); "
            f"pass --jsonl-key COLUMN{inside}"
        )
    kind = file.schema_arrow.field(key).type
    text = kind.value_type if pa.types.is_dictionary(kind) else kind  # pandas' categorical
    if not (pa.types.is_string(text) or pa.types.is_large_string(text) or _string_view(pa, text)):
        raise ValueError(
            f"{path}: column {key!r} holds {kind}, not text; pass --jsonl-key "
            f"naming the text column"
        )
    size = os.path.getsize(path) / max(1, file.metadata.num_rows)
    batches = file.iter_batches(columns=[key], batch_size=1024)
    row = 0
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowException, OSError) as exc:  # a damaged page further in
            raise ValueError(
                f"{path} is not a readable parquet file "
                f"({' '.join(str(exc).split())}); check the file (truncated?), "
                f"or leave it out"
            ) from None
        if batch is None:
            return
        for text in batch.column(0).to_pylist():
            if text is None:  # never dropped silently (as a .jsonl line's null)
                raise ValueError(
                    f"{path}: row {row} (counting from 0): column {key!r} is null, not a "
                    f"string; fix the file "
                    f"(drop or fill the row) or pass --jsonl-key naming the text column"
                )
            row += 1
            if text.strip():
                yield text, int(size)
