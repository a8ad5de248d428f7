"""Tokenizers: the GPT-2 byte-level BPE and SentencePiece, behind one small interface.

``load_tokenizer(spec)`` accepts:

* ``"gpt2"`` -- the GPT-2 BPE shipped in ``megapar/assets`` (50,257 tokens);
* a directory holding ``vocab.json`` + ``merges.txt`` -- any GPT-2 style byte-level BPE;
* a path to a SentencePiece ``.model`` file;
* ``"sentencepiece"`` -- the small SentencePiece model shipped in ``megapar/assets``;
* a transformers tokenizer directory holding ``tokenizer.json`` (or that file's path): loaded
  offline with the ``tokenizers`` library, exactly as ``AutoTokenizer`` tokenizes text. Its own
  end-of-sequence token (``eos_token`` of ``tokenizer_config.json`` /
  ``special_tokens_map.json``; where it names none, its ``sep_token``, as BERT's tokenizers
  have only that) is the end-of-document token, and the beginning-of-sequence token its
  tokenizer.json's post-processor puts before a text (``bos_id``), as transformers does,
  starts every document in megapar-data when it is not the end-of-document token (nor
  BERT's [CLS]); tokenizer_config.json's ``add_bos_token`` / ``add_eos_token`` are not read,
  as transformers 5 ignores them beside a tokenizer.json.

Every one is a `megapar.data.tokenizer.Tokenizer` (its special tokens: see there).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re

import sentencepiece as spm
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from megapar.data.assets import asset_path, moved_asset
from megapar.data.hf_tokenizer import SAMPLE_TEXTS, load_hf_tokenizer
from megapar.data.inputs import dataset_of
from megapar.data.tokenizer import APPENDED_ORDER, PROBE_TEXT, SpecialTokens, Tokenizer
from megapar.one_line_parser import shell_word

__all__ = [
    "APPENDED_ORDER",
    "PROBE_TEXT",
    "SpecialTokens",
    "Tokenizer",
    "asset_path",
    "load_tokenizer",
    "same_tokenizer",
    "tokenizer_files",
    "encodes_alike",
    "forget_loaded",
    "moved_to",
]

#: A Hugging Face Hub model id (``org/name``), as a --tokenizer that is no path here (nor a
#: file name, nor in a directory that is here).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9]")


def _load_gpt2_bpe(vocab: str, merges: str, path: str) -> Tokenizer:
    try:
        model = models.BPE.from_file(vocab, merges)
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises plain Exception
        message = " ".join(str(exc).split())
        if "out of vocabulary" in message:  # a merge's token missing from the vocabulary:
            # either file may be the damaged one
            what = f"tokenizer files {vocab} and {merges} do not match (or one is damaged)"
        else:
            culprit = merges if "Merges" in message else vocab
            what = f"tokenizer file {culprit} is damaged or not a GPT-2 {os.path.basename(culprit)}"
        raise ValueError(
            f"{what} (tokenizers: {message[:200]}); copy the complete vocab.json and "
            f"merges.txt there"
        ) from None
    backend = HFTokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    size = backend.get_vocab_size()
    present = {}
    eod = backend.token_to_id("<|endoftext|>")
    if eod is not None:
        present["[EOD]"] = eod
    for name in ("[PAD]", "[CLS]", "[SEP]", "[MASK]"):
        tid = backend.token_to_id(name)
        if tid is not None:
            present[name] = tid
    return Tokenizer("gpt2-bpe", path, backend, size, present, base_reserved=list(present.values()))


def _load_sentencepiece(model_path: str) -> Tokenizer:
    try:
        proc = spm.SentencePieceProcessor(model_file=model_path)
    except (RuntimeError, OSError) as exc:  # not a ModelProto: garbage, truncated, another file
        raise ValueError(
            f"tokenizer {model_path} is not a SentencePiece model (sentencepiece: "
            f"{' '.join(str(exc).split())[:160]}); pass a .model file written by "
            f"SentencePiece (or megapar-data --train-tokenizer sentencepiece)"
        ) from None
    size = proc.vocab_size()
    present: dict[str, int] = {}
    for name in ("[PAD]", "[CLS]", "[SEP]", "[MASK]", "[EOD]"):
        tid = proc.piece_to_id(name)
        if proc.id_to_piece(tid) == name:
            present[name] = tid
    if "[EOD]" not in present and proc.eos_id() >= 0:
        present["[EOD]"] = proc.eos_id()
    if "[PAD]" not in present and proc.pad_id() >= 0:
        present["[PAD]"] = proc.pad_id()
    reserved = [i for i in range(size) if proc.is_control(i) or proc.is_unknown(i)]
    tok = Tokenizer(
        "sentencepiece", model_path, proc, size, present, reserved + list(present.values())
    )
    tok.unk_id = proc.unk_id() if proc.unk_id() >= 0 else None
    return tok


def tokenizer_files(tok: Tokenizer) -> list[str]:
    """The files that define `tok` (its vocabulary, merges, model or tokenizer.json and its
    special-token configs), for fingerprints and exports."""
    if tok.kind == "sentencepiece":
        return [tok.path]
    if tok.path == "gpt2":
        return [asset_path("gpt2_vocab.json"), asset_path("gpt2_merges.txt")]
    if tok.kind == "hf":
        return [
            os.path.join(tok.path, n)
            for n in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
            if os.path.isfile(os.path.join(tok.path, n))
        ]
    return [os.path.join(tok.path, "vocab.json"), os.path.join(tok.path, "merges.txt")]


_SPECIAL_LIKE = re.compile(r"^(<[^\s<>]+>|\[[A-Z_]+\])$")


def _check_merges_complete(vocab_file: str, merges: str) -> None:
    """ValueError when merges.txt is cut short (cut at a line break, or empty): in a byte-level
    BPE every token beyond the 256 bytes and the special tokens is made by one merge, so a
    vocab.json of V tokens needs at least V - 256 - (special-looking tokens) merges."""
    with open(vocab_file, encoding="utf-8") as f:
        vocab = json.load(f)  # it loaded already: valid JSON
    specials = sum(1 for token in vocab if _SPECIAL_LIKE.match(token))
    needed, have = len(vocab) - 256 - specials, _count_merges(merges)
    if have < needed:
        raise ValueError(
            f"tokenizer file {merges} is cut short: it has {have:,} merges, but its "
            f"vocab.json's {len(vocab):,} tokens need at least {needed:,} (every "
            f"token beyond the 256 bytes and {specials} special tokens is made by a "
            f"merge); copy the complete merges.txt there"
        )


def same_tokenizer(a: Tokenizer, b: Tokenizer) -> bool:
    """Whether two tokenizers are the same files (wherever they lie): same kind, and the same
    bytes in each of `tokenizer_files`."""
    files_a, files_b = tokenizer_files(a), tokenizer_files(b)
    if a.kind != b.kind or len(files_a) != len(files_b):
        return False
    return all(file_sha256(x) == file_sha256(y) for x, y in zip(files_a, files_b))


def encodes_alike(a: Tokenizer, b: Tokenizer) -> bool:
    """Whether two tokenizers give the same ids, whatever their files' format (e.g. GPT-2's BPE
    and the tokenizer.json an export made of it): the same vocabulary size, end-of-document
    id and beginning-of-document id (or none), and the same ids for `SAMPLE_TEXTS` and 4,000
    characters of the shipped Shakespeare sample."""
    if (a.vocab_size, a.eod_id, a.bos_id) != (b.vocab_size, b.eod_id, b.bos_id):
        return False
    with open(asset_path("shakespeare_sample.txt"), encoding="utf-8") as f:
        texts = [*SAMPLE_TEXTS, f.read(4000)]
    return all(a.encode(text) == b.encode(text) for text in texts)


_DIGESTS: dict[tuple, str] = {}
"""The SHA-256 this process computed, by file and its state (`_file_state`)."""


def _file_state(path: str) -> tuple:
    """What identifies a file's bytes while it is unchanged: its path, inode, size,
    modification and change times (the key of a kept digest, and of a kept tokenizer's files:
    `_files_read`)."""
    st = os.stat(path)
    return (os.path.abspath(path), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def file_sha256(path: str) -> str:
    """Hex SHA-256 of a file's bytes (a tokenizer's, for fingerprints and their checks),
    computed once per process while the file is unchanged (`_file_state`): a run's start-up
    compares one tokenizer's files several times (the dataset's record, a blend's parts, the
    checkpoint's), reading them once."""
    state = _file_state(path)
    digest = _DIGESTS.get(state)
    if digest is None:
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        if _file_state(path) != state:  # written while it was read: not kept
            return digest
        while len(_DIGESTS) >= _KEEP_DIGESTS:
            del _DIGESTS[next(iter(_DIGESTS))]  # the oldest
        _DIGESTS[state] = digest
    return digest


_KEEP_DIGESTS = 64
"""At most this many digests kept (a tokenizer has up to three files)."""


def _count_merges(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip() and not line.startswith("#version"))


def _meant_instead(spec: str) -> str | None:
    """The line for a --tokenizer `spec` that names no file but a file beside it: a
    SentencePiece model given without its ``.model``, or the prefix of a tokenized dataset
    (``spec.bin`` / ``.idx`` / ``.json``), whose ``.json`` records its tokenizer; else None."""
    if os.path.isfile(spec + ".model"):
        return (
            f"tokenizer {spec!r}: no such file or directory; {spec}.model is there: for that "
            f"SentencePiece model pass --tokenizer {shell_word(spec + '.model')}"
        )
    if dataset_of(spec + ".json") is None:
        return None
    return _dataset_line(spec, spec)


NAMED_TOKENIZERS = ("gpt2", "sentencepiece")
"""The --tokenizer values that name a tokenizer rather than a path."""

MEGATRON_TOKENIZER_TYPES = {
    "gpt2bpetokenizer": "gpt2",
    "huggingfacetokenizer": "DIR (a directory holding its tokenizer.json)",
    "sentencepiecetokenizer": "FILE.model (its SentencePiece model)",
    "gptsentencepiecetokenizer": "FILE.model (its SentencePiece model)",
    "llama2tokenizer": "FILE.model (its SentencePiece model)",
}
"""Megatron-LM's --tokenizer-type values (lower-cased), with the --tokenizer that loads the same
tokenizer in megapar."""


def _misspelt(spec: str) -> str:
    """`` (did you mean X?)`` for a --tokenizer `spec` that is neither a name nor an existing
    path but close to one: a named tokenizer (any case) for a bare word, else an entry of the
    path's existing directory that could be a tokenizer (a directory or a .model file); else
    ''."""
    if os.sep not in spec:
        close = difflib.get_close_matches(spec.lower(), NAMED_TOKENIZERS, n=1, cutoff=0.6)
        if close:
            return f" (did you mean {close[0]!r}?)"
    parent = os.path.dirname(spec) or "."
    if not os.path.isdir(parent):
        return ""
    try:
        entries = sorted(
            n
            for n in os.listdir(parent)
            if n.endswith(".model") or os.path.isdir(os.path.join(parent, n))
        )
    except OSError:
        return ""
    close = difflib.get_close_matches(os.path.basename(spec), entries, n=1, cutoff=0.8)
    return f" (did you mean {os.path.join(parent, close[0])!r}?)" if close else ""


def _dataset_line(shown: str, prefix: str) -> str:
    """The line for a --tokenizer `shown` that is the tokenized dataset `prefix` or one of its
    files: not a tokenizer; the one its ``.json`` records (a Megatron-LM index has none)."""
    files = ".bin / .idx / .json" if os.path.isfile(prefix + ".json") else ".bin / .idx"
    what = "the prefix" if shown == prefix else "a file"
    return (
        f"tokenizer {shown!r} is {what} of a tokenized dataset ({prefix}{files}), not a "
        f"tokenizer; {_made_with(prefix)}"
    )


def _made_with(prefix: str) -> str:
    """What to pass for the tokenized dataset `prefix`'s tokenizer: the one its ``.json``
    records, which megapar-train --data takes by itself (a Megatron-LM index records none)."""
    if not os.path.isfile(prefix + ".json"):  # Megatron-LM's: megapar-train --data needs it
        return "pass the tokenizer it was made with"
    recorded = None
    try:
        with open(prefix + ".json", encoding="utf-8") as f:
            recorded = (json.load(f).get("tokenizer") or {}).get("path")
    except (OSError, ValueError, AttributeError):
        pass  # none recorded: the line asks for the tokenizer it was made with
    if isinstance(recorded, str):
        line = f"it was made with --tokenizer {shell_word(recorded)}: pass that"
    else:
        line = "pass the tokenizer it was made with"
    return line + f" (megapar-train --data {shell_word(prefix)} takes it by itself)"


def _sentencepiece_unsuffixed(spec: str) -> str | None:
    """The line for a --tokenizer `spec` that is a SentencePiece model file not named
    ``.model`` (the name megapar tells a SentencePiece model by), else None."""
    try:
        spm.SentencePieceProcessor(model_file=spec)
    except (RuntimeError, OSError):  # not a SentencePiece model
        return None
    return (
        f"tokenizer {spec!r} is a SentencePiece model, but megapar takes one by its .model "
        f"suffix; rename it (mv {shell_word(spec)} {shell_word(spec + '.model')}) and pass "
        f"--tokenizer {shell_word(spec + '.model')}"
    )


def load_tokenizer(spec: str | os.PathLike | dict) -> Tokenizer:
    """Load a tokenizer from ``spec`` (see the module docstring), or from a
    ``Tokenizer.spec()`` dict.

    Loaded once per process: a later call naming the same tokenizer (`_location`), while its
    files are unchanged (`_files_read`), returns the same object (nothing mutates a loaded
    `Tokenizer`), so a run's checks, its data preparation and its forked workers share one
    load."""
    if isinstance(spec, dict):
        if "path" not in spec:
            raise ValueError(f"tokenizer spec {spec!r} has no 'path'; pass a Tokenizer.spec() dict")
        location: str | os.PathLike = spec["path"]
    else:
        location = spec
    spec = os.path.expanduser(os.fspath(location))  # '~/tok' quoted, or from a --config file
    spec = moved_asset(spec) or spec  # a shipped file recorded by another install of megapar
    spec = _MOVED.get(spec, spec)  # a dataset's tokenizer whose copy the run gave (`moved_to`)
    where = _location(spec)
    key = (where, _files_read(where))
    tok = _LOADED.get(key)
    if tok is None:
        tok = _load(spec)  # one that raises is not kept
        while len(_LOADED) >= _KEEP:
            del _LOADED[next(iter(_LOADED))]  # the oldest
        _LOADED[key] = tok
    return tok


_LOADED: dict[tuple[str, tuple], Tokenizer] = {}
"""The tokenizers this process loaded, by where they are and the state of their files
(`_location`, `_files_read`); forked workers inherit them."""
_KEEP = 8
"""At most this many kept (a test process loads many)."""


_MOVED: dict[str, str] = {}
"""Recorded tokenizer paths this process reads from elsewhere: a copy of the same files
(`moved_to`); forked workers inherit them."""


def moved_to(recorded: str, here: str) -> None:
    """Read the tokenizer recorded at `recorded` (a prepared dataset's, moved or changed since)
    from `here`, where a copy of the files it was made with lies (checked by the caller, which
    compared their sha256), for the rest of this process."""
    _MOVED[os.path.expanduser(recorded)] = here


def forget_loaded() -> None:
    """Drop the tokenizers this process keeps (a rank calls it once its datasets are built:
    training needs none, and their memory goes back to the heap the steps allocate from)."""
    _LOADED.clear()


def _location(spec: str) -> str:
    """Where `spec` loads from, whatever its spelling: "gpt2", or an absolute path (the shipped
    SentencePiece model for "sentencepiece", a transformers directory for its tokenizer.json),
    as the loaded tokenizer's `path` records it."""
    if spec == "gpt2":
        return spec
    if spec == "sentencepiece":
        return asset_path("botchan_en_unigram_1000.model")
    path = os.path.abspath(spec)
    if os.path.basename(path) == "tokenizer.json" and os.path.isfile(path):
        return os.path.dirname(path)
    return path


def _files_read(where: str) -> tuple:
    """What identifies the files a tokenizer at `where` (`_location`) is loaded from (each
    one's inode, size, modification and change times): GPT-2's assets, the file, or every file
    of the directory. A changed file gives another key, so it is loaded again."""
    if where == "gpt2":
        paths = [asset_path("gpt2_vocab.json"), asset_path("gpt2_merges.txt")]
    elif os.path.isdir(where):
        paths = sorted(e.path for e in os.scandir(where) if e.is_file())
    else:
        paths = [where]
    stats = []
    for path in paths:
        try:
            stats.append(_file_state(path))
        except OSError:
            continue  # loading it says what is missing
    return tuple(stats)


def _load(spec: str) -> Tokenizer:
    if spec == "gpt2":
        return _load_gpt2_bpe(asset_path("gpt2_vocab.json"), asset_path("gpt2_merges.txt"), "gpt2")
    if spec == "sentencepiece":
        return _load_sentencepiece(asset_path("botchan_en_unigram_1000.model"))
    if os.path.basename(spec) == "tokenizer.json" and os.path.isfile(spec):
        spec = os.path.dirname(os.path.abspath(spec))
    if os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "tokenizer.json")):
        return load_hf_tokenizer(os.path.abspath(spec))
    if os.path.isdir(spec):
        vocab, merges = os.path.join(spec, "vocab.json"), os.path.join(spec, "merges.txt")
        missing = [p for p in (vocab, merges) if not os.path.isfile(p)]
        models = sorted(n for n in os.listdir(spec) if n.endswith(".model"))
        if missing and models:  # a directory of SentencePiece models: the file is the spec
            bos = sentencepiece_dir_bos(spec)
            raise FileNotFoundError(
                f"tokenizer directory {spec!r} holds SentencePiece model(s) "
                f"({', '.join(models[:3])}), not a tokenizer.json or vocab.json + merges.txt; "
                + (
                    bos
                    if bos
                    else f"pass the model file itself, e.g. {os.path.join(spec, models[0])} "
                    f"(read as SentencePiece reads it: no BOS starts a document, as "
                    f"transformers' LlamaTokenizer reads a tokenizer.model whose directory's "
                    f"tokenizer_config.json does not set add_bos_token)"
                )
            )
        if missing and os.path.isfile(os.path.join(spec, "vocab.txt")):  # BERT's WordPiece
            raise FileNotFoundError(
                f"tokenizer directory {spec!r} holds a WordPiece vocab.txt (BERT's) but no "
                f"tokenizer.json, which megapar reads; write one beside it: python3 -c "
                f'"from transformers import BertTokenizerFast as T; '
                f'T.from_pretrained({spec!r}).save_pretrained({spec!r})"'
            )
        datasets = sorted(
            prefix
            for n in os.listdir(spec)
            if n.endswith(".json") and (prefix := dataset_of(os.path.join(spec, n)))
        )
        if missing and datasets:  # megapar-data's output directory
            raise FileNotFoundError(
                f"tokenizer directory {spec!r} holds tokenized datasets ("
                f"{', '.join(os.path.basename(d) for d in datasets[:3])}), not a tokenizer; "
                f"{datasets[0]}: {_made_with(datasets[0])}"
            )
        if len(missing) == 2 and os.path.isfile(os.path.join(spec, "tokenizer_config.json")):
            raise FileNotFoundError(  # e.g. a Llama's tokenizer_config.json without its model
                f"tokenizer directory {spec!r} holds a tokenizer_config.json but no tokenizer "
                f"files: none of tokenizer.json, tokenizer.model or vocab.json + merges.txt "
                f"(copy the model's own tokenizer files there)"
            )
        if missing:
            raise FileNotFoundError(
                f"tokenizer directory {spec!r} lacks "
                f"{', '.join(os.path.basename(m) for m in missing)}; "
                "a GPT-2 BPE directory needs vocab.json and merges.txt"
            )
        tok = _load_gpt2_bpe(vocab, merges, os.path.abspath(spec))
        _check_merges_complete(vocab, merges)
        if not tok.encode(PROBE_TEXT):
            raise ValueError(
                f"tokenizer {spec} encodes text to nothing: its vocab.json has "
                f"{tok.base_vocab_size:,} tokens and merges.txt {_count_merges(merges):,} merges; "
                f"point --tokenizer at a complete GPT-2 style vocab.json + merges.txt"
            )
        return tok
    if os.path.isfile(spec) and spec.endswith(".model"):
        return _load_sentencepiece(os.path.abspath(spec))
    if os.path.isfile(spec) and os.path.basename(spec) in ("vocab.json", "merges.txt", "vocab.txt"):
        raise ValueError(
            f"tokenizer {spec!r} is one file of a tokenizer; pass the directory holding it: "
            f"{os.path.dirname(spec) or '.'}"
        )
    meant = None if os.path.exists(spec) else _meant_instead(spec)
    if os.path.isfile(spec):  # a tokenized dataset's file, or a model named without .model
        prefix = dataset_of(spec)
        meant = _dataset_line(spec, prefix) if prefix else _sentencepiece_unsuffixed(spec)
    if meant is not None:
        raise ValueError(meant)
    if (
        _HUB_ID.fullmatch(spec)
        and not spec.endswith((".model", ".json", ".txt"))
        and not os.path.exists(spec.split("/")[0])  # data/tok: a path, its file missing
    ):
        raise ValueError(
            f"tokenizer {spec!r}: no such file or directory, and nothing is downloaded; for the "
            f"Hugging Face Hub model {spec}, save its tokenizer to a local directory first "
            f"(huggingface-cli download {spec} --local-dir DIR) and pass --tokenizer DIR"
        )
    if not os.path.exists(spec) and (os.sep in spec or spec.endswith((".model", ".json"))):
        raise ValueError(
            f"tokenizer {spec!r}: no such file or directory{_misspelt(spec)}; pass an existing "
            "SentencePiece .model file or tokenizer directory, or 'gpt2' / 'sentencepiece'"
        )
    if spec.lower() in MEGATRON_TOKENIZER_TYPES:
        raise ValueError(
            f"tokenizer {spec!r} is Megatron-LM's --tokenizer-type; megapar's --tokenizer names "
            f"the tokenizer itself: --tokenizer {MEGATRON_TOKENIZER_TYPES[spec.lower()]}"
        )
    raise ValueError(
        f"unknown tokenizer {spec!r}{_misspelt(spec)}: use 'gpt2', 'sentencepiece', a "
        "directory with "
        "tokenizer.json (transformers) or vocab.json + merges.txt, or the path of an existing "
        "SentencePiece .model file (nothing is downloaded: a Hugging Face Hub name needs its "
        "tokenizer saved to a local directory first)"
    )


def sentencepiece_dir_bos(directory: str, then: str | None = None) -> str | None:
    """Where megapar and transformers would tokenize a directory's SentencePiece
    ``tokenizer.model`` (no ``tokenizer.json``) differently, the clause saying so and how to
    match them; else None. megapar reads the model file as SentencePiece does (no BOS starts a
    document); transformers' LlamaTokenizer (5.x, which megapar requires) adds the BOS where
    the directory's ``tokenizer_config.json`` sets ``"add_bos_token": true`` (Llama 2's
    directories do; transformers 4.x added it even without). A ``tokenizer.json`` saved beside
    it is read with its BOS, which starts every document (`load_hf_tokenizer`). `then`: what to
    do once it is written (default: pass the directory as --tokenizer)."""
    path = os.path.expanduser(directory)
    model = os.path.join(path, "tokenizer.model")
    config_path = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(model) or os.path.isfile(os.path.join(path, "tokenizer.json")):
        return None
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("add_bos_token") is not True:
        return None
    bos = config.get("bos_token", "<s>")
    bos = bos.get("content") if isinstance(bos, dict) else bos
    if not isinstance(bos, str):
        return None
    return (
        f"its tokenizer_config.json sets add_bos_token, so transformers' LlamaTokenizer starts "
        f"every text with {bos}, and megapar, reading {model} as SentencePiece, would not; to "
        f"start every document with it as transformers does, write the directory's "
        f'tokenizer.json (python3 -c "from transformers import AutoTokenizer as T; '
        f"T.from_pretrained('{directory}').save_pretrained('{directory}')\") and "
        + (then or f"pass the directory (or pass {model} for documents without it)")
    )


def hf_dir_tokenizer(directory: str) -> str | None:
    """The tokenizer a transformers directory holds, as a --tokenizer spec: the directory itself
    (``tokenizer.json``, or a GPT-2 style ``vocab.json`` + ``merges.txt``), its SentencePiece
    ``tokenizer.model``, or None when it holds none of them."""
    path = os.path.expanduser(directory)
    names = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model")
    has = {n for n in names if os.path.isfile(os.path.join(path, n))}
    if "tokenizer.json" in has or {"vocab.json", "merges.txt"} <= has:
        return directory
    if "tokenizer.model" in has:
        return os.path.join(directory, "tokenizer.model")
    return None
